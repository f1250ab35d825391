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


DIVERGENCES = ("tv", "kl")


@dataclass(frozen=True)
class DivergenceMask:
    """DPPO's trust region ([dppo], Qi et al. 2026, "Rethinking the Trust Region in LLM Reinforcement Learning"):
    loss = −w · m · A · log p, with m = 0 on tokens whose binary divergence from the sampler has left the
    region in the direction the advantage pushes, 1 elsewhere; w is the (detached, truncated) weight.

    With μ = q(a) the sampler's probability of the recorded token and p = p_θ(a):

    - ``tv``: D = p − μ (the binary total variation |p − μ| with its sign); A > 0 is masked when
      D > delta_high (moved up too far), A < 0 when D < −delta_low (moved down too far).
    - ``kl``: D = μ log(μ/p) + (1 − μ) log((1 − μ)/(1 − p)) (binary KL); A > 0 is masked when
      D > delta_high and p > μ, A < 0 when D > delta_low and p < μ.

    Tokens with A = 0 are never masked (their loss is 0 anyway). The region is anchored to the
    sampler's recorded log q: the mismatch itself counts as movement.
    """

    divergence: str = "tv"
    delta_low: float = 0.15
    delta_high: float = 0.15
    uses_anchor = False

    def __post_init__(self):
        if self.divergence not in DIVERGENCES:
            raise ValueError(f"divergence must be one of {DIVERGENCES}, got {self.divergence!r}")
        if not self.delta_low > 0 or not self.delta_high > 0:
            raise ValueError(f"delta_low and delta_high must be > 0, got {self.delta_low}, {self.delta_high}")

    def keep(self, trainer_logp: torch.Tensor, sampler_logp: torch.Tensor, advantage: torch.Tensor) -> torch.Tensor:
        """The mask m (bool, detached): True where the token still contributes."""
        lp, lq = trainer_logp.detach().double(), sampler_logp.detach().double()
        p, mu = lp.exp(), lq.exp()
        if self.divergence == "tv":
            up_ok, down_ok = p - mu <= self.delta_high, p - mu >= -self.delta_low
        else:
            # binary KL(μ‖p) over {a, not a}; log1p(−x) keeps 1 − p accurate when p is near 0
            kl = mu * (lq - lp) + (1 - mu) * (torch.log1p(-mu.clamp(max=1 - 1e-12)) - torch.log1p(-p.clamp(max=1 - 1e-12)))
            up_ok, down_ok = (kl <= self.delta_high) | (p <= mu), (kl <= self.delta_low) | (p >= mu)
        return torch.where(advantage > 0, up_ok, torch.where(advantage < 0, down_ok, torch.ones_like(up_ok)))

    def __call__(self, inp, weight):
        keep = self.keep(inp.trainer_logp, inp.sampler_logp, inp.advantage).to(inp.mask.dtype)
        metrics = {"masked_fraction": masked_mean(1 - keep, inp.mask)}
        return -weight * keep * inp.advantage * inp.trainer_logp, metrics

    def describe(self) -> str:
        d = "p − q" if self.divergence == "tv" else "binary KL(q‖p)"
        return (f"−w · m · A · log p, m = 0 where {d} leaves [−{self.delta_low}, {self.delta_high}] "
                f"in the advantage's direction")
