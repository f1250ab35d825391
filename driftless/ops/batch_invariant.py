"""Batch-invariant matmul and attention for the aligned execution mode.

What was measured on this kind of CPU (shared/reference/invariance-and-quantization.md, and
re-checked by ``driftless.models.selftest`` at start-up): a plain ``mm`` gives a row different
bits depending on how many rows are multiplied with it, but padding the rows to a multiple of a
fixed chunk C (≥ 4) and multiplying C-row blocks (one batched matmul over ``[n, C, K]``) gives the
same bits for every row count, row position and neighbour content, with 1 or 2 threads. This is
an observed property of the CPU BLAS, not a documented contract; the self-test guards it.

Attention in aligned mode always reads K/V from a cache of fixed length T (the context), masks
future and unwritten slots with −inf, and reduces over exactly T keys, so a decode step (one
query) and a full forward (many queries) compute each query row identically.
"""

from __future__ import annotations

import torch

DEFAULT_CHUNK = 8


def chunked_rows_matmul(x: torch.Tensor, w: torch.Tensor, chunk: int = DEFAULT_CHUNK) -> torch.Tensor:
    """``x [..., M, K] @ w [..., K, N]`` with rows padded to a multiple of ``chunk``.

    Leading dims broadcast as in ``torch.matmul`` (``w`` may be 2-D, or batched like ``x``).
    """
    m, k = x.shape[-2], x.shape[-1]
    pad = (-m) % chunk
    if pad:
        x = torch.cat([x, x.new_zeros(*x.shape[:-2], pad, k)], dim=-2)
    blocks = x.reshape(*x.shape[:-2], (m + pad) // chunk, chunk, k)
    w_b = w.unsqueeze(-3)  # [..., 1, K, N] broadcasts over the blocks
    out = torch.matmul(blocks, w_b)
    out = out.reshape(*x.shape[:-2], m + pad, out.shape[-1])
    return out[..., :m, :]


def bi_linear(x: torch.Tensor, weight: torch.Tensor, chunk: int = DEFAULT_CHUNK) -> torch.Tensor:
    """Batch-invariant ``F.linear(x, weight)`` (no bias): rows of any leading shape."""
    lead = x.shape[:-1]
    out = chunked_rows_matmul(x.reshape(-1, x.shape[-1]), weight.t(), chunk)
    return out.reshape(*lead, weight.shape[0])


def cached_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, q_pos: torch.Tensor, chunk: int = DEFAULT_CHUNK
) -> torch.Tensor:
    """Causal attention over a fixed-length cache, grouped-query heads without copying K/V.

    q ``[B, H, Tq, D]`` (already scaled and rotated), caches ``[B, Hkv, T, D]`` with H a multiple of
    Hkv (query head h reads KV head h // (H / Hkv)), ``q_pos [B, Tq]`` the absolute position of
    each query. Key slot j is visible to a query at position t iff j ≤ t. The query rows of the
    heads sharing a KV head are multiplied as one block of rows: each row's bits do not depend on
    how many rows share its block.
    """
    b, h, tq, d = q.shape
    h_kv, t_max = k_cache.shape[1], k_cache.shape[-2]
    groups = h // h_kv
    rows = q.reshape(b, h_kv, groups * tq, d)  # rows ordered (group, position)
    scores = chunked_rows_matmul(rows, k_cache.transpose(-1, -2), chunk)  # [B, Hkv, G*Tq, T]
    visible = torch.arange(t_max, device=q.device)[None, None, :] <= q_pos[:, :, None]  # [B, Tq, T]
    visible = visible[:, None].expand(b, groups, tq, t_max).reshape(b, 1, groups * tq, t_max)
    weights = torch.softmax(scores.masked_fill(~visible, float("-inf")), dim=-1)
    out = chunked_rows_matmul(weights, v_cache, chunk)  # [B, Hkv, G*Tq, D]
    return out.reshape(b, h, tq, d)
