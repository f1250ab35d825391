"""Asynchronous collection on one machine: a rollout worker thread, the learner in the caller's.

The worker generates batch after batch while the learner trains on earlier ones. The staleness
bound η (``rollout.staleness_bound``, in versions) is enforced twice:

- **admission** at the producer (AReaL's capacity rule, in batches): batch s may start only when
  the learner has taken at least ``s·k − η`` optimizer steps (k = ppo_epochs × minibatches), so
  the weights it starts from are at most η versions behind the version that will consume it;
- **at consumption**: every row whose oldest token is more than η versions behind the learner
  is dropped, counted (``stale_rows_dropped``) and never trained on.

PPO epochs add staleness on top: within a batch the objective sees ages up to η + k − 1
(``objective_age_max``). In-flight refresh (``rollout.refresh``) lets a response pick up newer
weights mid-generation. Ages are split into pre-queue (admission to enqueue) and in-queue
(enqueue to consumption), in seconds and in versions. Every random draw is keyed by (seed,
step), but which version a batch starts from depends on timing: async runs are not bit-
reproducible (``rollout.lag`` in the synchronous driver is the deterministic counterpart).
"""

from __future__ import annotations

import queue
import threading
import time

import torch

from driftless.train.loop import Run
from driftless.train.trace import write_batch

WAIT_S = 600.0  # the longest any wait may take before the run fails (nothing waits forever)


class _Published:
    """The newest snapshot, readable from the worker thread."""

    def __init__(self, snapshot):
        self._lock = threading.Lock()
        self._snapshot = snapshot

    def set(self, snapshot) -> None:
        with self._lock:
            self._snapshot = snapshot

    def get(self):
        with self._lock:
            return self._snapshot


class AsyncRun(Run):
    def __init__(self, config, run_dir=None, *, progress=None):
        super().__init__(config, run_dir, progress=progress)
        if config.rollout.lag:
            raise ValueError("rollout.lag is the synchronous driver's virtual clock; with rollout.mode=async "
                             "staleness comes from timing, bounded by rollout.staleness_bound")
        self.eta = config.rollout.staleness_bound
        t = config.train
        self.steps_per_batch = t.ppo_epochs * t.minibatches
        self.stale_rows_dropped = 0
        self._queue: queue.Queue = queue.Queue()
        self._progress = threading.Condition()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._error: Exception | None = None
        self.idle = {"learner_wait_s": 0.0, "worker_wait_s": 0.0}

    # ------------------------------------------------------------------ the worker thread
    def _admitted(self, s: int, version: int | None = None) -> bool:
        """Batch s may start from weights of ``version`` (default: the learner's current version)."""
        version = self.learner.version if version is None else version
        return version >= s * self.steps_per_batch - self.eta

    def _produce(self, first: int) -> None:
        try:
            for s in range(first, self.config.train.steps):
                t_wait = time.perf_counter()
                with self._progress:
                    # admitted by the *published* version, the weights this batch will start from: the
                    # learner's own counter moves first, inside update(), before the snapshot is published
                    if not self._progress.wait_for(lambda s=s: self._admitted(s, self.published.get().version)
                                                   or self._stop.is_set(), WAIT_S):
                        raise TimeoutError(f"batch {s} was not admitted within {WAIT_S} s")
                if self._stop.is_set():
                    return
                self.idle["worker_wait_s"] += time.perf_counter() - t_wait
                t_admit = time.time()
                snapshot = self.published.get()
                if self.worker.snapshot is None or snapshot.version != self.worker.snapshot.version:
                    self.worker.load(snapshot)
                start_version = self.worker.version
                batch, metrics = self.worker.produce(s, weights=self.published.get)
                enqueued = time.time()
                batch = batch.replace(enqueued=torch.full((batch.batch_size,), enqueued, dtype=torch.float64))
                self._queue.put((s, batch, metrics, {"admitted": t_admit, "start_version": start_version,
                                                     "enqueue_learner_version": self.learner.version}))
        except Exception as err:  # noqa: BLE001 -- any failure ends the run, re-raised by the learner
            self._error = err
            self._queue.put(None)

    # ------------------------------------------------------------------ the learner's step
    def step(self) -> dict:
        s = self.step_index
        t0 = time.perf_counter()
        produced, batch, rollout, info = self._next(s)
        self.idle["learner_wait_s"] += time.perf_counter() - t0
        if produced != s:
            raise RuntimeError(f"batch {produced} arrived for step {s}: batches are consumed in submission order")
        consumed_at = time.time()
        v = self.learner.version
        mask = batch.action_mask
        oldest = torch.where(mask, batch.version, torch.iinfo(torch.long).max).min(1).values
        stale = (v - oldest > self.eta) & mask.any(1)
        if bool(stale.any()):  # never silently used
            self.stale_rows_dropped += int(stale.sum())
            keep = torch.nonzero(~stale).squeeze(1)
            batch = batch.select(keep) if len(keep) else None
        if self.config.train.trace:
            write_batch(self.dir, s, batch)
        ages = (v - batch.version[batch.action_mask]) if batch is not None else torch.zeros(0, dtype=torch.long)
        learner = self.learner.update(batch) if batch is not None else {"version": v, "skipped_steps":
                                                                        self.learner.skipped_steps}
        self._publish()
        created = float(batch.created.max()) if batch is not None and batch.created is not None else consumed_at
        queue_info = {
            "stale_rows_dropped": self.stale_rows_dropped,
            "staleness_max": int(ages.max()) if len(ages) else 0,
            "prequeue_s": float(created - info["admitted"]),
            "inqueue_s": float(consumed_at - float(batch.enqueued.max() if batch is not None else consumed_at)),
            "prequeue_versions": int(info["enqueue_learner_version"] - info["start_version"]),
            "inqueue_versions": int(v - info["enqueue_learner_version"]),
            "learner_wait_s": self.idle["learner_wait_s"],
            "worker_wait_s": self.idle["worker_wait_s"],
        }
        return self._finish_step(t0, rollout, learner, {"sampler_refreshed": True}, {"queue": queue_info})

    def _next(self, s: int):
        """The next batch for the learner: (step it was produced for, batch, worker metrics, timing info)."""
        if self._thread is None:
            self._start()
        try:
            item = self._queue.get(timeout=WAIT_S)
        except queue.Empty:
            raise TimeoutError(f"no batch from the rollout worker within {WAIT_S} s") from None
        if item is None:
            raise RuntimeError("the rollout worker failed") from self._error
        return item

    def _publish(self) -> None:
        self.published.set(self.learner.publish())
        with self._progress:
            self._progress.notify_all()

    # ------------------------------------------------------------------ lifecycle
    def _start(self) -> None:
        self.published = _Published(self.learner.publish())
        self._stop.clear()
        self._thread = threading.Thread(target=self._produce, args=(self.step_index,), name="rollout-worker",
                                        daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        with self._progress:
            self._progress.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=WAIT_S)
            self._thread = None

    def run(self, resume: bool = False, overwrite: bool = False):
        try:
            return super().run(resume=resume, overwrite=overwrite)
        finally:
            self.close()
