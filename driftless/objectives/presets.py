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
| dppo-tv        | min(p/q, 20)      | REINFORCE, TV mask   |           |         | token-mean          |
| dppo-kl        | min(p/q, 20)      | REINFORCE, KL mask   |           |         | token-mean          |
| sc             | none              | REINFORCE            | top-k     |         | token-mean          |
| sc+tis         | min(p/q, cap)     | REINFORCE            | weighted  |         | token-mean          |
| sc+mis         | p/q in band       | REINFORCE            | weighted  |         | token-mean          |
| sc+kl          | none              | REINFORCE            | top-k     | β KL(q‖p) | token-mean        |
| sc+tis+kl      | min(p/q, cap)     | REINFORCE            | weighted  | β KL(q‖p) | token-mean        |
| reinforce-zero | none              | −A p/q (unclipped)   |           |         | seq-mean-token-mean |
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from driftless.objectives.centering import ScoreCentering
from driftless.objectives.objective import Objective
from driftless.objectives.penalties import ReferenceKL, SamplerKL
from driftless.objectives.reductions import REDUCTIONS
from driftless.objectives.surrogates import CISPO, DivergenceMask, GSPOClip, PPOClip, Reinforce, UnclippedRatio
from driftless.objectives.weights import LEVELS, Weight

_COMMON = ("reduction", "ref_kl_beta", "ref_kl_estimator")
_COMMON_DEFAULTS = {"reduction": "token-mean", "ref_kl_beta": 0.0, "ref_kl_estimator": "k3"}
_PPO = {"eps_low": 0.2, "eps_high": 0.2, "dual_clip": None}


@dataclass(frozen=True)
class Preset:
    """One named objective: the parameters it takes, their defaults, and how its parts are built."""

    name: str
    defaults: dict
    build: Callable[[dict], dict]  # parameters -> Objective keyword arguments (weight, surrogate, ...)

    @property
    def params(self) -> tuple[str, ...]:
        return _COMMON + tuple(k for k in self.defaults if k not in _COMMON)


PRESETS: dict[str, Preset] = {}


def preset(name: str, **defaults):
    """Register the decorated builder as preset ``name`` with these parameters and defaults."""
    def register(build):
        PRESETS[name] = Preset(name, defaults, build)
        return build
    return register


def _level(p) -> str:
    if p["level"] not in LEVELS:
        raise ValueError(f"level must be one of {LEVELS}, got {p['level']!r}")
    return p["level"]


def _ppo(p) -> PPOClip:
    return PPOClip(p["eps_low"], p["eps_high"], p["dual_clip"])


@preset("pg")
def _pg(p):
    return {}


@preset("is", level="token")
def _is(p):
    return {"weight": Weight("is", level=_level(p))}


@preset("tis", cap=2.0, level="token")
def _tis(p):
    return {"weight": Weight("tis", level=_level(p), cap=p["cap"])}


@preset("mis", lower=0.5, upper=5.0, level="token")
def _mis(p):
    return {"weight": Weight("mis", level=_level(p), lower=p["lower"], upper=p["upper"])}


@preset("icepop", lower=0.5, upper=5.0, level="token", variant="keep", **_PPO)
def _icepop(p):
    if p["variant"] not in ("keep", "unit"):
        raise ValueError(f"icepop variant must be 'keep' (w = π0/q in band) or 'unit' (w = 1 in band), got {p['variant']!r}")
    kind = "mis" if p["variant"] == "keep" else "band"
    return {"weight": Weight(kind, level=_level(p), lower=p["lower"], upper=p["upper"], target="anchor"),
            "surrogate": _ppo(p)}


@preset("ppo", **_PPO)
def _ppo_preset(p):
    return {"surrogate": _ppo(p)}


@preset("ppo+tis", **_PPO, cap=2.0, level="token")
def _ppo_tis(p):
    return {"weight": Weight("tis", level=_level(p), cap=p["cap"], target="anchor"), "surrogate": _ppo(p)}


@preset("dapo", **{**_PPO, "eps_high": 0.28})
def _dapo(p):
    return {"surrogate": _ppo(p)}


@preset("gspo", eps_low=3e-4, eps_high=4e-4, reduction="seq-mean-token-mean")
def _gspo(p):
    return {"surrogate": GSPOClip(p["eps_low"], p["eps_high"])}


@preset("cispo", eps_low=1.0, eps_high=0.28)
def _cispo(p):
    return {"surrogate": CISPO(p["eps_low"], p["eps_high"])}


@preset("dppo-tv", delta_low=0.15, delta_high=0.15, cap=20.0)
def _dppo_tv(p):
    return {"weight": Weight("tis", cap=p["cap"]), "surrogate": DivergenceMask("tv", p["delta_low"], p["delta_high"])}


@preset("dppo-kl", delta_low=0.05, delta_high=0.05, cap=20.0)
def _dppo_kl(p):
    return {"weight": Weight("tis", cap=p["cap"]), "surrogate": DivergenceMask("kl", p["delta_low"], p["delta_high"])}


@preset("sc", top_k=128)
def _sc(p):
    return {"centering": ScoreCentering(top_k=p["top_k"])}


@preset("sc+tis", top_k=128, cap=2.0)
def _sc_tis(p):
    return {"centering": ScoreCentering(top_k=p["top_k"]), "weight": Weight("tis", cap=p["cap"])}


@preset("sc+mis", top_k=128, lower=0.5, upper=5.0)
def _sc_mis(p):
    return {"centering": ScoreCentering(top_k=p["top_k"]), "weight": Weight("mis", lower=p["lower"], upper=p["upper"])}


@preset("sc+kl", top_k=128, beta=0.2)
def _sc_kl(p):
    return {"centering": ScoreCentering(top_k=p["top_k"]), "penalties": [SamplerKL(beta=p["beta"])]}


@preset("sc+tis+kl", top_k=128, cap=2.0, beta=0.2)
def _sc_tis_kl(p):
    """Seed 003's complete recipe: weighted centering under the TIS weight, plus the sampler-KL penalty."""
    return {"centering": ScoreCentering(top_k=p["top_k"]), "weight": Weight("tis", cap=p["cap"]),
            "penalties": [SamplerKL(beta=p["beta"])]}


@preset("reinforce-zero", reduction="seq-mean-token-mean")
def _reinforce_zero(p):
    return {"surrogate": UnclippedRatio()}


PRESET_NAMES = tuple(PRESETS)


def make(name: str, **overrides) -> Objective:
    """Build a preset by name; ``overrides`` must be parameters that preset has."""
    if name not in PRESETS:
        raise ValueError(f"unknown objective preset {name!r}; choose one of {', '.join(PRESET_NAMES)}")
    spec = PRESETS[name]
    unknown = sorted(set(overrides) - set(spec.params))
    if unknown:
        raise ValueError(
            f"preset {name!r} has no parameter {', '.join(map(repr, unknown))}; "
            f"its parameters are {', '.join(spec.params)}"
        )
    p = {**_COMMON_DEFAULTS, **spec.defaults, **overrides}
    if p["reduction"] not in REDUCTIONS:
        raise ValueError(f"reduction must be one of {REDUCTIONS}, got {p['reduction']!r}")
    parts = {"weight": Weight(), "surrogate": Reinforce(), "centering": None, "penalties": [], **spec.build(p)}
    penalties = list(parts.pop("penalties"))
    if p["ref_kl_beta"]:
        penalties.append(ReferenceKL(beta=p["ref_kl_beta"], estimator=p["ref_kl_estimator"]))
    return Objective(**parts, penalties=tuple(penalties), reduction=p["reduction"], name=name)
