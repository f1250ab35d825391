"""Behaviour weights: how much each sampled token counts, from a ratio target / sampler.

The target is the live trainer p (direct ratio p/q, [mismatch] §4.3 onward) or the anchor
π0 (w = π0/q of Eq. 2–3, for PPO + TIS). Every weight is detached. Modes:

- ``None``        exact importance sampling, w = r
- ``"truncate"``  TIS, w = min(r, upper)
- ``"mask"``      MIS, w = r · 1[lower ≤ r ≤ upper]   (the ratio is kept inside the band)
- ``"reject"``    band rejection, w = 1[lower ≤ r ≤ upper]   (the "w = 1 in band" variant)

Levels: ``token`` (one ratio per token), ``sequence`` (product of the row's token ratios,
exp Σ log r), ``geometric`` (exp of the mean log-ratio over the row). Sequence levels broadcast
to every action token of the row. Log-ratios are clamped to ±20 before ``exp``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from driftless.diagnostics.metrics import LOG_RATIO_CLAMP

LEVELS = ("token", "sequence", "geometric")
MODES = (None, "truncate", "mask", "reject")


def _check_band(mode: str | None, lower: float | None, upper: float | None) -> tuple[float | None, float | None]:
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    if mode is None:
        return lower, upper
    if upper is None:
        raise ValueError(f"mode={mode!r} needs upper (got None)")
    if not upper > 0:
        raise ValueError(f"upper must be > 0, got {upper}")
    if mode == "truncate":
        if lower is not None:
            raise ValueError("mode='truncate' caps from above only; lower must be None")
        return None, float(upper)
    if lower is None:
        lower = 1.0 / upper  # verl's default lower bound for a band
    if not 0 <= lower <= upper:
        raise ValueError(f"need 0 <= lower <= upper, got lower={lower}, upper={upper}")
    return float(lower), float(upper)


def apply_mode(ratio: torch.Tensor, mode: str | None, lower: float | None, upper: float | None) -> torch.Tensor:
    """Apply a weight mode elementwise to (detached) ratios."""
    if mode is None:
        return ratio
    if mode == "truncate":
        return ratio.clamp(max=upper)
    in_band = (ratio >= lower) & (ratio <= upper)
    if mode == "mask":
        return torch.where(in_band, ratio, torch.zeros_like(ratio))
    return in_band.to(ratio.dtype)  # "reject"


def level_log_ratio(log_ratio: torch.Tensor, mask: torch.Tensor, level: str) -> torch.Tensor:
    """Per-token log-ratio at the requested level, clamped to ±20, zero off the mask."""
    if level not in LEVELS:
        raise ValueError(f"level must be one of {LEVELS}, got {level!r}")
    log_ratio = torch.where(mask.bool(), log_ratio, torch.zeros_like(log_ratio))
    if level == "sequence":
        log_ratio = log_ratio.sum(-1, keepdim=True).expand_as(log_ratio)
    elif level == "geometric":
        count = mask.sum(-1, keepdim=True).clamp(min=1)
        log_ratio = (log_ratio.sum(-1, keepdim=True) / count).expand_as(log_ratio)
    return log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)


def importance_weights(
    target_logp: torch.Tensor,
    sampler_logp: torch.Tensor,
    mask: torch.Tensor,
    *,
    level: str = "token",
    mode: str | None = None,
    lower: float | None = None,
    upper: float | None = None,
) -> torch.Tensor:
    """Detached importance weights ``[B, L]``, zero on masked-out positions.

    Semantics follow verl's rollout correction: ``truncate`` caps at ``upper``; ``mask`` keeps the
    ratio inside ``[lower, upper]`` and zeroes it outside, with ``lower`` defaulting to
    ``1 / upper``. One deliberate addition: ``reject`` (weight 1 inside the band), the
    pure-rejection variant. Sequence ratios are exp(Σ log r) and geometric ones exp(mean log r),
    both over the row's action tokens; every log-ratio is clamped to ±20 before ``exp``.
    """
    if target_logp.shape != sampler_logp.shape or target_logp.shape != mask.shape:
        raise ValueError(
            f"target_logp {tuple(target_logp.shape)}, sampler_logp {tuple(sampler_logp.shape)} and "
            f"mask {tuple(mask.shape)} must have the same shape"
        )
    lower, upper = _check_band(mode, lower, upper)
    log_ratio = level_log_ratio((target_logp - sampler_logp).detach(), mask, level)
    weight = apply_mode(torch.exp(log_ratio), mode, lower, upper)
    return torch.where(mask.bool(), weight, torch.zeros_like(weight)).detach()


@dataclass(frozen=True)
class Weight:
    """A behaviour-weight part of an objective.

    ``kind``: ``none`` (w = 1), ``is`` (exact), ``tis`` (cap), ``mis`` (ratio kept in band),
    ``band`` (w = 1 in band). ``target``: ``trainer`` (p/q) or ``anchor`` (π0/q).
    """

    kind: str = "none"
    level: str = "token"
    cap: float = 2.0
    lower: float = 0.5
    upper: float = 5.0
    target: str = "trainer"

    KINDS = ("none", "is", "tis", "mis", "band")

    def __post_init__(self):
        if self.kind not in self.KINDS:
            raise ValueError(f"weight kind must be one of {self.KINDS}, got {self.kind!r}")
        if self.level not in LEVELS:
            raise ValueError(f"level must be one of {LEVELS}, got {self.level!r}")
        if self.target not in ("trainer", "anchor"):
            raise ValueError(f"weight target must be 'trainer' or 'anchor', got {self.target!r}")
        if self.kind == "tis" and not self.cap > 0:
            raise ValueError(f"cap must be > 0, got {self.cap}")
        if self.kind in ("mis", "band") and not 0 <= self.lower <= self.upper:
            raise ValueError(f"need 0 <= lower <= upper, got lower={self.lower}, upper={self.upper}")

    @property
    def mode(self) -> tuple[str | None, float | None, float | None]:
        return {
            "none": (None, None, None),
            "is": (None, None, None),
            "tis": ("truncate", None, self.cap),
            "mis": ("mask", self.lower, self.upper),
            "band": ("reject", self.lower, self.upper),
        }[self.kind]

    def f(self, ratio: torch.Tensor) -> torch.Tensor:
        """The token-level weight function f(r) (used by weighted score centering, Eq. 9)."""
        if self.kind == "none":
            return torch.ones_like(ratio)
        mode, lower, upper = self.mode
        return apply_mode(ratio, mode, lower, upper)

    def __call__(self, target_logp: torch.Tensor, sampler_logp: torch.Tensor, mask: torch.Tensor):
        """Returns (weight, raw_ratio) at this weight's level, both detached, zero off the mask."""
        log_ratio = level_log_ratio((target_logp - sampler_logp).detach(), mask, self.level)
        raw = torch.where(mask.bool(), torch.exp(log_ratio), torch.zeros_like(log_ratio))
        if self.kind == "none":
            return mask.to(raw.dtype), raw
        return torch.where(mask.bool(), self.f(raw), torch.zeros_like(raw)), raw

    def describe(self) -> str:
        if self.kind == "none":
            return "w = 1"
        ratio = "p/q" if self.target == "trainer" else "π0/q"
        return {
            "is": f"w = {ratio}",
            "tis": f"w = min({ratio}, {self.cap})",
            "mis": f"w = {ratio} · 1[{self.lower} ≤ r ≤ {self.upper}]",
            "band": f"w = 1[{self.lower} ≤ {ratio} ≤ {self.upper}]",
        }[self.kind] + ("" if self.level == "token" else f" ({self.level} level)")
