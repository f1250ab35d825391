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
- **The learner** (``train.learner_runtime``): ``local`` keeps it in the driver; ``ray`` puts it
  in an actor of its own (``RemoteLearner``): the weights then never pass through the driver,
  which fetches them only to evaluate and to checkpoint.
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
from driftless.train.sources import WAIT_S, Delivery, Dispatch, register


def _ray():
    try:
        import ray
    except ImportError as err:
        raise ValueError("rollout.runtime=ray needs Ray: pip install 'driftless[ray]'") from err
    return ray


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


def _learner_actor_class(ray, gpus: int = 0):
    @ray.remote(num_cpus=1, num_gpus=gpus, max_restarts=0)
    class LearnerActor:
        """One learner rank. ``address()`` (rank 0 only) names the rendezvous; ``setup`` sets the environment
        torchrun would (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT) and builds the learner, whose
        ``Ranks.from_env`` then joins the process group exactly as under torchrun."""

        def __init__(self, threads: int):
            torch.set_num_threads(threads)
            self.learner = None

        def address(self) -> tuple[str, int]:
            import socket

            import ray as ray_

            with socket.socket() as s:  # a free port on this node for the process group's store
                s.bind(("", 0))
                port = s.getsockname()[1]
            return ray_.util.get_node_ip_address(), port

        def setup(self, config, state, rank: int, world: int, address: tuple[str, int]) -> int:
            if world > 1:  # a GPU actor sees only its own device (Ray sets CUDA_VISIBLE_DEVICES): LOCAL_RANK 0
                os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK="0", LOCAL_WORLD_SIZE="1",
                                  MASTER_ADDR=address[0], MASTER_PORT=str(address[1]))
            self.learner = build.learner(config, state)
            return os.getpid()

        def update(self, batch):
            metrics = self.learner.update(batch) if batch is not None else {}
            return metrics, self.learner.version, self.learner.skipped_steps

        def publish(self):
            return self.learner.publish()

        def state_dict(self):
            return self.learner.whole_state_dict()

        def load_state_dict(self, state):
            self.learner.load_state_dict(state)
            return self.learner.version, self.learner.skipped_steps

        def close(self) -> None:
            self.learner.ranks.close()

    return LearnerActor


def learner_gpus(ray, config) -> int:
    """GPUs each learner actor asks for: one with ``train.device=cuda``, or with ``auto`` when the cluster has one
    per rank (aligned execution runs on the CPU)."""
    t = config.train
    if t.device == "cuda":
        return 1
    if t.device == "auto" and config.model.execution != "aligned":
        return int(ray.cluster_resources().get("GPU", 0) >= t.learner_ranks)
    return 0


class RemoteLearner:
    """The Learner's interface (update, publish, version, policy, state) over ``train.learner_ranks`` learner
    ranks in Ray actors (the pattern verl uses: one actor a rank, the torchrun environment set in each).

    Every rank receives the whole batch (one object in the store) and trains on its share of the rows, as under
    torchrun; the metrics are rank 0's (the whole batch's: driftless.train.ranks). Every call goes to every rank
    (FSDP's gathers are collectives) and rank 0's answer is kept. ``publish_ref()`` leaves rank 0's snapshot in
    the object store (what rollout actors receive); ``policy`` is a local copy refreshed from it when read after
    an update (evaluation). Checkpoints are one process's (whole model, optimizer keyed by parameter index),
    gathered by the ranks one tensor at a time: a run resumes on any number of ranks and runtimes.
    """

    def __init__(self, ray, config, state, *, threads: int = 1, tokenizer=None):
        self.ray, self.policy_copy = ray, build.policy(config, state, tokenizer)
        world = config.train.learner_ranks
        cls = _learner_actor_class(ray, learner_gpus(ray, config))
        if world > 1:
            cls = cls.options(scheduling_strategy="SPREAD")
        self.actors = [cls.remote(threads) for _ in range(world)]
        address = self._get(self.actors[0].address.remote(), "its address") if world > 1 else ("", 0)
        ref = ray.put(state)  # the initial weights once in the store, not once per rank
        self.pids = self._get([a.setup.remote(config, ref, rank, world, address) for rank, a in
                               enumerate(self.actors)], "its set-up")
        self.version, self.skipped_steps = 0, 0
        self._copy_version: int | None = None

    @property
    def actor(self):
        """Rank 0's actor."""
        return self.actors[0]

    def _get(self, ref, what: str):
        try:
            return self.ray.get(ref, timeout=WAIT_S)
        except self.ray.exceptions.GetTimeoutError:
            raise TimeoutError(f"the learner actor did not answer {what} within {WAIT_S} s") from None
        except self.ray.exceptions.RayActorError as err:
            raise RuntimeError(f"the learner actor died during {what}; resume the run from its last checkpoint "
                               "(--resume)") from err

    def _all(self, method: str, *args) -> list:
        return [getattr(a, method).remote(*args) for a in self.actors]

    def update(self, batch) -> dict:
        ref = self.ray.put(batch) if len(self.actors) > 1 else batch
        answers = self._get(self._all("update", ref), "an update")
        metrics, self.version, self.skipped_steps = answers[0]
        return metrics

    def publish_ref(self):
        return self._all("publish")[0]  # every rank takes part (FSDP gathers); rank 0's copy is kept

    def publish(self) -> Snapshot:
        return self._get(self.publish_ref(), "a publish")

    @property
    def policy(self):
        if self._copy_version != self.version:
            self.policy_copy.load_state_dict(self.publish().state)
            self._copy_version = self.version
        return self.policy_copy

    def state_dict(self) -> dict:
        return self._get(self._all("state_dict"), "a checkpoint")[0]

    def load_state_dict(self, state: dict) -> None:
        if state.get("dcp") is not None:
            raise ValueError(f"{state['dcp']} holds a torch.distributed.checkpoint folder (a run saved under "
                             "torchrun): resume it under torchrun; Ray learner ranks save and resume one "
                             "process's checkpoints")
        ref = self.ray.put(state)
        self.version, self.skipped_steps = self._get(self._all("load_state_dict", ref), "a resume")[0]
        self._copy_version = None

    def close(self) -> None:
        """Stop the actors, keeping the final weights in ``policy`` (readable after the run)."""
        try:
            self.policy  # noqa: B018 -- refreshes the local copy
        except RuntimeError:  # the actor is already gone: the copy keeps what it last had
            pass
        for actor in self.actors:
            self.ray.kill(actor)


def remote_learner(config, state: dict, parts=None) -> RemoteLearner:
    """``train.learner_runtime=ray``: the learner's ranks as Ray actors (the cluster checked for the rollout actors
    and learner actors together)."""
    ray = _ray()
    init_ray(ray, config)
    return RemoteLearner(ray, config, state, tokenizer=parts.tokenizer if parts is not None else None)


def init_ray(ray, config) -> None:
    """Start (or join) Ray, and refuse a cluster with fewer CPUs than the run's actors, by name."""
    r = config.rollout
    if not ray.is_initialized():
        ray.init(num_cpus=r.ray_cpus, include_dashboard=False, log_to_driver=False)
    learners = config.train.learner_ranks if config.train.learner_runtime == "ray" else 0
    workers = r.workers if r.runtime == "ray" else 0
    need, have = workers + learners, ray.cluster_resources().get("CPU", 0)
    if have < need:
        what = {0: "", 1: " and a learner actor"}.get(learners, f" and {learners} learner actors")
        raise ValueError(f"the Ray cluster has {have:g} CPUs; rollout.workers={r.workers} rollout actors"
                         f"{what} need {need} (raise rollout.ray_num_cpus or connect a larger cluster)")


@register("ray")
class RaySource:
    def __init__(self, config, state: dict, learner, parts: build.Parts):
        self.ray = _ray()
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
        if isinstance(self.learner, RemoteLearner):
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
        if isinstance(self.learner, RemoteLearner):
            self.learner.close()
        for actor in self.actors:
            self.ray.kill(actor)
        self.actors = []
        self.futures.clear()
        self.refs.clear()
