"""Asynchronous collection with Ray: the rollout worker as an actor, weights through the object store.

Same pipeline and staleness bound as ``AsyncRun`` (which this subclasses), with the workers in
Ray actors (``rollout.runtime=ray``, ``rollout.workers`` of them, batch s to actor s mod N;
needs ``pip install driftless[ray]``):

- **Weights**: after every update the learner puts its snapshot in the object store; a batch is
  submitted with the newest snapshot's reference. Only the last η + 2 references are kept, so
  the store stays flat over any number of updates.
- **Admission**: batch s is submitted only once ``learner.version ≥ s·k − η``; the actor
  produces batches one after the other, each from the snapshot it was submitted with.
- **The learner** (``train.learner_runtime``): ``local`` keeps it in the driver; ``ray`` puts
  it in an actor of its own (``RemoteLearner``). Then the weights never pass through the
  driver: the learner actor returns each snapshot into the object store and the driver hands
  the reference on; the driver fetches weights only to evaluate and to checkpoint.
- **Resources and waits**: ``ray.init(num_cpus=rollout.ray_num_cpus)`` when no cluster is
  connected (``RAY_ADDRESS`` or an earlier ``ray.init`` joins one unchanged); every actor asks
  for one CPU, and a cluster with fewer CPUs than actors is refused at start instead of waiting
  forever; every ``ray.get`` has a timeout.
- **Faults**: an actor that dies (``ray.kill``, a crashed node) is replaced by a new one on the
  learner's current weights, and every batch it had not delivered is produced again from its
  step's seed. A batch is produced whole or not at all, so partial groups are never trained,
  and no sample is lost or used twice (sample ids: (step, row)). A dead learner actor ends the
  run with an error; ``--resume`` continues from the last checkpoint.

Alignment needs nothing from the runtime environment: aligned execution is invariant by
construction, so a worker only needs the same driftless and torch versions (for a cluster:
``ray.init(runtime_env={"pip": ["driftless==<version>", "torch==<version>"]})``, or an image).
"""

from __future__ import annotations

import collections
import time

import torch

from driftless.train.async_loop import WAIT_S, AsyncRun


def object_store_usage(ray) -> tuple[int, int]:
    """(MiB, objects) in the cluster's plasma object store, from Ray's own accounting."""
    import re

    from ray._private.internal_api import memory_summary

    text = memory_summary(ray.get_runtime_context().gcs_address, stats_only=True)
    m = re.search(r"Plasma memory usage (\d+) MiB, (\d+) objects", text)
    if m is None:
        raise RuntimeError(f"could not read the object store usage from Ray's memory summary: {text[:200]!r}")
    return int(m.group(1)), int(m.group(2))


def _actor_class():
    import ray

    @ray.remote(num_cpus=1, max_restarts=0)
    class RolloutActor:
        def __init__(self, config, state, threads: int):
            torch.set_num_threads(threads)
            from driftless.mismatch import parse_view
            from driftless.rollout.worker import RolloutWorker
            from driftless.tasks import CharTokenizer
            from driftless.train.factory import make_policy
            from driftless.train.loop import rollout_settings

            tokenizer = CharTokenizer()
            self.worker = RolloutWorker(make_policy(config, tokenizer, state), config.task.build(), tokenizer,
                                        rollout_settings(config), view=parse_view(config.mismatch.view))

        def produce(self, step: int, snapshot):
            if self.worker.snapshot is None or self.worker.snapshot.version != snapshot.version:
                self.worker.load(snapshot)
            admitted = time.time()
            start_version = self.worker.version
            batch, metrics = self.worker.produce(step)
            return step, batch, metrics, {"admitted": admitted, "start_version": start_version}

        def pid(self) -> int:
            import os

            return os.getpid()

    return RolloutActor


def _learner_actor_class():
    import ray

    @ray.remote(num_cpus=1, max_restarts=0)
    class LearnerActor:
        def __init__(self, config, state, threads: int):
            torch.set_num_threads(threads)
            from driftless.tasks import CharTokenizer
            from driftless.train.loop import make_learner

            self.learner = make_learner(config, CharTokenizer(), state)

        def update(self, batch):
            metrics = self.learner.update(batch) if batch is not None else {}
            return metrics, self.learner.version, self.learner.skipped_steps

        def publish(self):
            return self.learner.publish()

        def state_dict(self):
            return self.learner.state_dict()

        def load_state_dict(self, state):
            self.learner.load_state_dict(state)
            return self.learner.version, self.learner.skipped_steps

    return LearnerActor


class RemoteLearner:
    """The Learner's interface (update, publish, version, policy, state) over a Learner in a Ray actor.

    ``publish_ref()`` leaves the snapshot in the object store (what rollout actors receive);
    ``policy`` is a local copy refreshed from the actor when read after an update (evaluation).
    """

    def __init__(self, ray, config, state, policy, *, threads: int = 1):
        self.ray, self.policy_copy = ray, policy
        self.actor = _learner_actor_class().remote(config, state, threads)
        self.version, self.skipped_steps = 0, 0
        self._copy_version: int | None = None

    def _get(self, ref, what: str):
        try:
            return self.ray.get(ref, timeout=WAIT_S)
        except self.ray.exceptions.GetTimeoutError:
            raise TimeoutError(f"the learner actor did not answer {what} within {WAIT_S} s") from None
        except self.ray.exceptions.RayActorError as err:
            raise RuntimeError(f"the learner actor died during {what}; resume the run from its last checkpoint "
                               "(--resume)") from err

    def update(self, batch) -> dict:
        metrics, self.version, self.skipped_steps = self._get(self.actor.update.remote(batch), "an update")
        return metrics

    def publish_ref(self):
        return self.actor.publish.remote()

    def publish(self):
        return self._get(self.publish_ref(), "a publish")

    @property
    def policy(self):
        if self._copy_version != self.version:
            self.policy_copy.load_state_dict(self.publish().state)
            self._copy_version = self.version
        return self.policy_copy

    def state_dict(self) -> dict:
        return self._get(self.actor.state_dict.remote(), "a checkpoint")

    def load_state_dict(self, state: dict) -> None:
        self.version, self.skipped_steps = self._get(self.actor.load_state_dict.remote(state), "a resume")
        self._copy_version = None

    def close(self) -> None:
        """Stop the actor, keeping its final weights in ``policy`` (readable after the run)."""
        try:
            self.policy  # noqa: B018 -- refreshes the local copy
        except RuntimeError:  # the actor is already gone: the copy keeps what it last had
            pass
        self.ray.kill(self.actor)


class RayRun(AsyncRun):
    def __init__(self, config, run_dir=None, *, progress=None):
        super().__init__(config, run_dir, progress=progress)
        try:
            import ray
        except ImportError as err:
            raise ValueError("rollout.runtime=ray needs Ray: pip install 'driftless[ray]'") from err
        self.ray = ray
        if config.train.learner_runtime == "ray":
            self._init_ray()
            self.learner = RemoteLearner(ray, config, self.learner.policy.state_dict(), self.learner.policy)
        self.actors: list = []  # rollout.workers actors; batch s goes to actor s mod len(actors)
        self.refs: collections.deque = collections.deque(maxlen=self.eta + 2)  # published snapshots, newest last
        self.in_flight: dict[int, object] = {}  # step -> the actor's future
        self.next_submit = 0
        self.restarts = 0

    # ------------------------------------------------------------------ the actors
    @property
    def actor(self):
        """The first rollout actor (the only one with ``rollout.workers=1``)."""
        return self.actors[0] if self.actors else None

    def _init_ray(self) -> None:
        ray = self.ray
        if not ray.is_initialized():
            ray.init(num_cpus=self.config.rollout.ray_num_cpus, include_dashboard=False, log_to_driver=False)
        need = self.config.rollout.workers + (self.config.train.learner_runtime == "ray")
        have = ray.cluster_resources().get("CPU", 0)
        if have < need:
            raise ValueError(f"the Ray cluster has {have:g} CPUs; rollout.workers={self.config.rollout.workers} "
                             f"rollout actors{' and a learner actor' if need > self.config.rollout.workers else ''} "
                             f"need {need} (raise rollout.ray_num_cpus or connect a larger cluster)")

    def _start(self) -> None:
        self._init_ray()
        self.refs.append(self._put())
        self.actors = [self._new_actor() for _ in range(self.config.rollout.workers)]
        self.next_submit = self.step_index
        self._thread = True  # started (AsyncRun's flag)

    def _new_actor(self):
        return _actor_class().remote(self.config, self.learner.policy.state_dict(), 1)

    def _put(self):
        if isinstance(self.learner, RemoteLearner):
            return self.learner.publish_ref()  # from the learner actor into the store, never through the driver
        return self.ray.put(self.learner.publish())

    def save_checkpoint(self):
        if self.refs:  # the sampler's weights: the newest snapshot handed to the rollout actors
            self.worker.snapshot = self.ray.get(self.refs[-1], timeout=WAIT_S)
        return super().save_checkpoint()

    def _submit(self) -> None:
        """Submit every admitted batch not yet in flight, with the newest snapshot."""
        while self.next_submit < self.config.train.steps and self._admitted(self.next_submit):
            s = self.next_submit
            actor = self.actors[s % len(self.actors)]
            self.in_flight[s] = (actor.produce.remote(s, self.refs[-1]), time.time(), self.learner.version)
            self.next_submit += 1

    def _next(self, s: int):
        if not self.actors:
            self._start()
        self._submit()
        deadline = time.time() + WAIT_S
        while True:
            future, submitted, version = self.in_flight[s]
            try:
                produced, batch, metrics, info = self.ray.get(future, timeout=max(1.0, deadline - time.time()))
                break
            except self.ray.exceptions.GetTimeoutError:
                raise TimeoutError(f"no batch from the Ray rollout actor within {WAIT_S} s") from None
            except self.ray.exceptions.RayActorError:  # the actor died: replace it, redo what it owed
                self.restarts += 1
                n, dead = len(self.actors), s % len(self.actors)
                self.actors[dead] = self._new_actor()
                for step in sorted(k for k in self.in_flight if k % n == dead):
                    _, sent, version_then = self.in_flight[step]
                    self.in_flight[step] = (self.actors[dead].produce.remote(step, self.refs[-1]), sent, version_then)
        del self.in_flight[s]
        info["enqueue_learner_version"] = version
        batch = batch.replace(enqueued=torch.full((batch.batch_size,), submitted, dtype=torch.float64))
        metrics["actor_restarts"] = self.restarts
        return produced, batch, metrics, info

    def _publish(self) -> None:
        self.refs.append(self._put())  # the deque drops the oldest: at most η + 2 snapshots stay referenced
        self._submit()

    def close(self) -> None:
        if isinstance(self.learner, RemoteLearner):
            self.learner.close()
        for actor in self.actors:
            self.ray.kill(actor)
        self.actors = []
        self.in_flight.clear()
        self.refs.clear()
        self._thread = None
