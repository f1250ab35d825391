"""The Ray runtime on one machine: a short run, the staleness bound, bounded snapshot references,
and a rollout actor killed mid-run (replaced, nothing lost, nothing used twice)."""

from __future__ import annotations

import json

import pytest

ray = pytest.importorskip("ray")

from driftless.train import load_config
from driftless.train.ray_loop import RayRun

SMALL = ["model.warm_start=false", "model.d_model=64", "model.n_layer=2", "model.n_head=2", "model.n_kv_head=1",
         "model.d_ff=128", "model.max_seq_len=16", "task.name=first-token", "rollout.prompts_per_step=8",
         "rollout.group_size=8", "rollout.max_new_tokens=2", "train.eval_every=1000", "train.eval_problems=32",
         "train.checkpoint_every=1000", "optim.name=adamw", "optim.lr=1e-2", "train.progress=false",
         "rollout.mode=async", "rollout.runtime=ray", "rollout.ray_num_cpus=2", "objective.name=tis"]


@pytest.fixture(scope="module", autouse=True)
def ray_session():
    yield
    if ray.is_initialized():
        ray.shutdown()


def test_a_short_ray_run_learns_within_the_bound_with_bounded_references(tmp_path):
    run = RayRun(load_config(None, [*SMALL, "train.steps=24", "train.eval_every=24", "rollout.staleness_bound=1"]),
                 tmp_path)
    sizes = []
    publish = run._publish

    def spy():
        publish()
        sizes.append(len(run.refs))
    run._publish = spy
    run.run()
    lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines] == list(range(24))
    assert max(r["staleness_max"] for r in lines) <= 1 and lines[-1]["stale_rows_dropped"] == 0
    assert sum(r["reward"] for r in lines[-4:]) / 4 > 0.8
    assert max(sizes) == 3  # η + 2 snapshots referenced at most, however many updates


def test_a_killed_rollout_actor_is_replaced_and_no_batch_is_lost_or_repeated(tmp_path):
    run = RayRun(load_config(None, [*SMALL, "train.steps=10", "rollout.staleness_bound=2"]), tmp_path)
    publish, killed = run._publish, []

    def kill_once():
        if run.learner.version == 3 and not killed:
            killed.append(ray.get(run.actor.pid.remote(), timeout=60))
            ray.kill(run.actor)  # in-flight batches die with it
        publish()
    run._publish = kill_once
    run.run()
    lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert killed and lines[-1]["actor_restarts"] == 1
    assert [r["step"] for r in lines] == list(range(10))  # every step once, in order
    assert max(r["staleness_max"] for r in lines) <= 2
    assert lines[-1]["version"] == 10


def test_two_rollout_actors_share_the_batches_and_one_can_die(tmp_path):
    run = RayRun(load_config(None, [*SMALL, "train.steps=10", "rollout.staleness_bound=2", "rollout.workers=2"]),
                 tmp_path)
    publish, killed = run._publish, []

    def kill_second_once():
        if run.learner.version == 4 and not killed:
            killed.append(True)
            ray.kill(run.actors[1])
        publish()
    run._publish = kill_second_once
    run.run()
    lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert killed and lines[-1]["actor_restarts"] == 1
    assert [r["step"] for r in lines] == list(range(10)) and lines[-1]["version"] == 10
    assert max(r["staleness_max"] for r in lines) <= 2
