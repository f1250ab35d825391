"""Named presets: each is one Objective instance, built by ``make(name, **overrides)``.

| preset         | weight            | surrogate            | centering | penalty | reduction           |
|----------------|-------------------|----------------------|-----------|---------|---------------------|
| pg             | none              | REINFORCE            |           |         | token-mean          |
| is             | exact p/q         | REINFORCE            |           |         | token-mean          |
| tis            | min(p/q, cap)     | REINFORCE            |           |         | token-mean          |
| mis            | p/q in band       | REINFORCE            |           |         | token-mean          |
| icepop         | π0/q in band      | PPO clip             |           |         | token-mean          |
| ppo            | none              | PPO clip             |           |         | token-mean          |
| ppo+tis        | min(π0/q, cap)    | PPO clip (Eq. 3)     |           |         | token-mean          |
| dapo           | none              | PPO clip-higher      |           |         | token-mean          |
| gspo           | none              | GSPO sequence clip   |           |         | seq-mean-token-mean |
| cispo          | none              | CISPO                |           |         | token-mean          |
| sc             | none              | REINFORCE            | top-k     |         | token-mean          |
| sc+tis         | min(p/q, cap)     | REINFORCE            | weighted  |         | token-mean          |
| sc+mis         | p/q in band       | REINFORCE            | weighted  |         | token-mean          |
| sc+kl          | none              | REINFORCE            | top-k     | β KL(q‖p) | token-mean        |
| reinforce-zero | none              | −A p/q (unclipped)   |           |         | seq-mean-token-mean |
"""

from __future__ import annotations

from driftless.objectives.centering import ScoreCentering
from driftless.objectives.objective import Objective
from driftless.objectives.penalties import ReferenceKL, SamplerKL
from driftless.objectives.reductions import REDUCTIONS
from driftless.objectives.surrogates import CISPO, GSPOClip, PPOClip, Reinforce, UnclippedRatio
from driftless.objectives.weights import LEVELS, Weight

_COMMON = ("reduction", "ref_kl_beta", "ref_kl_estimator")
_LEVEL = ("level",)
_PPO = ("eps_low", "eps_high", "dual_clip")

# preset -> (builder kind, allowed parameters, defaults)
PRESETS: dict[str, dict] = {
    "pg": {"params": _COMMON, "defaults": {}},
    "is": {"params": _COMMON + _LEVEL, "defaults": {"level": "token"}},
    "tis": {"params": _COMMON + _LEVEL + ("cap",), "defaults": {"cap": 2.0, "level": "token"}},
    "mis": {"params": _COMMON + _LEVEL + ("lower", "upper"), "defaults": {"lower": 0.5, "upper": 5.0, "level": "token"}},
    "icepop": {
        "params": _COMMON + _LEVEL + _PPO + ("lower", "upper", "variant"),
        "defaults": {"lower": 0.5, "upper": 5.0, "level": "token", "variant": "keep",
                     "eps_low": 0.2, "eps_high": 0.2, "dual_clip": None},
    },
    "ppo": {"params": _COMMON + _PPO, "defaults": {"eps_low": 0.2, "eps_high": 0.2, "dual_clip": None}},
    "ppo+tis": {
        "params": _COMMON + _PPO + _LEVEL + ("cap",),
        "defaults": {"eps_low": 0.2, "eps_high": 0.2, "dual_clip": None, "cap": 2.0, "level": "token"},
    },
    "dapo": {"params": _COMMON + _PPO, "defaults": {"eps_low": 0.2, "eps_high": 0.28, "dual_clip": None}},
    "gspo": {"params": _COMMON + ("eps_low", "eps_high"), "defaults": {"eps_low": 3e-4, "eps_high": 4e-4,
                                                                       "reduction": "seq-mean-token-mean"}},
    "cispo": {"params": _COMMON + ("eps_low", "eps_high"), "defaults": {"eps_low": 1.0, "eps_high": 0.28}},
    "sc": {"params": _COMMON + ("top_k",), "defaults": {"top_k": 128}},
    "sc+tis": {"params": _COMMON + ("top_k", "cap"), "defaults": {"top_k": 128, "cap": 2.0}},
    "sc+mis": {"params": _COMMON + ("top_k", "lower", "upper"), "defaults": {"top_k": 128, "lower": 0.5, "upper": 5.0}},
    "sc+kl": {"params": _COMMON + ("top_k", "beta"), "defaults": {"top_k": 128, "beta": 0.2}},
    "reinforce-zero": {"params": _COMMON, "defaults": {"reduction": "seq-mean-token-mean"}},
}

PRESET_NAMES = tuple(PRESETS)


def _check_level(level):
    if level not in LEVELS:
        raise ValueError(f"level must be one of {LEVELS}, got {level!r}")
    return level


def make(name: str, **overrides) -> Objective:
    """Build a preset by name; ``overrides`` must be parameters that preset has."""
    if name not in PRESETS:
        raise ValueError(f"unknown objective preset {name!r}; choose one of {', '.join(PRESET_NAMES)}")
    spec = PRESETS[name]
    unknown = sorted(set(overrides) - set(spec["params"]))
    if unknown:
        raise ValueError(
            f"preset {name!r} has no parameter {', '.join(map(repr, unknown))}; "
            f"its parameters are {', '.join(spec['params'])}"
        )
    p = {"reduction": "token-mean", "ref_kl_beta": 0.0, "ref_kl_estimator": "k3", **spec["defaults"], **overrides}
    if p["reduction"] not in REDUCTIONS:
        raise ValueError(f"reduction must be one of {REDUCTIONS}, got {p['reduction']!r}")

    weight = Weight()
    surrogate = Reinforce()
    centering = None
    penalties: list = []
    level = _check_level(p.get("level", "token"))
    ppo = lambda: PPOClip(p["eps_low"], p["eps_high"], p["dual_clip"])

    if name == "is":
        weight = Weight("is", level=level)
    elif name == "tis":
        weight = Weight("tis", level=level, cap=p["cap"])
    elif name == "mis":
        weight = Weight("mis", level=level, lower=p["lower"], upper=p["upper"])
    elif name == "icepop":
        if p["variant"] not in ("keep", "unit"):
            raise ValueError(f"icepop variant must be 'keep' (w = π0/q in band) or 'unit' (w = 1 in band), got {p['variant']!r}")
        kind = "mis" if p["variant"] == "keep" else "band"
        weight = Weight(kind, level=level, lower=p["lower"], upper=p["upper"], target="anchor")
        surrogate = ppo()
    elif name in ("ppo", "dapo"):
        surrogate = ppo()
    elif name == "ppo+tis":
        weight = Weight("tis", level=level, cap=p["cap"], target="anchor")
        surrogate = ppo()
    elif name == "gspo":
        surrogate = GSPOClip(p["eps_low"], p["eps_high"])
    elif name == "cispo":
        surrogate = CISPO(p["eps_low"], p["eps_high"])
    elif name.startswith("sc"):
        centering = ScoreCentering(top_k=p["top_k"])
        if name == "sc+tis":
            weight = Weight("tis", cap=p["cap"])
        elif name == "sc+mis":
            weight = Weight("mis", lower=p["lower"], upper=p["upper"])
        elif name == "sc+kl":
            penalties.append(SamplerKL(beta=p["beta"]))
    elif name == "reinforce-zero":
        surrogate = UnclippedRatio()
    if p["ref_kl_beta"]:
        penalties.append(ReferenceKL(beta=p["ref_kl_beta"], estimator=p["ref_kl_estimator"]))
    return Objective(weight=weight, surrogate=surrogate, centering=centering, penalties=tuple(penalties),
                     reduction=p["reduction"], name=name)
