"""Rollout sources: where the one training loop's batches come from, chosen by ``rollout.runtime``.

A source owns the rollout workers and the learner's way of reaching them; the loop
(driftless.train.loop.Run) is the same for every runtime: get a batch → drop stale rows →
trace → update → publish → finish the step.

    sync     inline.py   the worker in the driver, taking turns with the learner (rollout.lag: a virtual clock)
    thread   thread.py   a worker thread generating ahead while the learner trains (bound η)
    process  process.py  rollout.workers spawned processes (bound η, killed workers replaced)
    ray      ray.py      rollout.workers Ray actors, weights through the object store (bound η)

The run builds its learner once (``make_learner``) and hands it to the source with the weights
the workers start from and the run's parts; a source never builds a learner of its own.

Adding a runtime: write one module with a class following ``RolloutSource`` (constructed as
``Source(config, state, learner, parts)``), decorate it with ``@register(name)``, import the module
at the foot of this file, and add the name to ``Runtime`` in driftless.train.config (a test keeps
the two equal); add the settings it does not honour to ``config.RULES``.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Protocol

import torch

from driftless.rollout import RolloutBatch, Snapshot
from driftless.train import build
from driftless.train.raycluster import WAIT_S  # noqa: F401 -- the longest any wait may take (the runtimes import it here)

MAX_FAILURES = 3  # a remote worker dying this often in a row without a batch fails the run


@dataclass
class Delivery:
    """One batch as a source hands it to the loop."""

    step: int  # the step it was produced for
    batch: RolloutBatch
    rollout: dict  # the worker's metrics (reward, lengths, throughput, restarts)
    refreshed: bool = True  # the sampler's weights changed before this batch
    timing: dict = field(default_factory=dict)  # asynchronous sources: admitted, start_version, enqueue_learner_version


class RolloutSource(Protocol):
    learner: object  # the Learner (or a stand-in with its interface, e.g. one in a Ray actor)
    bound: int | None  # η: rows whose oldest token is more versions behind are dropped; None: no bound (sync)

    def next(self, step: int) -> Delivery:
        """The batch of ``step`` (starting the workers on the first call)."""

    def published(self) -> None:
        """The learner has taken an update: make its new weights available to the workers."""

    def sampler_snapshot(self) -> Snapshot | None:
        """The weights the workers were last given (a checkpoint's ``sampler``)."""

    def snapshots(self) -> dict[int, Snapshot]:
        """Published weights a resumed run still needs, by step count (sync with a lag)."""

    def restore(self, sampler: Snapshot, snapshots: dict[int, Snapshot]) -> None:
        """Resume from a checkpoint's sampler weights and snapshots."""

    def close(self) -> None:
        """Stop every worker."""


SOURCES: dict[str, type] = {}


def register(runtime: str):
    """Class decorator: ``rollout.runtime=<runtime>`` uses this source (its module is imported at the foot of this
    package; a runtime's optional dependency, such as Ray, is imported only when the source starts)."""
    def add(cls):
        SOURCES[runtime] = cls
        return cls
    return add


def make_source(config, state: dict, learner, parts=None) -> RolloutSource:
    """The source of ``config.rollout.runtime`` feeding ``learner`` (the run's); ``state``: the weights its
    workers start from; ``parts``: the run's tokenizer, task, codec and view (the sync worker shares them; the thread
    worker shares the task and view and makes its own tokenizer; process and Ray workers make their own)."""
    name = config.rollout.runtime
    if name not in SOURCES:
        raise ValueError(f"rollout.runtime must be one of {', '.join(SOURCES)}, got {name!r}")
    return SOURCES[name](config, state, learner, parts or build.Parts(config))


# ---------------------------------------------------------------------------------------- shared parts
def admitted(step: int, version: int, steps_per_batch: int, eta: int) -> bool:
    """Batch ``step`` may start from weights of ``version`` (AReaL's capacity rule, in batches): the
    learner will have taken at most η more updates when it consumes the batch."""
    return version >= step * steps_per_batch - eta


def drop_stale(batch: RolloutBatch, version: int, bound: int | None) -> tuple[RolloutBatch | None, int]:
    """(the rows whose oldest token is at most ``bound`` versions behind ``version``, rows dropped)."""
    if bound is None:
        return batch, 0
    mask = batch.action_mask
    oldest = torch.where(mask, batch.version, torch.iinfo(torch.long).max).min(1).values
    stale = (version - oldest > bound) & mask.any(1)
    if not bool(stale.any()):
        return batch, 0
    keep = torch.nonzero(~stale).squeeze(1)
    return (batch.select(keep) if len(keep) else None), int(stale.sum())


def queue_metrics(delivery: Delivery, batch: RolloutBatch | None, version: int, consumed_at: float) -> dict:
    """Ages of an asynchronous batch: pre-queue (admission to enqueue) and in-queue (enqueue to consumption)."""
    t = delivery.timing
    ages = (version - batch.version[batch.action_mask]) if batch is not None else torch.zeros(0, dtype=torch.long)
    created = float(batch.created.max()) if batch is not None and batch.created is not None else consumed_at
    enqueued = float(batch.enqueued.max()) if batch is not None and batch.enqueued is not None else consumed_at
    out = {
        "staleness_max": int(ages.max()) if len(ages) else 0,
        "prequeue_s": float(created - t["admitted"]),
        "inqueue_s": float(consumed_at - enqueued),
        "prequeue_versions": int(t["enqueue_learner_version"] - t["start_version"]),
        "inqueue_versions": int(version - t["enqueue_learner_version"]),
    }
    if "worker_wait_s" in t:  # measured where the worker's admission wait is visible (thread)
        out["worker_wait_s"] = t["worker_wait_s"]
    return out


class Dispatch:
    """Batches in flight to ``n`` remote workers (processes, actors): batch s goes to worker s mod n.

    ``submit`` sends every admitted batch in order; ``owed(i)`` is what worker i has not
    delivered (sent again to its replacement: a batch is a pure function of its step's seed and
    the weights, so none is lost and, taken by step, none is used twice).
    """

    def __init__(self, n: int, steps: int, steps_per_batch: int, eta: int):
        self.n, self.steps, self.k, self.eta = n, steps, steps_per_batch, eta
        self.in_flight: dict[int, tuple[float, int]] = {}  # step -> (submitted at, learner version then)
        self.next_submit = 0
        self.restarts = 0
        self.failures = [0] * n  # per worker: deaths since its last delivered batch

    def died(self, worker: int, why: str) -> None:
        """Count a replacement; a worker that dies three times without delivering a batch ends the run."""
        self.restarts += 1
        self.failures[worker] += 1
        if self.failures[worker] >= MAX_FAILURES:
            raise RuntimeError(f"rollout worker {worker} died {MAX_FAILURES} times in a row without delivering a "
                               f"batch (last: {why}); see its output above")

    def worker_of(self, step: int) -> int:
        return step % self.n

    def submit(self, version: int, send, now: float) -> None:
        while self.next_submit < self.steps and admitted(self.next_submit, version, self.k, self.eta):
            s = self.next_submit
            send(s, self.worker_of(s))
            self.in_flight[s] = (now, version)
            self.next_submit += 1

    def owed(self, worker: int) -> list[int]:
        return sorted(s for s in self.in_flight if self.worker_of(s) == worker)

    def deliver(self, step: int, batch: RolloutBatch, metrics: dict, timing: dict) -> Delivery:
        """Batch ``step`` has arrived: no longer in flight; stamped with when it was submitted."""
        self.failures[self.worker_of(step)] = 0
        submitted, version = self.in_flight.pop(step)
        timing["enqueue_learner_version"] = version
        batch = batch.replace(enqueued=torch.full((batch.batch_size,), submitted, dtype=torch.float64))
        metrics["worker_restarts"] = self.restarts
        return Delivery(step, batch, metrics, timing=timing)

    def oldest_version(self, default: int) -> int:
        return min((v for _, v in self.in_flight.values()), default=default)


# the runtimes, registered by their modules in Runtime's order (after the shared parts above, which they import)
for _module in ("inline", "thread", "process", "ray"):
    importlib.import_module(f"{__name__}.{_module}")
