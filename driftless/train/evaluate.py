"""Held-out evaluation with a clean sampler (no mismatch view)."""

from __future__ import annotations

import copy

import torch

from driftless.models.protocols import SupportsNumerics
from driftless.rollout import Sampler, SamplingParams


def encode_prompts(tokenizer, problems) -> list[list[int]]:
    return [tokenizer.encode(p.prompt) for p in problems]


@torch.no_grad()
def evaluate(policy, task, tokenizer, problems, *, max_new_tokens: int, params: SamplingParams | None = None,
             batch_size: int = 256, seed: int = 0) -> dict:
    """Mean reward of ``policy`` on ``problems`` (greedy by default), sampled by a clean copy."""
    params = params or SamplingParams(greedy=True)
    clean = copy.deepcopy(policy)
    if isinstance(clean, SupportsNumerics):
        clean.numerics = None
    sampler = Sampler(clean, head_k=0, eos_id=tokenizer.eos_id, pad_id=tokenizer.pad_id)
    sampler.version = 0
    rewards, lengths = [], []
    for start in range(0, len(problems), batch_size):
        chunk = problems[start:start + batch_size]
        batch = sampler.generate(encode_prompts(tokenizer, chunk), params, max_new_tokens, seed=seed + start)
        for p, completion in zip(chunk, batch.completions()):
            rewards.append(task.score(p, tokenizer.decode(completion)))
        lengths.extend((batch.length - batch.prompt_len).tolist())
    return {"eval_reward": sum(rewards) / max(len(rewards), 1), "eval_length": sum(lengths) / max(len(lengths), 1)}
