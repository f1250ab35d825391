"""Loss reductions over tokens and responses (verl's names).

- ``token-mean``              Σ_it ℓ / Σ_it m   (global token mean)
- ``token-sum``               Σ_it ℓ
- ``seq-mean-token-mean``     mean over responses of (Σ_t ℓ / T_i)   (REINFORCE Zero, Eq. 11)
- ``seq-mean-token-sum``      mean over responses of Σ_t ℓ
- ``seq-mean-token-sum-norm`` Σ_it ℓ / (B · horizon), horizon = the padded length L by default

Guards: an all-masked batch returns a zero loss that is still connected to the graph;
``seq-mean-*`` modes average over responses with at least one action token (a response with
none contributes nothing and does not count in B), so nothing divides by zero.
"""

from __future__ import annotations

import torch

REDUCTIONS = ("token-mean", "token-sum", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")


def reduce_loss(loss: torch.Tensor, mask: torch.Tensor, mode: str, horizon: int | None = None) -> torch.Tensor:
    if mode not in REDUCTIONS:
        raise ValueError(f"reduction must be one of {REDUCTIONS}, got {mode!r}")
    m = mask.to(loss.dtype)
    masked = torch.where(mask.bool(), loss, torch.zeros_like(loss))
    if mode == "token-mean":
        return masked.sum() / m.sum().clamp(min=1)
    if mode == "token-sum":
        return masked.sum()
    if mode == "seq-mean-token-sum-norm":
        rows = loss.shape[0]
        return masked.sum() / (max(rows, 1) * (horizon or loss.shape[-1]))
    counts = m.sum(-1)
    per_row = masked.sum(-1)
    if mode == "seq-mean-token-mean":
        per_row = per_row / counts.clamp(min=1)
    nonempty = (counts > 0).to(loss.dtype)
    return (per_row * nonempty).sum() / nonempty.sum().clamp(min=1)
