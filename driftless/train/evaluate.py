"""Held-out evaluation with a clean sampler (no mismatch view)."""

from __future__ import annotations

import copy

import torch

from driftless.models.protocols import SupportsNumerics
from driftless.rollout import RolloutEngine, Sampler, SamplingParams
from driftless.rollout.text import stop_lengths
from driftless.rollout.worker import score_completions


def encode_prompts(text, problems) -> list[list[int]]:
    return [text.encode(p.prompt) for p in problems]


def clean_sampler(policy, text) -> Sampler:
    """The built-in Sampler over ``policy`` without any numerics hook, holding its weights as version 0: ``policy``
    itself when it has no numerics hook (nothing to strip; no second copy of the weights), else a copy without it."""
    if getattr(policy, "numerics", None) is None:
        clean = policy  # evaluated in place (under FSDP every rank runs the same forwards)
    else:
        clean = copy.deepcopy(policy)
    if isinstance(clean, SupportsNumerics) and clean.numerics is not None:
        clean.numerics = None
    return Sampler(clean, head_k=0, eos_id=getattr(text, "eos_ids", text.eos_id), pad_id=text.pad_id, version=0)


@torch.no_grad()
def evaluate(policy, task, text, problems, *, max_new_tokens: int, params: SamplingParams | None = None,
             batch_size: int = 256, seed: int = 0, engine: RolloutEngine | None = None, samples: int = 0,
             stop: tuple[str, ...] = (), repeats: int = 1) -> dict:
    """Mean reward on ``problems`` (greedy by default), sampled by ``engine`` (default: a clean copy of ``policy``).

    ``text``: the model's text interface (a TextCodec or a tokenizer). ``samples``: also return the first
    ``samples`` prompts as the model saw them (special tokens and chat template included) with their
    decoded responses and rewards, under "samples". ``stop``: stop strings cut responses as in training.
    ``repeats``: each problem answered that many times (with sampled ``params``: the policy's expected reward
    on held-out problems rather than its greedy answer's)."""
    params = params or SamplingParams(greedy=True)
    problems = [p for p in problems for _ in range(repeats)]
    engine = engine or clean_sampler(policy, text)
    rewards, lengths, shown = [], [], []
    for start in range(0, len(problems), batch_size):
        chunk = problems[start:start + batch_size]
        batch = engine.generate(encode_prompts(text, chunk), params, max_new_tokens, seed=seed + start)
        if stop:
            batch = batch.shorten(stop_lengths(batch, text, stop))
        completions = [text.decode(c) for c in batch.completions()]
        scores = score_completions(task, chunk, completions)[0].tolist()
        rewards.extend(scores)
        lengths.extend((batch.length - batch.prompt_len).tolist())
        show = getattr(text, "show", None)
        for i in range(min(samples - len(shown), len(chunk))):
            shown.append({"prompt": show(batch.prompts()[i]) if show else None, "response": completions[i],
                          "reward": scores[i]})
    out = {"eval_reward": sum(rewards) / max(len(rewards), 1), "eval_length": sum(lengths) / max(len(lengths), 1)}
    if samples:
        out["samples"] = shown
    return out
