"""Trainer-side scoring of a RolloutBatch: log p of the recorded tokens under the same transform.

The trainer runs one full forward over prompt + completion and applies the batch's own
``SamplingParams`` transform, so that p and q are comparable. In aligned mode it uses the
sampler's very function (``sampling_logprobs``), so both are bitwise equal at the same weights;
otherwise, for a temperature-only transform, the chunked ``extract_logprobs`` (no fp32 copy of
the whole log-softmax; real vocabularies are 150k tokens).

A mixture-of-experts policy (``policy.route_shape``) reports the experts it selects itself at every
input position (``TokenLogprobs.routes``); with ``routing="replay"`` (rollout routing replay, R3: Ma et
al., arXiv 2510.11370) its forward uses the sampler's recorded ones (``batch.sampler_routes``) instead,
the gate weights still the trainer's softmax over all experts at those ids.
"""

from __future__ import annotations

import torch

from driftless.ops.logprobs import TokenLogprobs, extract_logprobs, linear_logprobs
from driftless.rollout.batch import RolloutBatch
from driftless.rollout.sampling import SamplingParams, entropy_from_logprobs, is_aligned, sampling_logprobs

ROUTINGS = ("recompute", "replay")


def routed_forward(policy, batch: RolloutBatch, routing: str = "recompute", *, hidden: bool = False):
    """(logits ``[B, L-1, V]`` of ``policy`` over ``batch.tokens[:, :-1]``, the policy's own expert ids
    ``[B, L, layers, k]`` at each input position, −1 at the last; None for a dense policy). ``hidden``: the final
    hidden states ``[B, L-1, D]`` (``policy.hidden_states``) instead of the logits."""
    run = policy.hidden_states if hidden else policy
    if routing not in ROUTINGS:
        raise ValueError(f"train.routing must be one of {', '.join(ROUTINGS)}, got {routing!r}")
    inputs = batch.tokens[:, :-1]
    shape = getattr(policy, "route_shape", None)
    if shape is None:
        if routing == "replay":
            raise ValueError("train.routing=replay needs a mixture-of-experts policy (model.n_experts > 0)")
        return run(inputs), None
    if routing == "replay":
        if batch.sampler_routes is None:
            raise ValueError("train.routing=replay: the batch has no sampler_routes (the rollout engine recorded "
                             "no expert ids)")
        if tuple(batch.sampler_routes.shape[2:]) != tuple(shape):
            raise ValueError(f"sampler_routes are [.., {list(batch.sampler_routes.shape[2:])}] (layers, k), the "
                             f"policy routes {list(shape)}")
        if batch.n_experts is not None and batch.n_experts != getattr(policy, "n_experts", batch.n_experts):
            raise ValueError(f"sampler_routes index {batch.n_experts} experts, the policy has {policy.n_experts}")
        policy.replay = batch.sampler_routes[:, :-1].to(inputs.device)
    policy.routes = []
    try:
        logits = run(inputs)
        own = torch.stack(policy.routes, 2)  # [B, L-1, layers, k]
    finally:
        policy.routes, policy.replay = None, None
    routes = torch.cat([own, own.new_full((own.shape[0], 1, *own.shape[2:]), -1)], 1)
    return logits, routes


def score_batch(policy, batch: RolloutBatch, *, head_k: int | None = None,
                transform: SamplingParams | None = None, routing: str = "recompute") -> TokenLogprobs:
    """``TokenLogprobs`` ``[B, L]`` aligned with ``batch.tokens`` (position 0 is zero)."""
    tokens = batch.tokens
    if tokens.shape[1] < 2:
        raise ValueError("batch.tokens needs at least 2 positions to score a completion")
    transform = transform or batch.sampling
    b = tokens.shape[0]
    head_ids = batch.sampler_topk_ids
    if head_ids is not None and head_k is not None:
        head_ids = head_ids[..., :head_k]
    body_head = None if head_ids is None else head_ids[:, 1:]
    plain = not transform.greedy and transform.top_k == 0 and transform.top_p == 1.0
    aligned = is_aligned(policy)
    weight = getattr(policy, "output_weight", None)
    if plain and not aligned and weight is not None:
        return _score_actions(policy, weight, batch, transform, body_head, routing)
    logits, routes = routed_forward(policy, batch, routing)  # [B, L-1, V]
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
    return TokenLogprobs(logp=torch.cat([zero, logp], 1), head_logp=head, entropy=torch.cat([zero, entropy], 1),
                         routes=routes)


def _score_actions(policy, weight, batch: RolloutBatch, transform: SamplingParams, body_head, routing: str):
    """The response positions only: the final hidden states of the whole sequence, then the output layer on the
    positions whose next token is an action, chunk by chunk (``linear_logprobs``): no ``[B, L, V]`` logits, and the
    vocabulary projection (49k-152k rows) skips the prompts. Positions that are not actions hold 0."""
    device = weight.device
    rows, cols = batch.action_mask[:, 1:].to(device).nonzero(as_tuple=True)
    shared = getattr(policy, "action_hidden_states", None)  # rows sharing a prompt run it once (HFPolicy)
    acting = None if shared is None or routing != "recompute" else shared(
        batch.tokens.to(device), batch.prompt_len, rows, cols)
    routes = None
    if acting is None:
        hidden, routes = routed_forward(policy, batch, routing, hidden=True)  # [B, L-1, D]
        acting = hidden[rows, cols]
    targets = batch.tokens[:, 1:].to(device)[rows, cols]
    head = None if body_head is None else body_head.to(device)[rows, cols]
    out = linear_logprobs(acting, weight, targets, head, scale=1.0 / transform.temperature)
    b, width = batch.tokens.shape
    zeros = out.logp.new_zeros(b, width)
    logp = zeros.index_put((rows, cols + 1), out.logp)
    entropy = zeros.index_put((rows, cols + 1), out.entropy)
    head_logp = None
    if out.head_logp is not None:
        head_logp = out.head_logp.new_zeros(b, width, out.head_logp.shape[-1]).index_put((rows, cols + 1), out.head_logp)
    return TokenLogprobs(logp=logp, head_logp=head_logp, entropy=entropy, routes=routes)
