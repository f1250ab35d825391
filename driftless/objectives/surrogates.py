"""Surrogates: the per-token policy-gradient term, given a detached behaviour weight.

Each surrogate maps (inputs, weight) to a per-token loss ``[B, L]`` whose negative gradient is the
token's contribution to the ascent direction. Only ``trainer_logp`` carries gradient.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from driftless.diagnostics.metrics import LOG_RATIO_CLAMP, masked_mean


def _ratio(log_num: torch.Tensor, log_den: torch.Tensor) -> torch.Tensor:
    return torch.exp((log_num - log_den).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))


@dataclass(frozen=True)
class Reinforce:
    """Score function: loss = −w · A · log p   (gradient −w A ∇log p)."""

    uses_anchor = False

    def __call__(self, inp, weight):
        loss = -weight * inp.advantage * inp.trainer_logp
        return loss, {}

    def describe(self) -> str:
        return "−w · A · log p"


@dataclass(frozen=True)
class UnclippedRatio:
    """REINFORCE Zero's form (Eq. 11): loss = −A · p/q with a differentiable numerator.

    Its gradient is −A (p/q) ∇log p (Eq. 12); the loss carries no explicit log-probability.
    """

    uses_anchor = False

    def __call__(self, inp, weight):
        ratio = _ratio(inp.trainer_logp, inp.sampler_logp)  # p/q, gradient through p
        return -weight * inp.advantage * ratio, {}

    def describe(self) -> str:
        return "−A · p/q"


@dataclass(frozen=True)
class PPOClip:
    """PPO's clipped surrogate against the anchor π0 (Eq. 3 with the weight as w̄).

    loss = −w · min(r A, clip(r, 1−eps_low, 1+eps_high) A),  r = p/π0;
    with ``dual_clip`` = c > 1, negative-advantage tokens are bounded by c·A as well.
    """

    eps_low: float = 0.2
    eps_high: float = 0.2
    dual_clip: float | None = None
    uses_anchor = True

    def __post_init__(self):
        if not self.eps_low >= 0 or not self.eps_high >= 0:
            raise ValueError(f"eps_low and eps_high must be >= 0, got {self.eps_low}, {self.eps_high}")
        if self.dual_clip is not None and not self.dual_clip > 1:
            raise ValueError(f"dual_clip must be > 1 (or None), got {self.dual_clip}")

    def __call__(self, inp, weight):
        adv = inp.advantage
        ratio = _ratio(inp.trainer_logp, inp.anchor_logp)
        unclipped = ratio * adv
        clipped = ratio.clamp(1 - self.eps_low, 1 + self.eps_high) * adv
        objective = torch.minimum(unclipped, clipped)
        metrics = {"clip_fraction": masked_mean((clipped < unclipped).float(), inp.mask)}
        if self.dual_clip is not None:
            floor = self.dual_clip * adv
            dual = (adv < 0) & (objective < floor)
            objective = torch.where(dual, floor, objective)
            metrics["dual_clip_fraction"] = masked_mean(dual.float(), inp.mask)
        metrics["anchor_ratio_mean"] = masked_mean(ratio.detach(), inp.mask)
        return -weight * objective, metrics

    def describe(self) -> str:
        s = f"−w · min(rA, clip(r, 1−{self.eps_low}, 1+{self.eps_high})A), r = p/π0"
        return s + (f", dual clip {self.dual_clip}" if self.dual_clip else "")


@dataclass(frozen=True)
class GSPOClip:
    """GSPO: PPO clipping on the sequence's geometric-mean ratio s_i = exp(mean_t log(p/π0)).

    The token's ratio is sg(s_i) · p_t / sg(p_t), so each token gets gradient s_i A ∇log p_t.
    """

    eps_low: float = 3e-4
    eps_high: float = 4e-4
    uses_anchor = True

    def __call__(self, inp, weight):
        m = inp.mask
        log_r = torch.where(m.bool(), inp.trainer_logp - inp.anchor_logp, torch.zeros_like(m))
        seq_log_r = (log_r.sum(-1, keepdim=True) / m.sum(-1, keepdim=True).clamp(min=1)).detach()
        token_log_r = seq_log_r + inp.trainer_logp - inp.trainer_logp.detach()
        ratio = torch.exp(token_log_r.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
        adv = inp.advantage
        unclipped = ratio * adv
        clipped = ratio.clamp(1 - self.eps_low, 1 + self.eps_high) * adv
        metrics = {"clip_fraction": masked_mean((clipped < unclipped).float(), m)}
        return -weight * torch.minimum(unclipped, clipped), metrics

    def describe(self) -> str:
        return f"−w · min(sA, clip(s, 1−{self.eps_low}, 1+{self.eps_high})A), s = exp(mean log p/π0)"


@dataclass(frozen=True)
class CISPO:
    """CISPO: loss = −w · sg(clip(r, 1−eps_low, 1+eps_high)) · A · log p,  r = p/π0."""

    eps_low: float = 1.0
    eps_high: float = 0.28
    uses_anchor = True

    def __call__(self, inp, weight):
        ratio = _ratio(inp.trainer_logp, inp.anchor_logp).detach()
        clipped = ratio.clamp(1 - self.eps_low, 1 + self.eps_high)
        metrics = {"clip_fraction": masked_mean((clipped != ratio).float(), inp.mask)}
        return -weight * clipped * inp.advantage * inp.trainer_logp, metrics

    def describe(self) -> str:
        return f"−w · sg(clip(r, 1−{self.eps_low}, 1+{self.eps_high})) · A · log p"
