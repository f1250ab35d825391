"""Held-out evaluation with a clean sampler (no mismatch view)."""

from __future__ import annotations

import copy

import torch

from driftless.models.protocols import SupportsNumerics
from driftless.rollout import RolloutEngine, Sampler, SamplingParams


def encode_prompts(tokenizer, problems) -> list[list[int]]:
    return [tokenizer.encode(p.prompt) for p in problems]


def clean_sampler(policy, tokenizer) -> Sampler:
    """The built-in Sampler over a copy of ``policy`` without any numerics hook, holding its weights as version 0."""
    clean = copy.deepcopy(policy)
    if isinstance(clean, SupportsNumerics):
        clean.numerics = None
    return Sampler(clean, head_k=0, eos_id=tokenizer.eos_id, pad_id=tokenizer.pad_id, version=0)


@torch.no_grad()
def evaluate(policy, task, tokenizer, problems, *, max_new_tokens: int, params: SamplingParams | None = None,
             batch_size: int = 256, seed: int = 0, engine: RolloutEngine | None = None) -> dict:
    """Mean reward on ``problems`` (greedy by default), sampled by ``engine`` (default: a clean copy of ``policy``)."""
    params = params or SamplingParams(greedy=True)
    engine = engine or clean_sampler(policy, tokenizer)
    rewards, lengths = [], []
    for start in range(0, len(problems), batch_size):
        chunk = problems[start:start + batch_size]
        batch = engine.generate(encode_prompts(tokenizer, chunk), params, max_new_tokens, seed=seed + start)
        for p, completion in zip(chunk, batch.completions()):
            rewards.append(task.score(p, tokenizer.decode(completion)))
        lengths.extend((batch.length - batch.prompt_len).tolist())
    return {"eval_reward": sum(rewards) / max(len(rewards), 1), "eval_length": sum(lengths) / max(len(lengths), 1)}
