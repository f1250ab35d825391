"""``rollout.runtime=ray``: ``rollout.workers`` rollout workers in Ray actors, weights through the object store.

The same bound as the thread runtime (needs ``pip install driftless[ray]``); batch s goes to
actor s mod N, and actors are spread over the cluster's nodes (``SPREAD``).

- **Weights**: after every update the learner's snapshot goes into the object store; a batch is
  submitted with the newest snapshot's reference. Only the last η + 2 references are kept, so the
  store stays flat over any number of updates. With an in-flight refresh policy the driver also
  pushes each new reference to every actor (``push``, served on a thread of its own while the
  actor's batches are produced one at a time)
  and a response in progress picks it up at its next refresh check (PipelineRL-style in-flight
  updates; per-token ``version`` / ``kv_version`` recorded as on the thread runtime).
- **The learner** (``train.learner_runtime``, built by the run: ``train.learners``): ``local`` keeps it in the
  driver; ``ray`` puts its ranks in actors of their own (``RemoteLearner``): the weights then never pass through
  the driver, which fetches them only to evaluate and to checkpoint.
- **Resources and waits**: ``ray.init(num_cpus=rollout.ray_num_cpus)`` when no cluster is
  connected (``RAY_ADDRESS`` or an earlier ``ray.init`` joins one unchanged); every actor asks
  for one CPU, a cluster with fewer CPUs than actors is refused at start, and every ``ray.get``
  has a timeout.
- **Faults**: an actor that dies (``ray.kill``, a lost node) is replaced by a new one, and every
  batch it had not delivered is produced again from its step's seed on the newest weights. A batch
  is produced whole or not at all, so partial groups are never trained, and no sample is lost or
  used twice. A dead learner actor ends the run with an error; ``--resume`` continues from the
  last checkpoint.

Alignment needs nothing from the runtime environment: aligned execution is invariant by
construction, so a worker only needs the same driftless and torch versions (for a cluster:
``ray.init(runtime_env={"pip": ["driftless==<version>", "torch==<version>"]})``, or an image).
"""

from __future__ import annotations

import collections
import os
import time

import torch

from driftless.rollout import Snapshot
from driftless.train import build
from driftless.train.raycluster import WAIT_S, init_ray, ray_module
from driftless.train.sources import Delivery, Dispatch, register


def object_store_usage(ray) -> tuple[int, int]:
    """(MiB, objects) in the cluster's plasma object store, from Ray's own accounting."""
    import re

    from ray._private.internal_api import memory_summary

    text = memory_summary(ray.get_runtime_context().gcs_address, stats_only=True)
    m = re.search(r"Plasma memory usage (\d+) MiB, (\d+) objects", text)
    if m is None:
        raise RuntimeError(f"could not read the object store usage from Ray's memory summary: {text[:200]!r}")
    return int(m.group(1)), int(m.group(2))


def _actor_class(ray):
    # push() runs on a thread of its own ("weights") while produce() calls run one at a time (the default group)
    @ray.remote(num_cpus=1, max_restarts=0, concurrency_groups={"weights": 1})
    class RolloutActor:
        def __init__(self, config, state, threads: int):
            torch.set_num_threads(threads)
            self.worker = build.worker(config, state)
            self.newest: tuple[int, list] | None = None  # (version, [reference]) pushed by the driver

        @ray.method(concurrency_group="weights")
        def push(self, version: int, ref: list) -> None:
            self.newest = (version, ref)

        def _fetch(self):
            import ray as ray_

            newest = self.newest
            if newest is None or newest[0] <= self.worker.version:
                return None
            return ray_.get(newest[1][0])

        def produce(self, step: int, snapshot, refresh: bool):
            self.worker.sync_to(snapshot)
            admitted = time.time()
            start_version = self.worker.version
            batch, metrics = self.worker.produce(step, weights=self._fetch if refresh else None)
            metrics["worker_pid"] = os.getpid()
            return batch, metrics, {"admitted": admitted, "start_version": start_version}

        def node(self) -> str:
            import ray as ray_

            return ray_.get_runtime_context().get_node_id()

        def pid(self) -> int:
            return os.getpid()

    return RolloutActor


@register("ray")
class RaySource:
    def __init__(self, config, state: dict, learner, parts: build.Parts):
        self.ray = ray_module()
        self.config = config
        self.bound = config.rollout.eta
        self.refresh = config.rollout.refresh != "pin"
        t = config.train
        self.dispatch = Dispatch(config.rollout.workers, t.steps, t.ppo_epochs * t.minibatches, self.bound)
        self.learner = learner
        self.actors: list = []
        self.refs: collections.deque = collections.deque(maxlen=self.bound + 2)  # published snapshots, newest last
        self.futures: dict[int, object] = {}  # step -> the actor's future

    @property
    def actor(self):
        """The first rollout actor (the only one with ``rollout.workers=1``)."""
        return self.actors[0] if self.actors else None

    def _init_ray(self) -> None:
        init_ray(self.ray, self.config)

    def _new_actor(self):
        cls = _actor_class(self.ray)
        if self.config.rollout.workers > 1:
            cls = cls.options(scheduling_strategy="SPREAD")
        return cls.remote(self.config, self.learner.policy.state_dict(), 1)

    def _put(self):
        if hasattr(self.learner, "publish_ref"):  # a RemoteLearner (train.learners)
            return self.learner.publish_ref()  # from the learner actor into the store, never through the driver
        return self.ray.put(self.learner.publish())

    def _send(self, s: int, i: int) -> None:
        self.futures[s] = self.actors[i].produce.remote(s, self.refs[-1], self.refresh)

    def next(self, step: int) -> Delivery:
        if not self.actors:
            self._init_ray()
            self.refs.append(self._put())
            self.actors = [self._new_actor() for _ in range(self.config.rollout.workers)]
            self.dispatch.next_submit = step
        self.dispatch.submit(self.learner.version, self._send, time.time())
        deadline = time.time() + WAIT_S
        while True:
            try:
                batch, metrics, timing = self.ray.get(self.futures[step], timeout=max(1.0, deadline - time.time()))
                break
            except self.ray.exceptions.GetTimeoutError:
                raise TimeoutError(f"no batch from the Ray rollout actors within {WAIT_S} s") from None
            except (self.ray.exceptions.RayActorError, self.ray.exceptions.ObjectLostError) as err:
                # the actor died, or its node did with the batch it had finished: replace it, redo what it owed
                dead = self.dispatch.worker_of(step)
                self.dispatch.died(dead, str(err).splitlines()[0])
                self.ray.kill(self.actors[dead])
                self.actors[dead] = self._new_actor()
                for s in self.dispatch.owed(dead):
                    self._send(s, dead)
        del self.futures[step]
        return self.dispatch.deliver(step, batch, metrics, timing)

    def published(self) -> None:
        self.refs.append(self._put())  # the deque drops the oldest: at most η + 2 snapshots stay referenced
        if self.refresh:
            for actor in self.actors:
                actor.push.remote(self.learner.version, [self.refs[-1]])
        self.dispatch.submit(self.learner.version, self._send, time.time())

    def sampler_snapshot(self) -> Snapshot | None:
        if self.refs:  # the newest snapshot handed to the rollout actors
            return self.ray.get(self.refs[-1], timeout=WAIT_S)
        return self.learner.publish()

    def snapshots(self) -> dict[int, Snapshot]:
        return {}

    def restore(self, sampler: Snapshot, snapshots: dict[int, Snapshot]) -> None:
        pass  # actors start from the learner's weights when the run continues

    def close(self) -> None:
        if hasattr(self.learner, "publish_ref"):  # a RemoteLearner (train.learners)
            self.learner.close()
        for actor in self.actors:
            self.ray.kill(actor)
        self.actors = []
        self.futures.clear()
        self.refs.clear()
