"""Asynchronous collection with the rollout worker in a separate process (``rollout.runtime=process``).

The same pipeline and bound as ``AsyncRun`` (which this subclasses), with the worker in a
spawned process that a SIGKILL can take down. Requests (step, weights when they changed) go
down a queue; each batch comes back as a file renamed into place once complete (a worker killed
while writing leaves no partial message for the learner to block on). Admission is decided here, before a
request is sent. If the process dies, a new one starts on the learner's current weights and
every request without a delivered batch is sent again (each batch is a pure function of its
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
    def __init__(self, config, run_dir=None, *, progress=None):
        super().__init__(config, run_dir, progress=progress)
        self.ctx = mp.get_context("spawn")
        self.proc = None
        self.in_flight: dict[int, tuple[float, int]] = {}  # step -> (submitted at, learner version then)
        self.next_submit = 0
        self.sent_version: int | None = None
        self.restarts = 0
        self.results: str | None = None

    def _start(self) -> None:
        if self.results is None:
            self.results = tempfile.mkdtemp(prefix="driftless-rollout-")
        self.requests = self.ctx.Queue()
        self.proc = self.ctx.Process(target=_serve, args=(self.config, self.learner.policy.state_dict(), self.requests,
                                                         self.results), daemon=True, name="rollout-worker")
        self.proc.start()
        self.sent_version = None
        self.next_submit = self.step_index
        self._thread = True  # started (AsyncRun's flag)

    def _submit(self) -> None:
        """Send every admitted request; the weights only when the learner's version changed since the last one."""
        while self.next_submit < self.config.train.steps and self._admitted(self.next_submit):
            s = self.next_submit
            weights = None
            if self.learner.version != self.sent_version:
                snap = self.learner.publish()
                self.worker.snapshot = snap  # what checkpoints record as the sampler's weights
                weights = _pack(snap.state)
            self.requests.put((s, self.learner.version, weights))
            self.sent_version = self.learner.version
            self.in_flight[s] = (time.time(), self.learner.version)
            self.next_submit += 1

    def _restart(self, s: int) -> None:
        """The worker died: start a new one on the current weights; resend what was not delivered."""
        self.restarts += 1
        self.proc.join(timeout=5)
        self._abandon_queue()  # its reader is gone: never wait to flush into it
        self._start()
        self.next_submit = s
        while os.path.exists(os.path.join(self.results, f"step_{self.next_submit:06d}.pt")):
            self.next_submit += 1  # delivered before the crash: kept
        self._submit()

    def _next(self, s: int):
        if self.proc is None:
            self._start()
        self._submit()
        deadline = time.time() + WAIT_S
        path = os.path.join(self.results, f"step_{s:06d}.pt")
        while not os.path.exists(path):
            if time.time() > deadline:
                raise TimeoutError(f"no batch from the rollout process within {WAIT_S} s")
            if not self.proc.is_alive():
                self._restart(s)
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

    def _abandon_queue(self) -> None:
        self.requests.cancel_join_thread()
        self.requests.close()

    def close(self) -> None:
        if self.proc is not None:
            if self.proc.is_alive():
                self.requests.put(None)
                self.proc.join(timeout=30)
            if self.proc.is_alive():
                self.proc.kill()
            self._abandon_queue()
            self.proc = None
        if self.results is not None:
            shutil.rmtree(self.results, ignore_errors=True)
            self.results = None
        self._thread = None
