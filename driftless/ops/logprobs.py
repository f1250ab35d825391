"""Memory-bounded extraction of trainer quantities from logits.

From logits ``[B, L, V]`` we need, per position: log p of the selected token, log p at the
sampler's head ids, the entropy H = -sum_j p_j log p_j (and sum_j p_j log p_j = -H). A naive
``log_softmax`` materialises an fp32 ``[B*L, V]`` copy (and autograd keeps it for backward);
with a 150k vocabulary that dominates memory. ``extract_logprobs`` instead walks the rows in
chunks, keeps only the per-row log-sum-exp for backward, and recomputes the softmax chunk by
chunk when gradients flow. Gradients (d/dx_j):

    d logp_y / dx_j   = [j = y] - p_j
    d head_k / dx_j   = [j = h_k] - p_j
    d H / dx_j        = -p_j (log p_j + H)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

DEFAULT_CHUNK_ROWS = 1024


@dataclass
class TokenLogprobs:
    """Trainer quantities at each position (all ``[B, L]`` except ``head_logp``)."""

    logp: torch.Tensor  # log p(selected token)
    head_logp: torch.Tensor | None  # [B, L, k] log p at the sampler's head ids
    entropy: torch.Tensor  # H = -sum p log p
    routes: torch.Tensor | None = None  # [B, L, layers, k] a mixture of experts' own expert ids per input position

    @property
    def sum_p_logp(self) -> torch.Tensor:
        """Σ_j p_j log p_j = −H at each position."""
        return -self.entropy


def _check_ids(name: str, ids: torch.Tensor, vocab: int) -> None:
    if ids.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"{name} must be an integer tensor, got dtype {ids.dtype}")
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= vocab):
        raise ValueError(
            f"{name} holds ids outside the vocabulary [0, {vocab}): min {int(ids.min())}, max {int(ids.max())}"
        )


class _ChunkedLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, token_ids, head_ids, chunk_rows):
        # logits [N, V]; token_ids [N]; head_ids [N, k] (k may be 0)
        n, _ = logits.shape
        k = head_ids.shape[1]
        cdtype = torch.promote_types(logits.dtype, torch.float32)  # at least fp32
        logp = torch.empty(n, dtype=cdtype, device=logits.device)
        head = torch.empty(n, k, dtype=cdtype, device=logits.device)
        entropy = torch.empty(n, dtype=cdtype, device=logits.device)
        lse = torch.empty(n, dtype=cdtype, device=logits.device)
        for start in range(0, n, chunk_rows):
            stop = min(start + chunk_rows, n)
            x = logits[start:stop].to(cdtype)
            row_lse = torch.logsumexp(x, dim=-1)
            logp_chunk = x - row_lse[:, None]
            p = logp_chunk.exp()
            lse[start:stop] = row_lse
            entropy[start:stop] = -(p * logp_chunk).sum(-1)
            logp[start:stop] = logp_chunk.gather(1, token_ids[start:stop, None]).squeeze(1)
            if k:
                head[start:stop] = logp_chunk.gather(1, head_ids[start:stop])
        ctx.save_for_backward(logits, token_ids, head_ids, lse, entropy)
        ctx.chunk_rows = chunk_rows
        return logp, head, entropy

    @staticmethod
    def backward(ctx, grad_logp, grad_head, grad_entropy):
        logits, token_ids, head_ids, lse, entropy = ctx.saved_tensors
        n, _ = logits.shape
        k = head_ids.shape[1]
        grad = torch.empty_like(logits)
        cdtype = lse.dtype
        zeros = torch.zeros(n, dtype=cdtype, device=logits.device)
        grad_logp = zeros if grad_logp is None else grad_logp.to(cdtype)
        grad_entropy = zeros if grad_entropy is None else grad_entropy.to(cdtype)
        if k and grad_head is not None:
            grad_head = grad_head.to(cdtype)
        else:
            grad_head = None
        for start in range(0, n, ctx.chunk_rows):
            stop = min(start + ctx.chunk_rows, n)
            logp_chunk = logits[start:stop].to(cdtype) - lse[start:stop, None]
            p = logp_chunk.exp()
            g_sel = grad_logp[start:stop]
            total = g_sel.clone()
            if grad_head is not None:
                total = total + grad_head[start:stop].sum(-1)
            g_h = grad_entropy[start:stop]
            g = -p * total[:, None] - g_h[:, None] * p * (logp_chunk + entropy[start:stop, None])
            g.scatter_add_(1, token_ids[start:stop, None], g_sel[:, None])
            if grad_head is not None:
                g.scatter_add_(1, head_ids[start:stop], grad_head[start:stop])
            grad[start:stop] = g.to(grad.dtype)
        return grad, None, None, None


def extract_logprobs(
    logits: torch.Tensor,
    token_ids: torch.Tensor,
    head_ids: torch.Tensor | None = None,
    *,
    chunk_rows: int = DEFAULT_CHUNK_ROWS,
) -> TokenLogprobs:
    """Selected-token log p, log p at ``head_ids`` and entropy from ``logits [B, L, V]``.

    ``token_ids [B, L]`` are the tokens whose log-probability each position scores (already
    shifted: position t holds the token predicted from logits[:, t]). ``head_ids [B, L, k]`` are
    the sampler's head ids. Computed in fp32 (fp64 for fp64 logits), ``chunk_rows`` rows at a time, differentiable.
    """
    if logits.dim() != 3:
        raise ValueError(f"logits must be [B, L, V], got shape {tuple(logits.shape)}")
    b, l, v = logits.shape
    if tuple(token_ids.shape) != (b, l):
        raise ValueError(f"token_ids must have shape {(b, l)}, got {tuple(token_ids.shape)}")
    _check_ids("token_ids", token_ids, v)
    if head_ids is None:
        head_flat = torch.empty(b * l, 0, dtype=torch.int64, device=logits.device)
    else:
        if head_ids.dim() != 3 or tuple(head_ids.shape[:2]) != (b, l):
            raise ValueError(f"head_ids must have shape [{b}, {l}, k], got {tuple(head_ids.shape)}")
        if head_ids.shape[2] > v:
            raise ValueError(f"head_ids has k={head_ids.shape[2]} ids, more than the vocabulary ({v})")
        _check_ids("head_ids", head_ids, v)
        head_flat = head_ids.reshape(b * l, -1).long()
    if chunk_rows < 1:
        raise ValueError(f"chunk_rows must be >= 1, got {chunk_rows}")
    logp, head, entropy = _ChunkedLogprobs.apply(
        logits.reshape(b * l, v), token_ids.reshape(b * l).long(), head_flat, int(chunk_rows)
    )
    return TokenLogprobs(
        logp=logp.view(b, l),
        head_logp=None if head_ids is None else head.view(b, l, -1),
        entropy=entropy.view(b, l),
    )


def naive_logprobs(
    logits: torch.Tensor, token_ids: torch.Tensor, head_ids: torch.Tensor | None = None
) -> TokenLogprobs:
    """The obvious full log-softmax version; the reference the chunked path is tested against."""
    logp_all = torch.log_softmax(logits.to(torch.promote_types(logits.dtype, torch.float32)), dim=-1)
    logp = logp_all.gather(-1, token_ids.long()[..., None]).squeeze(-1)
    head = None if head_ids is None else logp_all.gather(-1, head_ids.long())
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    return TokenLogprobs(logp=logp, head_logp=head, entropy=entropy)


def default_head_rows(vocab: int) -> int:
    """Rows per chunk of the fused head: about 2^24 fp32 logits (64 MB) at a time, whatever the vocabulary."""
    return max(16, (1 << 24) // max(int(vocab), 1))


class _LinearLogprobs(torch.autograd.Function):
    """``extract_logprobs(scale · hidden @ weight.T)`` without ever holding the ``[N, V]`` logits: each chunk of
    rows is projected, reduced and dropped; the backward projects it again (the output-layer recompute of fused
    linear-cross-entropy kernels, e.g. Liger's) and accumulates the hidden states' and the weight's gradients."""

    @staticmethod
    def forward(ctx, hidden, weight, token_ids, head_ids, scale, chunk_rows, mm_dtype):
        n, k = hidden.shape[0], head_ids.shape[1]
        w = weight.to(mm_dtype)
        cdtype = torch.promote_types(hidden.dtype, torch.float32)
        logp = torch.empty(n, dtype=cdtype, device=hidden.device)
        head = torch.empty(n, k, dtype=cdtype, device=hidden.device)
        entropy = torch.empty(n, dtype=cdtype, device=hidden.device)
        lse = torch.empty(n, dtype=cdtype, device=hidden.device)
        for start in range(0, n, chunk_rows):
            stop = min(start + chunk_rows, n)
            x = (hidden[start:stop].to(mm_dtype) @ w.t()).to(cdtype) * scale
            row_lse = torch.logsumexp(x, dim=-1)
            logp_chunk = x - row_lse[:, None]
            lse[start:stop] = row_lse
            entropy[start:stop] = -(logp_chunk.exp() * logp_chunk).sum(-1)
            logp[start:stop] = logp_chunk.gather(1, token_ids[start:stop, None]).squeeze(1)
            if k:
                head[start:stop] = logp_chunk.gather(1, head_ids[start:stop])
        ctx.save_for_backward(hidden, weight, token_ids, head_ids, lse, entropy)
        ctx.scale, ctx.chunk_rows, ctx.mm_dtype = scale, chunk_rows, mm_dtype
        return logp, head, entropy

    @staticmethod
    def backward(ctx, grad_logp, grad_head, grad_entropy):
        hidden, weight, token_ids, head_ids, lse, entropy = ctx.saved_tensors
        n, k = hidden.shape[0], head_ids.shape[1]
        cdtype = lse.dtype
        zeros = torch.zeros(n, dtype=cdtype, device=hidden.device)
        grad_logp = zeros if grad_logp is None else grad_logp.to(cdtype)
        grad_entropy = zeros if grad_entropy is None else grad_entropy.to(cdtype)
        grad_head = grad_head.to(cdtype) if k and grad_head is not None else None
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_hidden = torch.zeros_like(hidden) if need_h else None
        grad_weight = None  # [V, D]: the first chunk's product, later chunks added in place (addmm_, no temporary)
        w = weight.to(ctx.mm_dtype)
        for start in range(0, n, ctx.chunk_rows):
            stop = min(start + ctx.chunk_rows, n)
            h = hidden[start:stop].to(ctx.mm_dtype)
            logp_chunk = (h @ w.t()).to(cdtype) * ctx.scale - lse[start:stop, None]
            p = logp_chunk.exp()
            g_sel = grad_logp[start:stop]
            total = g_sel.clone()
            if grad_head is not None:
                total = total + grad_head[start:stop].sum(-1)
            g_h = grad_entropy[start:stop]
            g = -p * total[:, None] - g_h[:, None] * p * (logp_chunk + entropy[start:stop, None])
            g.scatter_add_(1, token_ids[start:stop, None], g_sel[:, None])
            if grad_head is not None:
                g.scatter_add_(1, head_ids[start:stop], grad_head[start:stop])
            g = (g * ctx.scale).to(ctx.mm_dtype)  # d/d(h W^T) of the scaled logits
            if need_h:
                grad_hidden[start:stop] = (g @ w).to(hidden.dtype)
            if need_w:
                if grad_weight is None:
                    grad_weight = (g.t() @ h).to(cdtype)
                elif g.dtype == cdtype:
                    grad_weight.addmm_(g.t(), h)
                else:  # products in autocast's dtype, summed in fp32
                    grad_weight.add_((g.t() @ h).to(cdtype))
        if need_w and grad_weight is None:  # no rows
            grad_weight = torch.zeros(weight.shape, dtype=cdtype, device=weight.device)
        return grad_hidden, None if grad_weight is None else grad_weight.to(weight.dtype), None, None, None, None, None


def linear_logprobs(hidden: torch.Tensor, weight: torch.Tensor, token_ids: torch.Tensor,
                    head_ids: torch.Tensor | None = None, *, scale: float = 1.0,
                    chunk_rows: int | None = None) -> TokenLogprobs:
    """Selected-token log p, head log p and entropy of the logits ``scale · hidden @ weight.T``, computed chunk by
    chunk: ``hidden [N, D]`` (the positions to score, e.g. a batch's response positions), ``weight [V, D]`` (the
    output layer, a tied embedding included), ``token_ids [N]``, ``head_ids [N, k]``. Peak memory is
    ``chunk_rows × V`` floats whatever N is; differentiable in ``hidden`` and ``weight``. Returns ``[N]`` tensors
    (``head_logp`` ``[N, k]``)."""
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1]:
        raise ValueError(f"hidden must be [N, D] and weight [V, D], got {tuple(hidden.shape)} and {tuple(weight.shape)}")
    n, v = hidden.shape[0], weight.shape[0]
    if tuple(token_ids.shape) != (n,):
        raise ValueError(f"token_ids must have shape ({n},), got {tuple(token_ids.shape)}")
    _check_ids("token_ids", token_ids, v)
    if head_ids is None:
        head_flat = torch.empty(n, 0, dtype=torch.int64, device=hidden.device)
    else:
        if head_ids.dim() != 2 or head_ids.shape[0] != n:
            raise ValueError(f"head_ids must have shape [{n}, k], got {tuple(head_ids.shape)}")
        _check_ids("head_ids", head_ids, v)
        head_flat = head_ids.long()
    rows = default_head_rows(v) if chunk_rows is None else int(chunk_rows)
    if rows < 1:
        raise ValueError(f"chunk_rows must be >= 1, got {rows}")
    device = hidden.device.type  # under autocast (train.precision=bf16) the products run in its dtype, explicitly
    mm_dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else weight.dtype
    with torch.autocast(device_type=device, enabled=False):
        logp, head, entropy = _LinearLogprobs.apply(hidden, weight, token_ids.long(), head_flat, float(scale), rows,
                                                    mm_dtype)
    return TokenLogprobs(logp=logp, head_logp=None if head_ids is None else head, entropy=entropy)
