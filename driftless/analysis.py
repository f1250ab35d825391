"""Exact single-prefix analysis ([mismatch] §4) and the Eq. 1 log-ratio decomposition.

``expected_logit_update`` treats the logits z at one prefix as free parameters (p = softmax z),
runs the library's own objective on every action a (one one-token response each, weighted by its
sampler probability q_a) and returns the expected ascent direction −E_{a~q}[∇_z loss(a)].
No closed form is used, so it checks the objectives themselves.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace

import torch

from driftless.diagnostics.evidence import eq1_parts
from driftless.objectives import make


def _as_distribution(name: str, x) -> torch.Tensor:
    t = torch.as_tensor(x, dtype=torch.float64).flatten()
    if t.numel() < 2:
        raise ValueError(f"{name} must have at least 2 entries, got {t.numel()}")
    if not torch.isfinite(t).all() or (t < 0).any():
        raise ValueError(f"{name} must be finite and non-negative, got {t.tolist()}")
    if abs(float(t.sum()) - 1.0) > 1e-6:
        raise ValueError(f"{name} must sum to 1, sums to {float(t.sum()):.8f}")
    return t


def expected_logit_update(p, q, advantages, objective: str, **params) -> torch.Tensor:
    """−E_{a~q}[∇_z loss(a)] at one prefix with free logits z, p = softmax(z).

    ``objective`` is a preset name and ``params`` go to ``driftless.objectives.make``. The anchor
    π0 is p itself (the update starts at the current trainer). The sampler head stored for
    centering is the whole distribution q sorted by decreasing probability; ``top_k`` selects its
    first k entries.

    With p = (0.8, 0.2), q = (0.5, 0.5), A = (2, 0): pg (0.20, −0.20), sc (0.50, −0.50),
    is (0.32, −0.32), sc+kl with beta 0.2 (0.44, −0.44) — [mismatch]'s table.
    """
    p = _as_distribution("p", p)
    q = _as_distribution("q", q)
    adv = torch.as_tensor(advantages, dtype=torch.float64).flatten()
    if not (p.numel() == q.numel() == adv.numel()):
        raise ValueError(f"p, q and advantages must have the same length, got {p.numel()}, {q.numel()}, {adv.numel()}")
    if (p <= 0).any():
        raise ValueError("p must be strictly positive (its logits are log p)")
    obj = make(objective, **params)
    z0 = p.log()
    order = torch.argsort(q, descending=True, stable=True)
    with torch.no_grad():
        lq = torch.where(q > 0, q.log(), torch.full_like(q, -torch.inf))
    ascent = torch.zeros_like(p)
    for a in range(p.numel()):
        if q[a] == 0:
            continue  # never sampled: contributes nothing to an expectation under q
        z = z0.clone().requires_grad_(True)
        logp_all = torch.log_softmax(z, dim=-1)
        view = SimpleNamespace(logp=logp_all[a].view(1, 1), head_logp=logp_all[order].view(1, 1, -1))
        batch = SimpleNamespace(
            sampler_logp=lq[a].view(1, 1),
            action_mask=torch.ones(1, 1, dtype=torch.bool),
            advantage=adv[a].view(1),
            sampler_topk_logp=lq[order].view(1, 1, -1),
            anchor_logp=logp_all[a].detach().view(1, 1),
        )
        loss, _ = obj(view, batch)
        (grad,) = torch.autograd.grad(loss, z)
        ascent -= q[a] * grad
    return ascent


@dataclass(frozen=True)
class LogRatioDecomposition:
    """Eq. 1: log p_k/q_v = log p_k/p_v (weight movement) + log p_v/q_v (same-version disagreement)."""

    total: torch.Tensor
    weight_movement: torch.Tensor
    same_version: torch.Tensor

    @property
    def movement_ratio(self) -> torch.Tensor:
        """r = p_k / p_v."""
        return self.weight_movement.exp()

    @property
    def same_version_ratio(self) -> torch.Tensor:
        """w = p_v / q_v."""
        return self.same_version.exp()


def log_ratio_decomposition(trainer_now_logp, trainer_at_version_logp, sampler_logp) -> LogRatioDecomposition:
    """Split log(p_k / q_v) into weight movement and same-version forward disagreement (Eq. 1).

    Inputs are log-probabilities of the same tokens (any matching shapes): the trainer now (p_k),
    the trainer at the generating version (p_v) and the sampler that generated them (q_v).
    Figure 1: q = 0.20, p_v = 0.21, p_k = 0.252 gives w = 1.05 and r = 1.20.
    """
    now = torch.as_tensor(trainer_now_logp, dtype=torch.float64)
    at_v = torch.as_tensor(trainer_at_version_logp, dtype=torch.float64)
    samp = torch.as_tensor(sampler_logp, dtype=torch.float64)
    if not (now.shape == at_v.shape == samp.shape):
        raise ValueError(
            f"trainer_now_logp {tuple(now.shape)}, trainer_at_version_logp {tuple(at_v.shape)} and "
            f"sampler_logp {tuple(samp.shape)} must have the same shape"
        )
    for name, t in (("trainer_now_logp", now), ("trainer_at_version_logp", at_v), ("sampler_logp", samp)):
        if not torch.isfinite(t).all():
            raise ValueError(f"{name} holds NaN or inf")
    return LogRatioDecomposition(*eq1_parts(now, at_v, samp))
