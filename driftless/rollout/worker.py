"""The rollout worker: turns a step index into a training batch with rewards and advantages.

``produce(step)``: draw ``prompts_per_step`` problems (an RNG keyed by (seed, step)), generate
``group_size`` responses each with the sampler (generation seed keyed by (seed, step)), score
the completions with the task, shape rewards and compute group advantages. The worker never
trains and never builds weights of its own: it samples from whatever ``load(snapshot)`` gave
it, through its mismatch view. Every random draw is keyed by (seed, step), so a batch is a pure
function of (snapshot, step): what resuming and replaying rely on.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass

import torch

from driftless.models.protocols import SupportsNumerics
from driftless.objectives.advantages import group_advantages, shape_rewards
from driftless.rollout.batch import RolloutBatch, concat_batches
from driftless.rollout.engine import RolloutEngine
from driftless.rollout.sampler import Sampler
from driftless.rollout.sampling import SamplingParams
from driftless.rollout.snapshot import Snapshot
from driftless.rollout.text import stop_lengths


def step_seed(seed: int, step: int, salt: int) -> int:
    """The seed of one random draw of one step (salt 1: problems, 2: generation)."""
    return (seed * 1_000_003 + step * 7919 + salt) % (2**62)


def row_seed(seed: int, step: int, row: int) -> int:
    """The seed of row ``row`` of step ``step``'s batch (``rollout.draws=row``): its own stream, whoever
    generates it."""
    return (step_seed(seed, step, 2) * 1_000_033 + row * 104_729 + 5) % (2**62)


def share_of_groups(n_groups: int, rank: int, world: int) -> range:
    """Rank ``rank``'s contiguous share of a step's prompt groups (groups stay whole: advantages are per group);
    the first ``n_groups % world`` ranks take one more."""
    base, extra = divmod(n_groups, world)
    start = rank * base + min(rank, extra)
    return range(start, start + base + (rank < extra))


@dataclass
class RolloutSettings:
    prompts_per_step: int
    group_size: int
    max_new_tokens: int
    sampling: SamplingParams
    reward_mode: str
    advantage: str
    head_k: int = 32
    seed: int = 0
    refresh: str = "pin"
    refresh_every: int = 8
    reward_latency: float = 0.0  # seconds per prompt group, slept after generation (a verifier / tool stand-in)
    decode_latency: float = 0.0  # seconds per decode step, slept by the sampler (a larger model's token time)
    engine: str = "driftless"  # driftless (the built-in Sampler) | vllm (driftless.rollout.vllm)
    stop: tuple[str, ...] = ()  # stop strings (rollout.stop): a response ends with the token completing one
    model_dir: str | None = None  # vllm: the checkpoint directory the engine loads, tokenizer included (model.hf_path)
    routes: bool | None = None  # a MoE's routes: True recorded or refused (replay); None where the engine can
    draws: str = "batch"  # batch: one generator for the step's batch | row: each row its own stream (row_seed)
    ignore_eos: bool = False  # responses run to max_new_tokens: the engine is given no end ids (vLLM's ignore_eos)


ENGINES = ("driftless", "vllm")


def make_sampler(engine: str, policy, *, head_k: int, eos_id: int | tuple[int, ...] | None, pad_id: int, view=None,
                 decode_latency: float = 0.0, model_dir: str | None = None, routes: bool | None = None) -> RolloutEngine:
    """The rollout engine by name: the built-in Sampler or the vLLM-backed one (same interface)."""
    if engine == "driftless":
        return Sampler(policy, head_k=head_k, eos_id=eos_id, pad_id=pad_id, view=view, decode_latency=decode_latency)
    if engine == "vllm":
        if decode_latency:
            raise ValueError(f"rollout.decode_latency={decode_latency} needs rollout.engine=driftless (vLLM decodes "
                             "inside its own loop)")
        from driftless.rollout.vllm import VLLMSampler

        if model_dir is not None:  # the user's checkpoint, loaded by the engine with its own tokenizer
            return VLLMSampler(policy, head_k=head_k, eos_id=eos_id, pad_id=pad_id, view=view, model_dir=model_dir,
                               tokenizer=True, routes=routes)
        return VLLMSampler(policy, head_k=head_k, eos_id=eos_id, pad_id=pad_id, view=view, routes=routes)
    raise ValueError(f"rollout.engine must be one of {', '.join(ENGINES)}, got {engine!r}")


def score_rows(task, problems, completions: list[str]) -> tuple[torch.Tensor, dict[str, list[float]]]:
    """Each completion's task reward, and each named part's value per completion (tasks with several rewards)."""
    if hasattr(task, "score_batch"):
        total, parts = task.score_batch(problems, completions)
    else:
        total, parts = [task.score(p, c) for p, c in zip(problems, completions)], {}
    return torch.tensor(total, dtype=torch.float32), {name: list(v) for name, v in parts.items()}


def part_means(parts: dict[str, list[float]]) -> dict[str, float]:
    """The batch mean of each named reward part, logged when a task has several."""
    return {f"reward/{name}": sum(v) / max(len(v), 1) for name, v in parts.items()} if len(parts) > 1 else {}


def score_completions(task, problems, completions: list[str]) -> tuple[torch.Tensor, dict[str, float]]:
    """Each completion's task reward, and the batch mean of each named part (tasks with several rewards)."""
    total, parts = score_rows(task, problems, completions)
    return total, part_means(parts)


class RolloutWorker:
    """Sampler + task + reward shaping. ``policy`` is the worker's own copy (a view may change it).

    ``text``: the model's text interface (``driftless.rollout.text.TextCodec``, or any tokenizer
    with ``encode(prompt)``, ``decode(ids)``, ``eos_id`` / ``eos_ids`` and ``pad_id``)."""

    def __init__(self, policy, task, text, settings: RolloutSettings, *, view=None):
        if isinstance(policy, SupportsNumerics):
            policy.numerics = None  # the mismatch view decides the sampler's numerics
        self.sampler = make_sampler(settings.engine, policy, head_k=settings.head_k,
                                    eos_id=None if settings.ignore_eos else getattr(text, "eos_ids", text.eos_id),
                                    pad_id=text.pad_id, view=view, decode_latency=settings.decode_latency, model_dir=settings.model_dir,
                                    routes=settings.routes)
        self.task, self.text, self.settings = task, text, settings
        self.snapshot: Snapshot | None = None  # the snapshot last loaded (before the view)

    @property
    def version(self) -> int | None:
        return self.sampler.version

    def load(self, snapshot: Snapshot) -> None:
        self.sampler.load(snapshot)
        self.snapshot = snapshot

    def sync_to(self, snapshot: Snapshot) -> bool:
        """Load ``snapshot`` unless its version is the one held; whether it loaded."""
        if self.snapshot is not None and self.snapshot.version == snapshot.version:
            return False
        self.load(snapshot)
        return True

    def produce(self, step: int, weights=None, share=None) -> tuple[RolloutBatch, dict]:
        """The batch of ``step`` (rewards and advantages filled) and the worker's metrics.

        ``weights``: a callable giving newer weights (a Snapshot) or None, asked during generation
        per the refresh policy (``RolloutSettings.refresh``). ``share``: sharded generation over learner ranks
        (an object with ``rank``, ``world`` and ``gather(obj) -> [obj of each rank]``, the ranks' collective):
        this worker generates and scores its rank's share of the step's prompt groups (``share_of_groups``), the
        ranks gather the shares, and rewards, advantages and metrics are those of the whole batch, on every rank.
        """
        if self.snapshot is None:
            raise ValueError("the rollout worker has no weights: call load(snapshot) first")
        s = self.settings
        t0 = time.perf_counter()
        fetch = None
        if weights is not None:
            def fetch():  # the sampler loads what this returns when it is newer: remember it
                snapshot = weights()
                if snapshot is not None and snapshot.version != self.sampler.version:
                    self.snapshot = snapshot
                return snapshot
        problems = self.task.sample(s.prompts_per_step, random.Random(step_seed(s.seed, step, 1)), "train")
        mine = share_of_groups(len(problems), share.rank, share.world) if share is not None else range(len(problems))
        encoded = {g: self.text.encode(problems[g].prompt) for g in mine}
        prompts = [encoded[g] for g in mine for _ in range(s.group_size)]
        groups = [g for g in mine for _ in range(s.group_size)]
        rows = [g * s.group_size + j for g in mine for j in range(s.group_size)]  # the rows' places in the batch
        seeds = [row_seed(s.seed, step, r) for r in rows] if s.draws == "row" else None
        batch = self.sampler.generate(prompts, s.sampling, s.max_new_tokens, seed=step_seed(s.seed, step, 2),
                                      group=groups, weights=fetch, refresh=s.refresh,
                                      refresh_every=s.refresh_every, **({"row_seeds": seeds} if seeds else {}))
        t_generate = time.perf_counter()
        if s.reward_latency:
            time.sleep(s.reward_latency * len(mine))
        if s.stop:
            batch = batch.shorten(stop_lengths(batch, self.text, s.stop))
        completions = [self.text.decode(c) for c in batch.completions()]
        success, parts = score_rows(self.task, [problems[g] for g in groups], completions)
        generated = {"rows": batch.batch_size, "tokens": int(batch.action_mask.sum())}
        if share is not None:  # every rank: the whole batch, in group order (rank r holds the r-th share)
            shares = share.gather((batch, success, parts, generated))
            batch = concat_batches([b for b, _, _, _ in shares], self.text.pad_id)
            success = torch.cat([x for _, x, _, _ in shares])
            parts = {name: [v for _, _, p, _ in shares for v in p[name]] for name in parts}
            generated = {"rows": max(g["rows"] for *_, g in shares), "tokens": max(g["tokens"] for *_, g in shares)}
        parts = part_means(parts)
        reward = shape_rewards(success, batch.group, s.reward_mode)
        advantage = group_advantages(reward, batch.group, s.advantage).float()
        batch = batch.replace(reward=reward.float(), advantage=advantage)
        metrics = {
            "reward": float(success.mean()),
            **parts,
            "response_length": float((batch.length - batch.prompt_len).float().mean()),
            "rollout_s": time.perf_counter() - t0,
            "tokens_per_s": int(batch.action_mask.sum()) / max(t_generate - t0, 1e-9),  # the whole batch's
        }
        if share is not None:  # what the busiest rank generated (sharded generation: about 1/world of the batch)
            metrics.update(generated_rows_max=generated["rows"], generated_tokens_max=generated["tokens"])
        return batch, metrics
