"""Asynchronous collection: the staleness bound holds, stale rows are dropped, the loop learns;
the synchronous driver's lag (a deterministic virtual clock) samples from the right versions."""

from __future__ import annotations

import json
import time

import pytest
from conftest import run_until_killed

from driftless.train import load_config, train
from driftless.train.loop import TIMING_KEYS, Run

SMALL = ["model.warm_start=false", "model.d_model=64", "model.n_layer=2", "model.n_head=2", "model.n_kv_head=1",
         "model.d_ff=128", "model.max_seq_len=16", "task.name=first-token", "rollout.prompts_per_step=8",
         "rollout.group_size=8", "rollout.max_new_tokens=2", "train.eval_every=1000", "train.eval_problems=32",
         "train.checkpoint_every=1000", "optim.name=adamw", "optim.schedule=constant", "optim.lr=1e-2", "train.progress=false"]


def rows(run_dir):
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("eta", [0, 2])
def test_async_never_exceeds_the_bound_with_a_fast_producer_and_a_slow_learner(tmp_path, eta):
    run = Run(load_config(None, [*SMALL, "rollout.runtime=thread", f"rollout.staleness_bound={eta}",
                                      "train.steps=12", "objective.name=tis"]), tmp_path)
    update = run.learner.update

    def slow(batch):
        time.sleep(0.05)  # the producer is much faster: only admission control holds it back
        return update(batch)
    run.learner.update = slow
    run.run()
    lines = rows(tmp_path)
    assert [r["step"] for r in lines] == list(range(12))
    assert max(r["staleness_max"] for r in lines) == eta  # reached, never exceeded
    assert all(r["sampler_age_max"] <= eta for r in lines) and lines[-1]["stale_rows_dropped"] == 0


def test_consumption_drops_rows_beyond_the_bound(tmp_path, monkeypatch):
    """With admission control switched off, the check at consumption still keeps η: stale rows are dropped."""
    monkeypatch.setattr("driftless.train.sources.thread.admitted", lambda *args: True)
    run = Run(load_config(None, [*SMALL, "rollout.runtime=thread", "rollout.staleness_bound=1", "train.steps=10"]),
                   tmp_path)
    update = run.learner.update

    def slow(batch):
        time.sleep(0.05)
        return update(batch)
    run.learner.update = slow
    run.run()
    lines = rows(tmp_path)
    assert lines[-1]["stale_rows_dropped"] > 0
    assert max(r["staleness_max"] for r in lines) <= 1


def test_admission_waits_for_the_published_weights_not_the_learners_counter(tmp_path):
    """The learner's version moves inside update(), before its snapshot is published. A worker admitted
    on that counter in between would start from the previous snapshot and overshoot η (seen once as a
    flaky vLLM run). Publishing is slowed here to hold that window open."""
    run = Run(load_config(None, [*SMALL, "rollout.runtime=thread", "rollout.staleness_bound=1", "train.steps=12"]),
                   tmp_path)
    publish, produce = run.source.published, run.source.worker.produce

    def slow_publish():
        time.sleep(0.1)
        publish()

    def slow_produce(step, weights=None):  # the worker finishes its batches inside the publishing window
        time.sleep(0.1)
        return produce(step, weights=weights)
    run.source.published, run.source.worker.produce = slow_publish, slow_produce
    run.run()
    lines = rows(tmp_path)
    assert lines[-1]["stale_rows_dropped"] == 0 and lines[-1]["version"] == 12
    assert max(r["staleness_max"] for r in lines) <= 1


def test_async_loop_learns(tmp_path):
    d = train(load_config(None, [*SMALL, "rollout.runtime=thread", "rollout.staleness_bound=2", "train.steps=30",
                                 "train.eval_every=30", "objective.name=tis"]), tmp_path)
    lines = rows(d)
    assert sum(r["reward"] for r in lines[-5:]) / 5 > 0.9 and lines[-1]["eval_reward"] > 0.9
    assert {"prequeue_s", "inqueue_s", "prequeue_versions", "inqueue_versions"} <= set(lines[-1])


def test_lag_samples_batch_s_from_version_s_minus_lag_and_resumes_exactly(tmp_path):
    extra = ["rollout.lag=2", "train.steps=6", "train.checkpoint_every=3", "objective.name=reinforce-zero"]
    Run(load_config(None, [*SMALL, *extra]), tmp_path / "a").run()
    lines = rows(tmp_path / "a")
    assert [r["sampler_age_max"] for r in lines] == [0, 1, 2, 2, 2, 2]
    run_until_killed(Run(load_config(None, [*SMALL, *extra]), tmp_path / "b"), 3)
    Run(load_config(None, [*SMALL, *extra]), tmp_path / "b").run(resume=True)
    strip = lambda rs: [{k: v for k, v in r.items() if k not in TIMING_KEYS} for r in rs]
    assert strip(rows(tmp_path / "b")) == strip(lines)


def test_async_settings_are_checked():
    with pytest.raises(ValueError, match="rollout.staleness_bound must be >= 0, got -1"):
        load_config(None, ["rollout.runtime=thread", "rollout.staleness_bound=-1"])
    with pytest.raises(ValueError, match="rollout.staleness_bound=2 bounds the asynchronous runtimes"):
        load_config(None, ["rollout.staleness_bound=2"])


def test_an_async_run_replays_from_its_trace(tmp_path, capsys):
    from driftless.cli import main

    cfg = load_config(None, [*SMALL, "rollout.runtime=thread", "rollout.staleness_bound=2", "rollout.refresh=retain",
                             "rollout.refresh_every=1", "rollout.max_new_tokens=3", "train.steps=8",
                             "train.checkpoint_every=8", "train.trace=true", "objective.name=sc"])
    d = train(cfg, tmp_path / "run")
    assert len(list((d / "trace").glob("step_*.safetensors"))) == 8
    capsys.readouterr()
    assert main(["replay", str(d)]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result == {"run": str(d), "steps": 8, "metrics_equal": True, "weights_equal": True}


def test_lag_with_in_flight_refresh_is_deterministic_and_labels_versions(tmp_path):
    extra = ["rollout.lag=1", "rollout.refresh=recompute", "rollout.refresh_every=1", "rollout.max_new_tokens=4",
             "train.steps=6"]
    for name in ("a", "b"):
        Run(load_config(None, [*SMALL, *extra]), tmp_path / name).run()
    strip = lambda rs: [{k: v for k, v in r.items() if k not in TIMING_KEYS} for r in rs]
    a = rows(tmp_path / "a")
    assert strip(a) == strip(rows(tmp_path / "b"))  # the refresh schedule is seeded
    ages = [r["sampler_age_max"] for r in a]
    assert ages[0] == 0 and max(ages) == 1
    # some responses picked up the next version mid-generation: their batch mixes ages 1 and 0
    assert any(0 < r["sampler_age_mean"] < 1 for r in a[1:])


def test_async_resume_keeps_the_bound(tmp_path):
    extra = ["rollout.runtime=thread", "rollout.staleness_bound=1", "train.steps=8", "train.checkpoint_every=2"]
    run_until_killed(Run(load_config(None, [*SMALL, *extra]), tmp_path), 4)
    resumed = Run(load_config(None, [*SMALL, *extra]), tmp_path)
    update = resumed.learner.update

    def slow(batch):
        time.sleep(0.05)
        return update(batch)
    resumed.learner.update = slow
    resumed.run(resume=True)
    lines = rows(tmp_path)
    assert [r["step"] for r in lines] == list(range(8))
    assert max(r["staleness_max"] for r in lines[4:]) <= 1  # no burst after the resume


def test_a_sigkilled_rollout_process_is_replaced_and_no_batch_is_lost_or_repeated(tmp_path):
    import os
    import signal

    run = Run(load_config(None, [*SMALL, "rollout.runtime=process",
                                        "rollout.staleness_bound=2", "train.steps=10"]), tmp_path)
    publish, killed = run.source.published, []

    def kill_once():
        if run.learner.version == 3 and not killed:
            killed.append(run.source.proc.pid)
            os.kill(run.source.proc.pid, signal.SIGKILL)  # whatever it was generating is lost with it
        publish()
    run.source.published = kill_once
    run.run()
    lines = rows(tmp_path)
    assert killed and lines[-1]["worker_restarts"] == 1
    assert [r["step"] for r in lines] == list(range(10))  # every step once, in order
    assert max(r["staleness_max"] for r in lines) <= 2 and lines[-1]["version"] == 10
    assert sum(r["reward"] for r in lines[-3:]) / 3 > sum(r["reward"] for r in lines[:3]) / 3  # it went on learning


def test_two_rollout_processes_share_the_batches_and_one_can_be_sigkilled(tmp_path):
    import os
    import signal

    run = Run(load_config(None, [*SMALL, "rollout.runtime=process", "rollout.workers=2",
                                        "rollout.staleness_bound=2", "train.steps=10"]), tmp_path)
    publish, killed, pids = run.source.published, [], set()

    def kill_second_once():
        pids.update(p.pid for p in run.source.procs)
        if run.learner.version == 4 and not killed:
            killed.append(run.source.procs[1].pid)
            os.kill(run.source.procs[1].pid, signal.SIGKILL)
        publish()
    run.source.published = kill_second_once
    run.run()
    lines = rows(tmp_path)
    assert killed and lines[-1]["worker_restarts"] == 1
    assert len(pids) == 3  # two workers, then a replacement for the killed one
    assert [r["step"] for r in lines] == list(range(10)) and lines[-1]["version"] == 10
    assert max(r["staleness_max"] for r in lines) <= 2
    with pytest.raises(ValueError, match=r"rollout.workers=2 needs rollout.runtime=process or ray \(got 'sync'\)"):
        load_config(None, ["rollout.workers=2"])
