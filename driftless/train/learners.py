"""The run's learner, built once by ``Run`` and handed to its rollout source (which never builds one): a
``Learner`` in this process (``train.learner_runtime=local``, learner ranks under torchrun included), or a
``RemoteLearner`` whose ranks are Ray actors (``train.learner_runtime=ray``)."""

from __future__ import annotations

import os

import torch

from driftless.rollout import Snapshot
from driftless.train import build
from driftless.train.raycluster import WAIT_S, init_ray, ray_module


def make_learner(config, state: dict, parts=None):
    """The run's learner: a Learner in this process, or (``train.learner_runtime=ray``) a RemoteLearner whose ranks
    are Ray actors. The run builds it once and hands it to its source."""
    if config.train.learner_runtime == "ray":
        return remote_learner(config, state, parts)
    return build.learner(config, state, parts)


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
    torchrun; the metrics are rank 0's (the whole batch's: driftless.train.parallel). Every call goes to every rank
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
    ray = ray_module()
    init_ray(ray, config)
    return RemoteLearner(ray, config, state, tokenizer=parts.tokenizer if parts is not None else None)
