"""Penalties added per token: the sampler KL(q‖p) (Eq. 8) and a reference-policy KL.

Sampler KL with a frozen sampler contributes −β ∇KL(q‖p) = β E_q[s] to the ascent direction.
Exact when the head covers the sampler's support; otherwise q is reconstructed as the head plus
a ρ·p tail ([mismatch] top-k note), giving

    KL(q̂‖p) = Σ_H q_j (log q_j − log p_j) + (1 − Σ_H q) log ρ,
    ∇KL     = −Σ_H q_j s_j + ρ Σ_H p_j s_j          (since Σ_tail p s = −Σ_H p s).

The per-token value is the estimate; the gradient is the one above (q̂ held fixed).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from driftless.diagnostics.metrics import LOG_RATIO_CLAMP, masked_mean
from driftless.objectives.centering import Head


def sampler_kl_per_token(head: Head) -> torch.Tensor:
    """Per-token KL(q̂‖p) with the gradient of Eq. 8's penalty (q̂ detached)."""
    lq, lp = head.sampler_logp, head.trainer_logp
    q = lq.exp()
    safe_lq = torch.where(q > 0, lq, torch.zeros_like(lq))
    head_kl = torch.where(q > 0, q * (safe_lq - lp), torch.zeros_like(lp)).sum(-1)
    rho = head.rho
    tail_mass = (1 - head.sampler_mass).clamp(min=0)
    tail_value = torch.where(rho > 0, tail_mass * torch.log(rho.clamp(min=1e-30)), torch.zeros_like(rho))
    p_head = lp.detach().exp()
    tail_grad = rho * (p_head * (lp - lp.detach())).sum(-1)  # value 0, gradient ρ Σ_H p s
    return head_kl + tail_value.detach() + tail_grad


@dataclass(frozen=True)
class SamplerKL:
    """β · KL(q‖p) on every action token (exact with a full head, head + ρ·p tail otherwise)."""

    beta: float = 0.2
    needs_head = True

    def __post_init__(self):
        if not self.beta >= 0:
            raise ValueError(f"beta must be >= 0, got {self.beta}")

    def __call__(self, inp, head: Head):
        kl = sampler_kl_per_token(head)
        return self.beta * kl, {"sampler_kl": masked_mean(kl.detach(), inp.mask)}

    def describe(self) -> str:
        return f"+{self.beta} · KL(q‖p)"


@dataclass(frozen=True)
class ReferenceKL:
    """β · KL estimate between the trainer and a fixed reference policy on sampled tokens.

    ``k1`` = log p − log p_ref, ``k2`` = ½ (log p − log p_ref)², ``k3`` = e^{−d} − 1 + d with
    d = log p − log p_ref (Schulman's estimators; k3 is GRPO's choice).
    """

    beta: float = 0.001
    estimator: str = "k3"
    needs_head = False

    def __post_init__(self):
        if self.estimator not in ("k1", "k2", "k3"):
            raise ValueError(f"estimator must be 'k1', 'k2' or 'k3', got {self.estimator!r}")
        if not self.beta >= 0:
            raise ValueError(f"beta must be >= 0, got {self.beta}")

    def __call__(self, inp, head=None):
        if inp.ref_logp is None:
            raise ValueError("the reference KL needs batch.ref_logp (log p_ref of each sampled token); got None")
        d = (inp.trainer_logp - inp.ref_logp).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
        if self.estimator == "k1":
            kl = d
        elif self.estimator == "k2":
            kl = 0.5 * d * d
        else:
            kl = torch.expm1(-d) + d
        return self.beta * kl, {f"ref_kl_{self.estimator}": masked_mean(kl.detach(), inp.mask)}

    def describe(self) -> str:
        return f"+{self.beta} · {self.estimator}(p, p_ref)"
