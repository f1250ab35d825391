"""Ray for the runtimes that use it (the rollout actors, ``sources/ray.py``; the learner actors, ``learners.py``):
importing it by name, starting or joining the cluster, and the wait every ``ray.get`` is bounded by."""

from __future__ import annotations

WAIT_S = 600.0  # the longest any wait may take before the run fails (nothing waits forever): every runtime's


def ray_module():
    """The ``ray`` package, or a refusal naming the extra that installs it."""
    try:
        import ray
    except ImportError as err:
        raise ValueError("rollout.runtime=ray needs Ray: pip install 'driftless[ray]'") from err
    return ray


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
