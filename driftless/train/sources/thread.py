"""``rollout.runtime=thread``: a rollout worker thread generating ahead while the learner trains.

The staleness bound η (``rollout.staleness_bound``, in versions) is enforced twice:

- **admission** at the producer (AReaL's capacity rule, in batches): batch s may start only when
  the *published* weights are at least version s·k − η (k = ppo_epochs × minibatches), so the
  weights it starts from are at most η versions behind the version that will consume it;
- **at consumption** (the loop's ``drop_stale``): every row whose oldest token is more than η
  versions behind the learner is dropped, counted and never trained on.

In-flight refresh (``rollout.refresh``) hands the worker the newest published snapshot at its
refresh checks. Which version a batch starts from depends on timing: asynchronous runs are not
bit-reproducible (``rollout.lag`` on the sync runtime is the deterministic counterpart).
"""

from __future__ import annotations

import queue
import threading
import time

import torch

from driftless.rollout import Snapshot
from driftless.train import build
from driftless.train.sources import WAIT_S, Delivery, admitted, register


class _Published:
    """The newest snapshot, readable from the worker thread."""

    def __init__(self, snapshot: Snapshot):
        self._lock = threading.Lock()
        self._snapshot = snapshot

    def set(self, snapshot: Snapshot) -> None:
        with self._lock:
            self._snapshot = snapshot

    def get(self) -> Snapshot:
        with self._lock:
            return self._snapshot


@register("thread")
class ThreadSource:
    def __init__(self, config, state: dict, learner, parts: build.Parts):
        self.config = config
        self.learner = learner
        self.worker = build.worker(config, state, parts.for_thread())  # it samples on a thread of its own
        self.bound = config.rollout.eta
        self.k = config.train.ppo_epochs * config.train.minibatches
        self.refresh = config.rollout.refresh != "pin"
        self.published_weights: _Published | None = None
        self.worker_wait_s = 0.0
        self._queue: queue.Queue = queue.Queue()
        self._progress = threading.Condition()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._error: Exception | None = None

    def _produce(self, first: int) -> None:
        try:
            for s in range(first, self.config.train.steps):
                t_wait = time.perf_counter()
                with self._progress:
                    # admitted by the *published* version, the weights this batch will start from: the
                    # learner's own counter moves first, inside update(), before the snapshot is published
                    if not self._progress.wait_for(lambda s=s: admitted(s, self.published_weights.get().version,
                                                                        self.k, self.bound) or self._stop.is_set(),
                                                   WAIT_S):
                        raise TimeoutError(f"batch {s} was not admitted within {WAIT_S} s")
                if self._stop.is_set():
                    return
                self.worker_wait_s += time.perf_counter() - t_wait
                t_admit = time.time()
                self.worker.sync_to(self.published_weights.get())
                start_version = self.worker.version
                batch, metrics = self.worker.produce(s, weights=self.published_weights.get if self.refresh else None)
                enqueued = time.time()
                batch = batch.replace(enqueued=torch.full((batch.batch_size,), enqueued, dtype=torch.float64))
                self._queue.put(Delivery(s, batch, metrics, timing={
                    "admitted": t_admit, "start_version": start_version,
                    "enqueue_learner_version": self.learner.version}))
        except Exception as err:  # noqa: BLE001 -- any failure ends the run, re-raised by the learner
            self._error = err
            self._queue.put(None)

    def next(self, step: int) -> Delivery:
        if self._thread is None:
            self.published_weights = _Published(self.learner.publish())
            self._stop.clear()
            self._thread = threading.Thread(target=self._produce, args=(step,), name="rollout-worker", daemon=True)
            self._thread.start()
        try:
            item = self._queue.get(timeout=WAIT_S)
        except queue.Empty:
            raise TimeoutError(f"no batch from the rollout worker within {WAIT_S} s") from None
        if item is None:
            raise RuntimeError("the rollout worker failed") from self._error
        item.timing["worker_wait_s"] = self.worker_wait_s
        return item

    def published(self) -> None:
        self.published_weights.set(self.learner.publish())
        with self._progress:
            self._progress.notify_all()

    def sampler_snapshot(self) -> Snapshot | None:
        return self.worker.snapshot

    def snapshots(self) -> dict[int, Snapshot]:
        return {}

    def restore(self, sampler: Snapshot, snapshots: dict[int, Snapshot]) -> None:
        self.worker.load(sampler)

    def close(self) -> None:
        self._stop.set()
        with self._progress:
            self._progress.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=WAIT_S)
            self._thread = None
