"""The Ray runtime across two nodes (both on this machine, bound to the loopback address): rollout
actors spread over the nodes; one node removed mid-run: its actor is replaced on the other, no
batch is lost or trained twice, and the staleness bound holds."""

from __future__ import annotations

import json

import pytest

ray = pytest.importorskip("ray")
cluster_utils = pytest.importorskip("ray.cluster_utils")

from driftless.train import Run, load_config

SMALL = ["model.warm_start=false", "model.d_model=64", "model.n_layer=2", "model.n_head=2", "model.n_kv_head=1",
         "model.d_ff=128", "model.max_seq_len=16", "task.name=first-token", "rollout.prompts_per_step=8",
         "rollout.group_size=8", "rollout.max_new_tokens=2", "train.eval_every=1000", "train.eval_problems=32",
         "train.checkpoint_every=1000", "optim.name=adamw", "optim.schedule=constant", "optim.lr=1e-2",
         "train.progress=false", "rollout.runtime=ray", "objective.name=tis"]
LOOPBACK = "127.0.0.1"
FAST_FAILURE_DETECTION = {"health_check_initial_delay_ms": 0, "health_check_period_ms": 500,
                          "health_check_failure_threshold": 2}


@pytest.fixture
def two_nodes(monkeypatch):
    if ray.is_initialized():
        ray.shutdown()
    # Ray turns a loopback address into the machine's interface address before connecting (so that a
    # cluster is reachable from other machines); on one machine, keep every connection on loopback
    from ray._private import ray_constants

    monkeypatch.setattr(ray_constants, "ENABLE_RAY_CLUSTER", False)
    cluster = cluster_utils.Cluster(initialize_head=True, head_node_args={
        "num_cpus": 2, "node_ip_address": LOOPBACK, "include_dashboard": False,
        "_system_config": FAST_FAILURE_DETECTION})
    worker = cluster.add_node(num_cpus=2, node_ip_address=LOOPBACK)
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, log_to_driver=False)
    try:
        yield cluster, worker
    finally:
        ray.shutdown()
        cluster.shutdown()


def test_rollout_actors_spread_over_two_nodes_and_survive_losing_one(tmp_path, two_nodes):
    cluster, worker_node = two_nodes
    head_id, worker_id = cluster.head_node.node_id, worker_node.node_id
    assert {n["NodeManagerAddress"] for n in ray.nodes() if n["Alive"]} == {LOOPBACK}
    steps, eta = 10, 2
    run = Run(load_config(None, [*SMALL, f"train.steps={steps}", f"rollout.staleness_bound={eta}",
                                 "rollout.workers=2"]), tmp_path)
    publish, placed, removed = run.source.published, [], []

    def remove_the_worker_node_once():
        nodes = [ray.get(a.node.remote(), timeout=60) for a in run.source.actors] if not removed else []
        if nodes:
            placed.append(nodes)
        if run.learner.version == 4 and not removed:
            removed.append(True)
            cluster.remove_node(worker_node, allow_graceful=False)  # the actor on it dies with it
        publish()
    run.source.published = remove_the_worker_node_once
    run.run()
    lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert set(placed[0]) == {head_id, worker_id}  # spread: one actor per node
    assert removed and lines[-1]["worker_restarts"] >= 1
    assert [r["step"] for r in lines] == list(range(steps)) and lines[-1]["version"] == steps  # each batch once
    assert max(r["staleness_max"] for r in lines) <= eta and lines[-1]["stale_rows_dropped"] == 0
    survivors = {n["NodeID"] for n in ray.nodes() if n["Alive"]}
    assert survivors == {head_id}
    assert len({r["worker_pid"] for r in lines}) >= 3  # two actors, then a replacement on the head node
