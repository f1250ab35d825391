"""The sampling transform: temperature, top-k, top-p, greedy; one function for sampler and trainer.

``sampling_logprobs(logits, params)`` returns log q over the vocabulary under the exact transform
(the filtered support renormalised, −inf outside it). Order: temperature, then top-k, then
top-p on the top-k-renormalised distribution (the order of transformers and vLLM); top-p keeps
the smallest prefix of tokens, by decreasing probability, whose mass reaches ``top_p``. The sampler draws from it and records the
drawn token's entry; the trainer applies the very same function to its own logits, so that in
aligned mode both sides compute identical bits, and in any mode the recorded q is the
probability that actually sampled the token.

``exact=True`` (what aligned execution uses) computes the same transform with the
machine-independent arithmetic of ``driftless.ops.exact``: an exact log-sum-exp, and the top-p
cumulative mass as exact integer sums, so sampler and trainer get the same bits even in
different processes on different CPUs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from driftless.ops.exact import exact_log_softmax, exp64, reduction_bits


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0
    top_k: int = 0  # 0 = no top-k filtering
    top_p: float = 1.0  # 1 = no nucleus filtering
    greedy: bool = False  # explicit argmax decoding: q is a point mass, log q = 0 on the chosen token

    def __post_init__(self):
        if not self.greedy and not self.temperature > 0:
            raise ValueError(
                f"temperature must be > 0 (got {self.temperature}); use greedy=True for argmax decoding"
            )
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k must be an integer >= 0 (0 = off), got {self.top_k!r}")


def sampling_logprobs(logits: torch.Tensor, params: SamplingParams, *, exact: bool = False) -> torch.Tensor:
    """log q ``[..., V]`` under the transform; differentiable in ``logits`` (except greedy).

    ``exact``: machine-independent bits (aligned execution); otherwise torch's own kernels.
    """
    v = logits.shape[-1]
    if params.top_k > v:
        raise ValueError(f"top_k={params.top_k} is larger than the vocabulary ({v})")
    x = logits.float()
    if params.greedy:
        best = x.argmax(-1, keepdim=True)
        out = torch.full_like(x, float("-inf"))
        return out.scatter(-1, best, 0.0) + 0.0 * x  # keeps the graph; value 0 at argmax
    if params.temperature != 1.0:
        x = x / params.temperature  # one correctly rounded division
    if 0 < params.top_k < v:
        kth = torch.topk(x, params.top_k, dim=-1).values[..., -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_x, order = torch.sort(x, dim=-1, descending=True, stable=True)
        if exact:  # masses as integer codes: exact cumulative sums in any order
            bits = reduction_bits(v)
            e = exp64(sorted_x.double() - sorted_x[..., :1].double())
            codes = torch.round(e * 2.0**(bits - 1))
            before = torch.cumsum(codes, dim=-1) - codes
            drop_sorted = before >= params.top_p * codes.sum(-1, keepdim=True)
        else:
            probs = torch.softmax(sorted_x, dim=-1)
            before = torch.cumsum(probs, dim=-1) - probs  # mass strictly before each token
            drop_sorted = before >= params.top_p  # keep the smallest prefix reaching top_p (always >= 1 token)
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        x = x.masked_fill(drop, float("-inf"))
    return exact_log_softmax(x) if exact else torch.log_softmax(x, dim=-1)


def draw_rows(logq: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """One token per row of ``logq`` ``[B, V]`` by the inverse CDF at ``u`` ``[B]`` (uniform in [0, 1)), with the
    masses as integer codes (``exact``'s exp, exact cumulative sums): row i's token depends on ``logq[i]`` and
    ``u[i]`` only, never on the other rows, the batch's shape or the CPU. A token of zero mass is never drawn;
    a mass below 2^-(52 - log2 V) of the row's largest rounds to zero (a 1e-11 share at V = 49,152)."""
    v = logq.shape[-1]
    x = logq.double()
    e = exp64(x - x.max(-1, keepdim=True).values)  # -inf (outside the transform's support) -> 0
    codes = torch.round(e * 2.0 ** (reduction_bits(v) - 1)).long()
    cum = torch.cumsum(codes, dim=-1)  # integers below 2^52: exact in any order
    target = torch.floor(u.double() * cum[:, -1].double()).long()
    return torch.searchsorted(cum, target[:, None], right=True).squeeze(-1).clamp(max=v - 1)


def is_aligned(policy) -> bool:
    """Whether ``policy`` promises trainer–inference invariance (and so wants the exact transform)."""
    return getattr(policy, "execution", "fast") == "aligned"


def entropy_from_logprobs(logq: torch.Tensor) -> torch.Tensor:
    p = logq.exp()
    return -torch.where(p > 0, p * logq, torch.zeros_like(p)).sum(-1)
