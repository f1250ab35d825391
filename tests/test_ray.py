"""The Ray runtime on one machine: a short run, the staleness bound, bounded snapshot references,
and a rollout actor killed mid-run (replaced, nothing lost, nothing used twice)."""

from __future__ import annotations

import json

import pytest

ray = pytest.importorskip("ray")

from driftless.train import load_config
from driftless.train.loop import Run

SMALL = ["model.warm_start=false", "model.d_model=64", "model.n_layer=2", "model.n_head=2", "model.n_kv_head=1",
         "model.d_ff=128", "model.max_seq_len=16", "task.name=first-token", "rollout.prompts_per_step=8",
         "rollout.group_size=8", "rollout.max_new_tokens=2", "train.eval_every=1000", "train.eval_problems=32",
         "train.checkpoint_every=1000", "optim.name=adamw", "optim.schedule=constant", "optim.lr=1e-2", "train.progress=false",
         "rollout.runtime=ray", "rollout.ray_num_cpus=2", "objective.name=tis"]


@pytest.fixture(scope="module", autouse=True)
def ray_session():
    yield
    if ray.is_initialized():
        ray.shutdown()


def test_a_short_ray_run_learns_within_the_bound_with_bounded_references(tmp_path):
    run = Run(load_config(None, [*SMALL, "train.steps=24", "train.eval_every=24", "rollout.staleness_bound=1"]),
                 tmp_path)
    sizes = []
    publish = run.source.published

    def spy():
        publish()
        sizes.append(len(run.source.refs))
    run.source.published = spy
    run.run()
    lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines] == list(range(24))
    assert max(r["staleness_max"] for r in lines) <= 1 and lines[-1]["stale_rows_dropped"] == 0
    assert sum(r["reward"] for r in lines[-4:]) / 4 > 0.8
    assert max(sizes) == 3  # η + 2 snapshots referenced at most, however many updates


def test_a_killed_rollout_actor_is_replaced_and_no_batch_is_lost_or_repeated(tmp_path):
    run = Run(load_config(None, [*SMALL, "train.steps=10", "rollout.staleness_bound=2"]), tmp_path)
    publish, killed = run.source.published, []

    def kill_once():
        if run.learner.version == 3 and not killed:
            killed.append(ray.get(run.source.actor.pid.remote(), timeout=60))
            ray.kill(run.source.actor)  # in-flight batches die with it
        publish()
    run.source.published = kill_once
    run.run()
    lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert killed and lines[-1]["worker_restarts"] == 1
    assert [r["step"] for r in lines] == list(range(10))  # every step once, in order
    assert max(r["staleness_max"] for r in lines) <= 2
    assert lines[-1]["version"] == 10


def test_two_rollout_actors_share_the_batches_and_one_can_die(tmp_path):
    run = Run(load_config(None, [*SMALL, "train.steps=10", "rollout.staleness_bound=2", "rollout.workers=2"]),
                 tmp_path)
    publish, killed = run.source.published, []

    def kill_second_once():
        if run.learner.version == 4 and not killed:
            killed.append(True)
            ray.kill(run.source.actors[1])
        publish()
    run.source.published = kill_second_once
    run.run()
    lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert killed and lines[-1]["worker_restarts"] == 1
    assert [r["step"] for r in lines] == list(range(10)) and lines[-1]["version"] == 10
    assert max(r["staleness_max"] for r in lines) <= 2


def _learning_lines(path):
    """Metrics lines without timings (wall-clock values differ between any two runs)."""
    from driftless.train.loop import TIMING_KEYS

    lines = [json.loads(x) for x in (path / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if k not in TIMING_KEYS and not k.endswith("_s") and k != "worker_pid"}
            for r in lines]


def test_the_learner_as_a_ray_actor_trains_exactly_as_in_the_driver(tmp_path):
    """η = 0 makes the async pipeline deterministic (batch s starts from the weights after step s − 1):
    the learner in its own actor must then write the very lines of the learner in the driver."""
    import torch

    common = [*SMALL, "train.steps=6", "train.eval_every=3", "rollout.staleness_bound=0"]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the learner actor runs one thread: the same kernels in both runs
    try:
        Run(load_config(None, common), tmp_path / "local").run()
    finally:
        torch.set_num_threads(threads)
    remote = Run(load_config(None, [*common, "train.learner_runtime=ray"]), tmp_path / "remote")
    remote.run()
    local_lines, remote_lines = _learning_lines(tmp_path / "local"), _learning_lines(tmp_path / "remote")
    assert [r["step"] for r in remote_lines] == list(range(6))
    assert remote_lines == local_lines
    assert remote_lines[-1]["version"] == 6 and "eval_reward" in remote_lines[2]


@pytest.mark.slow  # make test-slow
def test_a_learner_actor_resumes_from_a_checkpoint_and_too_few_cpus_are_refused(tmp_path):
    cfg = [*SMALL, "train.learner_runtime=ray", "rollout.staleness_bound=1", "train.checkpoint_every=3"]
    Run(load_config(None, [*cfg, "train.steps=3"]), tmp_path).run()
    Run(load_config(None, [*cfg, "train.steps=6"]), tmp_path).run(resume=True)
    lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines] == list(range(6)) and lines[-1]["version"] == 6
    assert max(r["staleness_max"] for r in lines) <= 1
    # the learner actor dies mid-run: a clear error; the checkpoint before it resumes the run
    dying = Run(load_config(None, [*cfg, "train.steps=9"]), tmp_path)
    update = dying.learner.update

    def kill_at_version_7(batch):
        if dying.learner.version == 7:
            ray.kill(dying.learner.actor)
        return update(batch)
    dying.learner.update = kill_at_version_7
    with pytest.raises(RuntimeError, match="the learner actor died during an update; resume the run"):
        dying.run(resume=True)
    Run(load_config(None, [*cfg, "train.steps=9"]), tmp_path).run(resume=True)
    lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines] == list(range(9)) and lines[-1]["version"] == 9
    with pytest.raises(ValueError, match=r"has 2 CPUs; rollout.workers=2 rollout actors and a learner actor need 3"):
        Run(load_config(None, [*cfg, "train.steps=3", "rollout.workers=2"]), tmp_path / "big")
    with pytest.raises(ValueError, match="train.learner_runtime=ray needs rollout.runtime=ray"):
        load_config(None, ["train.learner_runtime=ray"])


def test_the_object_store_stays_flat_over_many_updates(tmp_path):
    """1.6 M parameters: every snapshot (6.4 MB) lives in the plasma store. Keeping η + 2 references
    means the store holds a bounded number of snapshots however many updates; all freed at the end.
    Ray reclaims unreferenced objects asynchronously, so every 20 updates the count is read once it
    has settled (a leak never settles: it would hold one snapshot per update)."""
    import time

    from driftless.train.sources.ray import object_store_usage

    steps, bound = 120, 8  # η + 2 = 3 kept references, plus the arguments of batches in flight
    run = Run(load_config(None, [
        "model.warm_start=false", "task.name=first-token", "rollout.prompts_per_step=2", "rollout.group_size=2",
        "rollout.max_new_tokens=1", f"train.steps={steps}", f"train.eval_every={steps}", "train.eval_problems=4",
        f"train.checkpoint_every={steps}", "train.progress=false", "rollout.runtime=ray",
        "rollout.ray_num_cpus=2", "rollout.staleness_bound=1", "train.learner_runtime=ray"]), tmp_path)
    publish, settled = run.source.published, []

    def settle(limit: int, seconds: float = 10.0) -> int:
        deadline = time.time() + seconds
        while (n := object_store_usage(ray)[1]) > limit and time.time() < deadline:
            time.sleep(0.05)
        return n

    def measured():
        publish()
        if run.learner.version % 20 == 0:
            settled.append(settle(bound))
    run.source.published = measured
    run.run()
    assert len(settled) == steps // 20
    assert max(settled) <= bound, settled
    assert settle(0) == 0 and object_store_usage(ray) == (0, 0)


RANKS = [*SMALL, "train.steps=4", "train.eval_every=2", "rollout.staleness_bound=0", "rollout.ray_num_cpus=3",
         "train.learner_runtime=ray", "train.checkpoint_every=2"]


def _same_lines(one, two):
    assert [r["step"] for r in two] == [r["step"] for r in one]
    for a, b in zip(one, two):
        assert a.keys() == b.keys()
        for key, value in a.items():
            if isinstance(value, float):
                assert b[key] == pytest.approx(value, rel=1e-4, abs=1e-6), (key, a["step"])
            else:
                assert b[key] == value, (key, a["step"])


@pytest.mark.torchrun
@pytest.mark.parametrize("parallel", ["ddp", "fsdp"])
def test_two_learner_ranks_as_ray_actors_write_the_one_rank_lines_and_resume_across_rank_counts(tmp_path, parallel):
    """η = 0: the pipeline is deterministic, so 2 learner ranks in 2 Ray actors (each the torchrun environment,
    one gloo group, micro-batches of uneven token counts) must write one learner actor's lines to float32
    rounding. A 2-rank run stopped at its step-2 checkpoint resumes on 1 rank, and a 1-rank run on 2."""
    two_ranks = ["train.learner_ranks=2", f"train.parallel={parallel}", "train.micro_batch_tokens=40"]
    ray.shutdown()  # a session of this module's other tests has 2 CPUs: this one starts its own with 3
    one = Run(load_config(None, RANKS), tmp_path / "one")
    one.run()
    two = Run(load_config(None, [*RANKS, *two_ranks]), tmp_path / "two")
    assert len(set(two.learner.pids)) == 2  # two processes, one rank each
    two.run()
    reference = _learning_lines(tmp_path / "one")
    _same_lines(reference, _learning_lines(tmp_path / "two"))
    # 2 → 1 and 1 → 2: the first two steps on one count of ranks, the last two on the other
    Run(load_config(None, [*RANKS, *two_ranks, "train.steps=2"]), tmp_path / "down").run()
    Run(load_config(None, RANKS), tmp_path / "down").run(resume=True)
    _same_lines(reference, _learning_lines(tmp_path / "down"))
    Run(load_config(None, [*RANKS, "train.steps=2"]), tmp_path / "up").run()
    Run(load_config(None, [*RANKS, *two_ranks]), tmp_path / "up").run(resume=True)
    _same_lines(reference, _learning_lines(tmp_path / "up"))


@pytest.mark.torchrun
def test_a_transformers_checkpoint_trains_on_two_ray_learner_ranks_as_on_one(tmp_path):
    """What a user brings, on Ray learner ranks: a save_pretrained Qwen3 checkpoint with its BPE tokenizer and
    chat template, a JSONL data file with the countdown reward, FSDP2 over 2 Ray actors: the one-actor lines."""
    pytest.importorskip("transformers")
    from conftest import hf_stand_in

    hf = [*hf_stand_in(tmp_path), "optim.name=adamw", "train.progress=false", "rollout.runtime=ray",
          "rollout.ray_num_cpus=3", "rollout.staleness_bound=0", "train.learner_runtime=ray"]
    ray.shutdown()
    Run(load_config(None, hf), tmp_path / "one").run()
    two = Run(load_config(None, [*hf, "train.learner_ranks=2", "train.parallel=fsdp", "train.micro_batch_tokens=64"]),
              tmp_path / "two")
    assert len(set(two.learner.pids)) == 2
    two.run()
    _same_lines(_learning_lines(tmp_path / "one"), _learning_lines(tmp_path / "two"))


def test_ray_learner_ranks_are_refused_where_they_cannot_run():
    ray.shutdown()
    with pytest.raises(ValueError, match="with rollout.runtime=ray runs the ranks as Ray actors: set "
                                         "train.learner_runtime=ray"):
        load_config(None, [*SMALL, "train.learner_ranks=2"])
    with pytest.raises(ValueError, match=r"has 2 CPUs; rollout.workers=1 rollout actors and 2 learner actors need 3"):
        Run(load_config(None, [*SMALL, "train.learner_runtime=ray", "train.learner_ranks=2"]))
