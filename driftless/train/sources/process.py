"""``rollout.runtime=process``: ``rollout.workers`` rollout workers in spawned processes.

The same bound as the thread runtime (admission decided here, before a request is sent; stale
rows dropped by the loop). Batch s goes to worker s mod N.

- **Weights** are published to a folder the workers read: after every update the learner's
  snapshot is written as ``v_<version>.safetensors`` and the ``latest`` pointer replaced
  atomically. A request names the version to start from; with an in-flight refresh policy
  (``recompute`` / ``retain``) a worker reads ``latest`` at its refresh checks and loads newer
  weights mid-response (per-token ``version`` / ``kv_version`` recorded as on the thread
  runtime). Files no request can still need are deleted.
- **Batches** come back as files renamed into place once complete (a worker killed while writing
  leaves no partial message to block on).
- **Faults**: a process that dies (SIGKILL, OOM) is replaced by a new one and every request it
  had not delivered is sent again on the learner's current weights; a batch delivered twice is
  used once (by step), and a batch is produced whole or not at all.
"""

from __future__ import annotations

import io
import multiprocessing as mp
import os
import shutil
import tempfile
import time

import torch

from driftless.models.io import load_weights, save_weights
from driftless.rollout import Snapshot
from driftless.train import build
from driftless.train.sources import WAIT_S, Delivery, Dispatch, register


def _pack(obj) -> bytes:
    """Tensors as bytes: torch's queue pickling shares storage through the sender, which may be dead
    by the time the receiver reads (a SIGKILLed worker)."""
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _unpack(data: bytes):
    return torch.load(io.BytesIO(data), weights_only=False)


def _weights_path(folder: str, version: int) -> str:
    return os.path.join(folder, f"v_{version:06d}.safetensors")


def _read_weights(folder: str, version: int) -> Snapshot:
    return Snapshot(load_weights(_weights_path(folder, version)), version)


def _newest(folder: str, held: int | None) -> Snapshot | None:
    """The newest published weights if newer than ``held`` (None otherwise, or if pruned meanwhile)."""
    try:
        with open(os.path.join(folder, "latest")) as f:
            version = int(f.read())
        return _read_weights(folder, version) if held is None or version > held else None
    except (FileNotFoundError, ValueError):
        return None


def _serve(config, folder: str, requests) -> None:
    """The worker process: answer requests (step, version) until a None arrives."""
    torch.set_num_threads(1)
    worker = None
    refresh = config.rollout.refresh != "pin"
    while True:
        request = requests.get()
        if request is None:
            return
        step, version = request
        snapshot = _read_weights(folder, version) if worker is None or worker.version != version else None
        if worker is None:
            worker = build.worker(config, snapshot.state)
        if snapshot is not None:
            worker.load(snapshot)
        admitted = time.time()
        start_version = worker.version
        newer = (lambda held=worker: _newest(folder, held.version)) if refresh else None
        batch, metrics = worker.produce(step, weights=newer)
        metrics["worker_pid"] = os.getpid()
        final = os.path.join(folder, f"step_{step:06d}.pt")
        with open(final + ".tmp", "wb") as f:
            f.write(_pack((batch, metrics, {"admitted": admitted, "start_version": start_version})))
        os.replace(final + ".tmp", final)


@register("process")
class ProcessSource:
    def __init__(self, config, state: dict, learner, parts: build.Parts):
        self.config = config
        self.learner = learner
        self.bound = config.rollout.eta
        t = config.train
        self.dispatch = Dispatch(config.rollout.workers, t.steps, t.ppo_epochs * t.minibatches, self.bound)
        self.ctx = mp.get_context("spawn")
        self.procs: list = []
        self.queues: list = []
        self.folder: str | None = None
        self.sent: Snapshot | None = None  # the newest weights published to the workers

    @property
    def proc(self):
        """The first worker process (the only one with ``rollout.workers=1``)."""
        return self.procs[0] if self.procs else None

    # ------------------------------------------------------------------ weights
    def _write_weights(self) -> None:
        snapshot = self.learner.publish()
        path = _weights_path(self.folder, snapshot.version)
        save_weights(snapshot.state, path)  # atomic; tied weights written once
        with open(os.path.join(self.folder, "latest.tmp"), "w") as f:
            f.write(str(snapshot.version))
        os.replace(os.path.join(self.folder, "latest.tmp"), os.path.join(self.folder, "latest"))
        self.sent = snapshot
        keep = self.dispatch.oldest_version(snapshot.version)  # a request in flight may still need it
        for name in os.listdir(self.folder):
            if name.startswith("v_") and name.endswith(".safetensors") and int(name[2:8]) < keep:
                os.remove(os.path.join(self.folder, name))

    # ------------------------------------------------------------------ workers
    def _spawn(self, i: int) -> None:
        requests = self.ctx.Queue()
        proc = self.ctx.Process(target=_serve, args=(self.config, self.folder, requests), daemon=True,
                                name=f"rollout-worker-{i}")
        proc.start()
        self.queues[i], self.procs[i] = requests, proc

    def _send(self, s: int, i: int) -> None:
        self.queues[i].put((s, self.learner.version))

    def _start(self, step: int) -> None:
        self.folder = tempfile.mkdtemp(prefix="driftless-rollout-")
        self._write_weights()
        n = self.config.rollout.workers
        self.procs, self.queues = [None] * n, [None] * n
        for i in range(n):
            self._spawn(i)
        self.dispatch.next_submit = step

    def _result(self, s: int) -> str:
        return os.path.join(self.folder, f"step_{s:06d}.pt")

    def _restart(self, i: int) -> None:
        """Worker i died: start a new one; resend what it had not delivered."""
        self.procs[i].join(timeout=5)
        self.dispatch.died(i, f"exit code {self.procs[i].exitcode}")
        _abandon(self.queues[i])  # its reader is gone: never wait to flush into it
        self._spawn(i)
        for s in self.dispatch.owed(i):
            if not os.path.exists(self._result(s)):  # delivered before the crash: kept
                self._send(s, i)

    def next(self, step: int) -> Delivery:
        if not self.procs:
            self._start(step)
        self.dispatch.submit(self.learner.version, self._send, time.time())
        deadline = time.time() + WAIT_S
        path = self._result(step)
        while not os.path.exists(path):
            if time.time() > deadline:
                raise TimeoutError(f"no batch from the rollout processes within {WAIT_S} s")
            for i, proc in enumerate(self.procs):
                if not proc.is_alive():
                    self._restart(i)
            time.sleep(0.01)
        with open(path, "rb") as f:
            batch, metrics, timing = _unpack(f.read())
        os.remove(path)  # a batch sent twice (after a restart) is written over, and used once
        return self.dispatch.deliver(step, batch, metrics, timing)

    def published(self) -> None:
        self._write_weights()
        self.dispatch.submit(self.learner.version, self._send, time.time())

    def sampler_snapshot(self) -> Snapshot | None:
        return self.sent or self.learner.publish()

    def snapshots(self) -> dict[int, Snapshot]:
        return {}

    def restore(self, sampler: Snapshot, snapshots: dict[int, Snapshot]) -> None:
        pass  # workers start from the learner's weights when the run continues

    def close(self) -> None:
        for proc, requests in zip(self.procs, self.queues):
            if proc.is_alive():
                requests.put(None)
        for proc, requests in zip(self.procs, self.queues):
            proc.join(timeout=30)
            if proc.is_alive():
                proc.kill()
            _abandon(requests)
        self.procs, self.queues = [], []
        if self.folder is not None:
            shutil.rmtree(self.folder, ignore_errors=True)
            self.folder = None


def _abandon(requests) -> None:
    requests.cancel_join_thread()
    requests.close()
