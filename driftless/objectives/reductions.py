"""Loss reductions over tokens and responses (verl's names).

- ``token-mean``              Σ_it ℓ / Σ_it m   (global token mean)
- ``token-sum``               Σ_it ℓ
- ``seq-mean-token-mean``     mean over responses of (Σ_t ℓ / T_i)   (REINFORCE Zero, Eq. 11)
- ``seq-mean-token-sum``      mean over responses of Σ_t ℓ
- ``seq-mean-token-sum-norm`` Σ_it ℓ / (B · horizon), horizon = the padded length L by default

Guards: an all-masked batch returns a zero loss that is still connected to the graph;
``seq-mean-*`` modes average over responses with at least one action token (a response with
none contributes nothing and does not count in B), so nothing divides by zero.

Micro-batches and ranks: every denominator is the whole batch's (``Totals``: action tokens,
responses with an action token, rows, the padded horizon), counted before any backward and passed
to each piece's ``reduce_loss``, so the pieces' losses sum to the whole batch's loss for every mode
(the bug class of a per-micro-batch mean: verl #6957, prime-rl #2562, TRL #5619).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

REDUCTIONS = ("token-mean", "token-sum", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")


@dataclass(frozen=True)
class Totals:
    """The whole batch's denominators: action tokens, responses with at least one, rows, padded horizon."""

    tokens: int
    responses: int
    rows: int
    horizon: int

    @classmethod
    def of(cls, mask: torch.Tensor) -> Totals:
        counts = mask.sum(-1)
        return cls(int(counts.sum()), int((counts > 0).sum()), int(mask.shape[0]), int(mask.shape[-1]))

    def __add__(self, other: Totals) -> Totals:  # two ranks' shares of one batch
        return Totals(self.tokens + other.tokens, self.responses + other.responses, self.rows + other.rows,
                      max(self.horizon, other.horizon))


def reduce_loss(loss: torch.Tensor, mask: torch.Tensor, mode: str, horizon: int | None = None,
                totals: Totals | None = None) -> torch.Tensor:
    """The reduced loss; with ``totals`` (the whole batch's), this piece's share of the whole batch's loss."""
    if mode not in REDUCTIONS:
        raise ValueError(f"reduction must be one of {REDUCTIONS}, got {mode!r}")
    m = mask.to(loss.dtype)
    masked = torch.where(mask.bool(), loss, torch.zeros_like(loss))
    if totals is not None:
        return _share(masked, m, mode, totals)
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


def _share(masked: torch.Tensor, m: torch.Tensor, mode: str, totals: Totals) -> torch.Tensor:
    if mode == "token-sum":
        return masked.sum()
    if mode == "token-mean":
        return masked.sum() / (totals.tokens or 1)  # a share of a process may be fractional: only 0 is guarded
    if mode == "seq-mean-token-sum-norm":
        return masked.sum() / ((totals.rows or 1) * totals.horizon)
    per_row = masked.sum(-1)
    if mode == "seq-mean-token-mean":
        per_row = per_row / m.sum(-1).clamp(min=1)
    return per_row.sum() / (totals.responses or 1)  # an empty row's sum is 0: it adds nothing
