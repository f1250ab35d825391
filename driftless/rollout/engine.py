"""The rollout engine interface, and the request checks and batch assembly every engine shares.

A rollout engine holds a versioned copy of the policy (``load(snapshot)``) and turns prompts
into a RolloutBatch (``generate``): per action token the token, log q under the exact sampling
transform, the top-k head, the weight ``version`` that computed its logits and ``kv_version``.
Two implement it: the built-in ``Sampler`` (driftless.rollout.sampler) and ``VLLMSampler``
(driftless.rollout.vllm). Rollout workers and held-out evaluation use either through this
interface.
"""

from __future__ import annotations

import time
from typing import Protocol, runtime_checkable

import torch

from driftless.rollout.batch import RolloutBatch
from driftless.rollout.sampling import SamplingParams
from driftless.rollout.snapshot import Snapshot

REFRESH_POLICIES = ("pin", "recompute", "retain")


@runtime_checkable
class RolloutEngine(Protocol):
    version: int | None  # the weight version held (None before the first load)

    def load(self, snapshot: Snapshot) -> None:
        """Hold ``snapshot``'s weights (through the engine's mismatch view, if any) and its version."""

    def generate(self, prompts: list[list[int]], params: SamplingParams | None = None, max_new_tokens: int = 32, *,
                 seed: int | None = None, group=None, weights=None, refresh: str = "pin",
                 refresh_every: int = 8) -> RolloutBatch:
        """One response per prompt; ``weights``: a callable giving newer weights, asked per ``refresh``."""


def check_request(prompts: list[list[int]], params: SamplingParams, max_new_tokens: int, ctx: int, vocab: int) -> None:
    """Refuse, naming the prompt and the value, what no rollout engine can generate from."""
    if not prompts:
        raise ValueError("prompts is empty")
    for i, p in enumerate(prompts):
        if len(p) == 0:
            raise ValueError(f"prompt {i} is empty")
        if len(p) >= ctx:
            raise ValueError(f"prompt {i} has {len(p)} tokens; the context holds {ctx} (need room to generate)")
        bad = [t for t in p if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt {i} holds token ids outside [0, {vocab}): {bad[:5]}")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if params.top_k > vocab:
        raise ValueError(f"top_k={params.top_k} is larger than the vocabulary ({vocab})")


def prepare(engine, prompts, params: SamplingParams | None, max_new_tokens: int, *, seed: int | None, refresh: str,
            refresh_every: int) -> tuple[SamplingParams, int]:
    """The checks every ``generate`` starts with; (the sampling params, the seed: drawn from the global
    generator when None, so reproducible under torch.manual_seed)."""
    params = params or SamplingParams()
    if refresh not in REFRESH_POLICIES:
        raise ValueError(f"rollout.refresh must be one of {', '.join(REFRESH_POLICIES)}, got {refresh!r}")
    if refresh_every < 1:
        raise ValueError(f"rollout.refresh_every must be >= 1, got {refresh_every}")
    if engine.version is None:
        raise ValueError("the sampler has no weight version: call load(Snapshot(state, version)) first")
    check_request(prompts, params, max_new_tokens, engine.policy.max_seq_len, engine.policy.vocab_size)
    if seed is None:
        seed = int(torch.randint(0, 2**62, (1,)))
    return params, seed


def assemble(*, tokens, prompt_len, length, mask, logq, version, kv_version, params: SamplingParams, head_ids=None,
             head_logp=None, group=None, meta: dict | None = None, sampler_routes=None,
             n_experts: int | None = None) -> RolloutBatch:
    """The RolloutBatch of one generate call (stamped with the time it finished)."""
    b = tokens.shape[0]
    return RolloutBatch(
        tokens=tokens.contiguous(), prompt_len=prompt_len, length=length.clone(), action_mask=mask.contiguous(),
        sampler_logp=logq.contiguous(), version=version.contiguous(), sampling=params,
        sampler_topk_ids=None if head_ids is None else head_ids.contiguous(),
        sampler_topk_logp=None if head_logp is None else head_logp.contiguous(),
        group=torch.as_tensor(group, dtype=torch.long) if group is not None else torch.arange(b),
        created=torch.full((b,), time.time(), dtype=torch.float64), kv_version=kv_version.contiguous(),
        sampler_routes=None if sampler_routes is None else sampler_routes.contiguous(), n_experts=n_experts,
        meta=meta or {})


def eos_ids(eos) -> tuple[int, ...]:
    """``eos`` (None, one id or several) as a tuple of ids."""
    if eos is None:
        return ()
    if isinstance(eos, int):
        return (eos,)
    return tuple(int(e) for e in eos)


class EndIds:
    """An engine's end-of-sequence ids: ``eos_ids`` (every id that ends a response), ``eos_id`` the first (None:
    responses run to the budget); setting ``eos_id`` to one id, several or None sets ``eos_ids``."""

    eos_ids: tuple[int, ...] = ()

    @property
    def eos_id(self) -> int | None:
        return self.eos_ids[0] if self.eos_ids else None

    @eos_id.setter
    def eos_id(self, value) -> None:
        self.eos_ids = eos_ids(value)
