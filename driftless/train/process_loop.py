"""Asynchronous collection with rollout workers in separate processes (``rollout.runtime=process``).

The same pipeline and bound as ``AsyncRun`` (which this subclasses), with ``rollout.workers``
workers in spawned processes that a SIGKILL can take down (batch s goes to worker s mod N). Requests (step, weights when they changed) go
down a queue; each batch comes back as a file renamed into place once complete (a worker killed
while writing leaves no partial message for the learner to block on). Admission is decided here, before a
request is sent. If a process dies, a new one starts on the learner's current weights and
every request it had not delivered is sent again (each batch is a pure function of its
step's seed and the weights); a batch delivered twice is used once (by step), and a batch is
produced whole or not at all, so partial groups are never trained.
"""

from __future__ import annotations

import io
import multiprocessing as mp
import os
import shutil
import tempfile
import time

import torch

from driftless.train.async_loop import WAIT_S, AsyncRun


def _pack(obj) -> bytes:
    """Tensors as bytes: torch's queue pickling shares storage through the sender, which may be dead
    by the time the receiver reads (a SIGKILLed worker)."""
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _unpack(data: bytes):
    return torch.load(io.BytesIO(data), weights_only=False)


def _serve(config, state: dict, requests, results: str) -> None:
    """The worker process: build the policy once, then answer requests until a None arrives."""
    torch.set_num_threads(1)
    from driftless.mismatch import parse_view
    from driftless.rollout import Snapshot
    from driftless.rollout.worker import RolloutWorker
    from driftless.tasks import CharTokenizer
    from driftless.train.factory import make_policy
    from driftless.train.loop import rollout_settings

    tokenizer = CharTokenizer()
    worker = RolloutWorker(make_policy(config, tokenizer, state), config.task.build(), tokenizer,
                           rollout_settings(config), view=parse_view(config.mismatch.view))
    while True:
        request = requests.get()
        if request is None:
            return
        step, version, weights = request
        if weights is not None:
            worker.load(Snapshot(_unpack(weights), version))
        admitted = time.time()
        batch, metrics = worker.produce(step)
        final = os.path.join(results, f"step_{step:06d}.pt")
        with open(final + ".tmp", "wb") as f:
            f.write(_pack((step, batch, metrics, {"admitted": admitted, "start_version": worker.version})))
        os.replace(final + ".tmp", final)


class ProcessRun(AsyncRun):
    """``rollout.workers`` spawned worker processes; batch s goes to worker s mod N."""

    def __init__(self, config, run_dir=None, *, progress=None):
        super().__init__(config, run_dir, progress=progress)
        self.ctx = mp.get_context("spawn")
        self.n_workers = config.rollout.workers
        self.procs: list = []
        self.queues: list = []
        self.sent_versions: list[int | None] = []  # per worker: the version whose weights it last received
        self.in_flight: dict[int, tuple[float, int]] = {}  # step -> (submitted at, learner version then)
        self.next_submit = 0
        self.restarts = 0
        self.results: str | None = None

    @property
    def proc(self):
        """The first worker process (the only one with ``rollout.workers=1``)."""
        return self.procs[0] if self.procs else None

    def _spawn(self, i: int) -> None:
        queue = self.ctx.Queue()
        proc = self.ctx.Process(target=_serve, args=(self.config, self.learner.policy.state_dict(), queue,
                                                     self.results), daemon=True, name=f"rollout-worker-{i}")
        proc.start()
        self.queues[i], self.procs[i], self.sent_versions[i] = queue, proc, None

    def _start(self) -> None:
        if self.results is None:
            self.results = tempfile.mkdtemp(prefix="driftless-rollout-")
        self.procs, self.queues = [None] * self.n_workers, [None] * self.n_workers
        self.sent_versions = [None] * self.n_workers
        for i in range(self.n_workers):
            self._spawn(i)
        self.next_submit = self.step_index
        self._thread = True  # started (AsyncRun's flag)

    def _send(self, s: int) -> None:
        """Request batch s from its worker, with the weights when that worker has not seen this version."""
        i, weights = s % self.n_workers, None
        if self.learner.version != self.sent_versions[i]:
            snap = self.learner.publish()
            self.worker.snapshot = snap  # what checkpoints record as the sampler's weights
            weights = _pack(snap.state)
        self.queues[i].put((s, self.learner.version, weights))
        self.sent_versions[i] = self.learner.version

    def _submit(self) -> None:
        """Send every admitted request."""
        while self.next_submit < self.config.train.steps and self._admitted(self.next_submit):
            s = self.next_submit
            self._send(s)
            self.in_flight[s] = (time.time(), self.learner.version)
            self.next_submit += 1

    def _delivered(self, s: int) -> bool:
        return os.path.exists(os.path.join(self.results, f"step_{s:06d}.pt"))

    def _restart(self, i: int) -> None:
        """Worker i died: start a new one on the current weights; resend what it had not delivered."""
        self.restarts += 1
        self.procs[i].join(timeout=5)
        self._abandon_queue(self.queues[i])  # its reader is gone: never wait to flush into it
        self._spawn(i)
        for s in sorted(self.in_flight):
            if s % self.n_workers == i and not self._delivered(s):  # delivered before the crash: kept
                self._send(s)

    def _next(self, s: int):
        if not self.procs:
            self._start()
        self._submit()
        deadline = time.time() + WAIT_S
        path = os.path.join(self.results, f"step_{s:06d}.pt")
        while not os.path.exists(path):
            if time.time() > deadline:
                raise TimeoutError(f"no batch from the rollout processes within {WAIT_S} s")
            for i, proc in enumerate(self.procs):
                if not proc.is_alive():
                    self._restart(i)
            time.sleep(0.01)
        with open(path, "rb") as f:
            produced, batch, metrics, info = _unpack(f.read())
        os.remove(path)  # a batch sent twice (after a restart) is written over, and used once
        submitted, version = self.in_flight.pop(s, (time.time(), self.learner.version))
        info["enqueue_learner_version"] = version
        batch = batch.replace(enqueued=torch.full((batch.batch_size,), submitted, dtype=torch.float64))
        metrics["worker_restarts"] = self.restarts
        return produced, batch, metrics, info

    def _publish(self) -> None:
        self._submit()

    @staticmethod
    def _abandon_queue(queue) -> None:
        queue.cancel_join_thread()
        queue.close()

    def close(self) -> None:
        for proc, queue in zip(self.procs, self.queues):
            if proc.is_alive():
                queue.put(None)
        for proc, queue in zip(self.procs, self.queues):
            proc.join(timeout=30)
            if proc.is_alive():
                proc.kill()
            self._abandon_queue(queue)
        self.procs, self.queues = [], []
        if self.results is not None:
            shutil.rmtree(self.results, ignore_errors=True)
            self.results = None
        self._thread = None
