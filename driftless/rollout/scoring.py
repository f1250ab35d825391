"""Trainer-side scoring of a RolloutBatch: log p of the recorded tokens under the same transform.

The trainer runs one full forward over prompt + completion and applies the batch's own
``SamplingParams`` transform, so that p and q are comparable. In aligned mode it uses the
sampler's very function (``sampling_logprobs``), so both are bitwise equal at the same weights;
otherwise, for a temperature-only transform, the chunked ``extract_logprobs`` (no fp32 copy of
the whole log-softmax; real vocabularies are 150k tokens).
"""

from __future__ import annotations

import torch

from driftless.ops.logprobs import TokenLogprobs, extract_logprobs
from driftless.rollout.batch import RolloutBatch
from driftless.rollout.sampling import SamplingParams, entropy_from_logprobs, is_aligned, sampling_logprobs


def score_batch(policy, batch: RolloutBatch, *, head_k: int | None = None,
                transform: SamplingParams | None = None) -> TokenLogprobs:
    """``TokenLogprobs`` ``[B, L]`` aligned with ``batch.tokens`` (position 0 is zero)."""
    tokens = batch.tokens
    if tokens.shape[1] < 2:
        raise ValueError("batch.tokens needs at least 2 positions to score a completion")
    transform = transform or batch.sampling
    logits = policy(tokens[:, :-1])  # [B, L-1, V]
    b = tokens.shape[0]
    head_ids = batch.sampler_topk_ids
    if head_ids is not None and head_k is not None:
        head_ids = head_ids[..., :head_k]
    body_head = None if head_ids is None else head_ids[:, 1:]
    plain = not transform.greedy and transform.top_k == 0 and transform.top_p == 1.0
    aligned = is_aligned(policy)
    if plain and not aligned:
        # temperature only, and no bitwise promise to keep: the chunked, memory-bounded path
        scaled = logits if transform.temperature == 1.0 else logits / transform.temperature
        out = extract_logprobs(scaled, tokens[:, 1:], body_head)
        logp, head, entropy = out.logp, out.head_logp, out.entropy
    else:
        # the sampler's own transform function: in aligned mode, the same bits as the sampler
        logq = sampling_logprobs(logits, transform, exact=aligned)
        logp = logq.gather(-1, tokens[:, 1:, None]).squeeze(-1)
        head = None if body_head is None else logq.gather(-1, body_head)
        entropy = entropy_from_logprobs(logq)
    zero = logp.new_zeros(b, 1)  # position 0 is never an action
    if head is not None:
        head = torch.cat([head.new_zeros(b, 1, head.shape[-1]), head], dim=1)
    return TokenLogprobs(logp=torch.cat([zero, logp], 1), head_logp=head, entropy=torch.cat([zero, entropy], 1))
