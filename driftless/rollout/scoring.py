"""Trainer-side scoring of a RolloutBatch: log p of the recorded tokens under the same transform.

The trainer runs one full forward over prompt + completion and applies the batch's own
``SamplingParams`` transform (``sampling_logprobs``), so that p and q are comparable and, in
aligned mode, bitwise equal at the same weights.
"""

from __future__ import annotations

import torch

from driftless.ops.logprobs import TokenLogprobs
from driftless.rollout.batch import RolloutBatch
from driftless.rollout.sampling import SamplingParams, entropy_from_logprobs, sampling_logprobs


def score_batch(policy, batch: RolloutBatch, *, head_k: int | None = None,
                transform: SamplingParams | None = None) -> TokenLogprobs:
    """``TokenLogprobs`` ``[B, L]`` aligned with ``batch.tokens`` (position 0 is zero)."""
    tokens = batch.tokens
    if tokens.shape[1] < 2:
        raise ValueError("batch.tokens needs at least 2 positions to score a completion")
    logits = policy(tokens[:, :-1])  # [B, L-1, V]
    logq = sampling_logprobs(logits, transform or batch.sampling)
    b = tokens.shape[0]
    zero = logq.new_zeros(b, 1)
    logp = torch.cat([zero, logq.gather(-1, tokens[:, 1:, None]).squeeze(-1)], dim=1)
    entropy = torch.cat([zero, entropy_from_logprobs(logq)], dim=1)
    head = None
    if batch.sampler_topk_ids is not None:
        ids = batch.sampler_topk_ids[:, 1:]
        if head_k is not None:
            ids = ids[..., :head_k]
        head = logq.gather(-1, ids)
        head = torch.cat([head.new_zeros(b, 1, head.shape[-1]), head], dim=1)
    return TokenLogprobs(logp=logp, head_logp=head, entropy=entropy)
