"""Score centering ([mismatch] §4, Eq. 7 and 9, and its top-k note; [sc]).

The centered token score is w(a) s(a) − E_q[w s]. With logits-independent coefficients the
expectation is a sum over next-token log-probabilities, so the loss only needs log p at the
sampler's head ids H:

- full vocabulary (the head covers the sampler's support):
      correction = Σ_H sg(q_j f(p_j/q_j)) · log p_j
- top-k, tail of q modelled as ρ·p with ρ = max(1 − Σ_H q, ε) / max(1 − Σ_H p, ε):
      α = ρ f(1/ρ),   correction = Σ_H sg(q_j f(p_j/q_j) − α p_j) · log p_j
  (Σ_all p_j s_j = 0 turns the tail's ρ p f(1/ρ) weight into −α p on the head.)

loss_token = −A · (w_y log p_y − correction): the centering adds +A · correction per token.
Every coefficient is detached; differentiating through the reconstruction would change the update.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from driftless.diagnostics.metrics import LOG_RATIO_CLAMP, masked_mean

TAIL_EPS = 1e-6  # [sc]'s reference implementation guard on a degenerate (≤ 0) tail mass
FULL_HEAD_TOL = 1e-4  # a head whose sampler mass is within this of 1 covers the support


@dataclass
class Head:
    """The sampler's top-k head at each position and the trainer's log p at the same ids."""

    sampler_logp: torch.Tensor  # [B, L, k] log q at H (−inf where q = 0)
    trainer_logp: torch.Tensor  # [B, L, k] log p at H (differentiable)
    sampler_mass: torch.Tensor  # [B, L] Σ_H q
    trainer_mass: torch.Tensor  # [B, L] Σ_H p (detached)
    rho: torch.Tensor  # [B, L] tail ratio (0 when the head covers the sampler's support)
    full: bool  # the head covers the sampler's whole support on every action token


def build_head(sampler_head_logp, trainer_head_logp, mask, top_k: int | None, require_full: bool = False) -> Head:
    """Select the first ``top_k`` head entries (heads are stored sorted by descending q).

    A stored head shorter than ``top_k`` is used whole: when it covers the sampler's support the
    result is exact, otherwise its tail is reconstructed as usual.

    ``require_full``: the head must cover the sampler's support (full-vocabulary centering).
    """
    if sampler_head_logp is None or trainer_head_logp is None:
        raise ValueError(
            "score centering and the sampler KL need the sampler's head (batch.sampler_topk_logp) and "
            "the trainer's log p at those ids (trainer_view.head_logp); got None"
        )
    if sampler_head_logp.shape != trainer_head_logp.shape:
        raise ValueError(
            f"sampler_topk_logp {tuple(sampler_head_logp.shape)} and trainer head_logp "
            f"{tuple(trainer_head_logp.shape)} must have the same shape"
        )
    # top_k caps how many stored entries are read; a shorter stored head is used whole (guard).
    if top_k is not None:
        sampler_head_logp = sampler_head_logp[..., :top_k]
        trainer_head_logp = trainer_head_logp[..., :top_k]
    on = mask.bool()
    lq = torch.where(on[..., None], sampler_head_logp.detach(), torch.full_like(sampler_head_logp, -torch.inf))
    if torch.isnan(lq).any() or (lq > 1e-6).any():
        raise ValueError("sampler_topk_logp holds NaN or log-probabilities > 0 on action tokens")
    q_mass = lq.exp().sum(-1)
    if (q_mass > 1 + 1e-3).any():
        raise ValueError(
            f"sampler head mass Σ_H q exceeds 1 (max {float(q_mass.max()):.6f}): sampler_topk_logp is "
            "not a set of distinct token log-probabilities of one distribution"
        )
    lp = torch.where(on[..., None], trainer_head_logp, torch.zeros_like(trainer_head_logp))
    if not torch.isfinite(lp).all():
        raise ValueError("trainer head_logp holds NaN or ±inf on action tokens")
    p_mass = lp.detach().exp().sum(-1)
    covers = (q_mass >= 1 - FULL_HEAD_TOL) | ~on
    full = bool(covers.all())
    if require_full and not full:
        worst = float(q_mass[on].min()) if on.any() else 1.0
        raise ValueError(
            "top_k=None (full-vocabulary centering) needs a sampler head that covers its support; the "
            f"stored head holds only {worst:.4f} of the sampler mass on some token: store k = V or set top_k"
        )
    rho = (1 - q_mass).clamp(min=TAIL_EPS) / (1 - p_mass).clamp(min=TAIL_EPS)
    rho = torch.where(covers, torch.zeros_like(rho), rho)
    return Head(lq, lp, q_mass, p_mass, rho, full)


def expected_weighted_score_coef(head: Head, f) -> torch.Tensor:
    """Detached coefficients c_j on log p_j (j ∈ H) with Σ_H c_j ∇log p_j = E_q̂[f(p/q) s]."""
    lq, lp = head.sampler_logp, head.trainer_logp.detach()
    q = lq.exp()
    ratio = torch.exp((lp - lq).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
    coef = torch.where(q > 0, q * f(ratio), torch.zeros_like(q))
    rho = head.rho
    safe_rho = torch.where(rho > 0, rho, torch.ones_like(rho))
    alpha = torch.where(rho > 0, rho * f(1.0 / safe_rho), torch.zeros_like(rho))
    coef = coef - alpha[..., None] * lp.exp()
    return coef.detach()


@dataclass(frozen=True)
class ScoreCentering:
    """Subtract the sampler-expected (weighted) score: full vocabulary (top_k=None) or top-k."""

    top_k: int | None = 128

    def __post_init__(self):
        if self.top_k is not None and (not isinstance(self.top_k, int) or self.top_k < 1):
            raise ValueError(f"top_k must be a positive integer or None, got {self.top_k!r}")

    def __call__(self, inp, head: Head, f):
        coef = expected_weighted_score_coef(head, f)  # [B, L, k]
        correction = (coef * head.trainer_logp).sum(-1)  # Σ_H sg(c_j) log p_j, gradient E_q̂[w s]
        # L1 norm of the subtracted logit-space vector E_q̂[w s_z] = c − p·Σc (head) and −p·Σc (tail)
        total = coef.sum(-1, keepdim=True)
        p_head = head.trainer_logp.detach().exp()
        l1 = (coef - p_head * total).abs().sum(-1) + (1 - head.trainer_mass).clamp(min=0) * total.squeeze(-1).abs()
        metrics = {"centering_l1": masked_mean(l1, inp.mask)}
        return inp.advantage * correction, metrics

    def describe(self) -> str:
        k = "full vocabulary" if self.top_k is None else f"top-{self.top_k}, tail ρ·p"
        return f"+A · Σ_H sg(q f(p/q) − α p) log p ({k})"
