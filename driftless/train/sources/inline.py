"""``rollout.runtime=sync``: the rollout worker in the driver, taking turns with the learner.

Batch s is sampled, then trained on, then the next is sampled: deterministic, and resumable to
the same lines. Two deterministic kinds of staleness compose:

- ``rollout.lag`` L (a virtual clock): batch s comes from the weights published after
  max(0, s − L) steps, as an asynchronous pipeline L updates deep would give, without its
  timing. With an in-flight refresh policy the next version arrives mid-response at refresh
  checks drawn from a seeded schedule (probability 1/2 per check, keyed by (seed, step)).
- ``mismatch.staleness`` S: the sampler takes new weights only every S + 1 steps (at step r
  with r mod (S + 1) = 0, the weights of step max(0, r − L)), so a token is at most L + S
  versions behind.
"""

from __future__ import annotations

import random

from driftless.rollout import Snapshot
from driftless.rollout.worker import step_seed
from driftless.train import build
from driftless.train.sources import Delivery, register


@register("sync")
class InlineSource:
    bound = None  # never stale beyond what the config asked for: nothing to drop

    def __init__(self, config, state: dict, learner, parts: build.Parts):
        self.config = config
        self.learner = learner
        self.lag, self.every = config.rollout.lag, config.mismatch.staleness + 1
        # a sampler that reads exactly the trainer's weights (no lag, no staleness, no mismatch view, the built-in
        # engine, a learner in this process and unsharded) holds the trainer's own tensors instead of a copy: one
        # copy of the weights in memory (Snapshot.sharing)
        # (on the CPU only: a learner on a GPU keeps its sampler's copy on the CPU, as before, with its own buffers)
        self.adopt = (not self.lag and self.every == 1 and getattr(parts.view, "identity", False)
                      and config.rollout.engine == "driftless" and getattr(learner, "sharded", True) is False
                      and build.device(config).type == "cpu")
        self.worker = build.worker(config, learner.publish(shared=True).state if self.adopt else state, parts,
                                   adopt=self.adopt)
        self.worker.sampler.adopted = self.adopt  # its tensors are the trainer's: a resume's load copies, never writes
        self.history: dict[int, Snapshot] = {}  # lag > 0: the weights published after each step count
        self.step = 0
        # rollout.shard_across_ranks: each learner rank generates its share of the groups, the ranks gather them
        self.share = learner.ranks if config.rollout.shard_across_ranks else None

    def next(self, step: int) -> Delivery:
        self.step = step
        due = step % self.every == 0 or self.worker.snapshot is None
        refreshed = due
        if self.lag:
            if not self.history:
                self.history[step] = self.learner.publish()
            refreshed = due and self.worker.sync_to(self.history[max(0, step - self.lag)])
        elif due:  # publish the learner's weights to the worker (which applies its mismatch view)
            self.worker.load(self.learner.publish(shared=self.adopt))
        batch, rollout = self.worker.produce(step, weights=self._virtual_refresh(step), share=self.share)
        return Delivery(step, batch, rollout, refreshed=bool(refreshed))

    def _virtual_refresh(self, s: int):
        if not self.lag or self.config.rollout.refresh == "pin" or s - self.lag + 1 not in self.history:
            return None
        rng = random.Random(step_seed(self.config.train.seed, s, 3))
        newer = self.history[max(0, s - self.lag + 1)]
        arrived = []

        def weights():
            if not arrived and rng.random() < 0.5:
                arrived.append(True)
            return newer if arrived else None
        return weights

    def published(self) -> None:
        if self.lag:
            s = self.step
            self.history[s + 1] = self.learner.publish()
            for old in [k for k in self.history if k < s + 1 - self.lag]:
                del self.history[old]

    def sampler_snapshot(self) -> Snapshot | None:
        snapshot = self.worker.snapshot
        if snapshot is not None and snapshot.shared:  # the learner's live tensors: they hold its current version
            return Snapshot(snapshot.state, self.learner.version)
        return snapshot

    def snapshots(self) -> dict[int, Snapshot]:
        return dict(self.history)

    def restore(self, sampler: Snapshot, snapshots: dict[int, Snapshot]) -> None:
        self.worker.load(sampler)
        self.history = dict(snapshots)

    def close(self) -> None:
        pass
