"""Every runtime honours every setting it accepts, or refuses it by name: the whole matrix.

Each accepted combination runs a few steps and is checked from what the run recorded (ages,
versions per token, trace files, workers); each refused one must name the setting. At η = 0 with
aligned execution the asynchronous pipelines are deterministic: every runtime must then write
the sync runtime's very lines.
"""

from __future__ import annotations

import json

import pytest
import torch

from driftless.train import Run, load_config
from driftless.train.loop import TIMING_KEYS
from driftless.train.trace import read_batch

SMALL = ["model.warm_start=false", "model.d_model=64", "model.n_layer=2", "model.n_head=2", "model.n_kv_head=1",
         "model.d_ff=128", "model.max_seq_len=16", "task.name=first-token", "rollout.prompts_per_step=8",
         "rollout.group_size=8", "rollout.max_new_tokens=2", "train.eval_every=1000", "train.eval_problems=32",
         "train.checkpoint_every=1000", "optim.name=adamw", "optim.schedule=constant", "optim.lr=1e-2",
         "train.progress=false", "objective.name=tis"]
RUNTIMES = ["sync", "thread", "process", "ray"]
STEPS = 4

# setting -> (overrides, the key a refusal must name)
SETTINGS = {
    "lag": (["rollout.lag=1"], "rollout.lag"),
    "staleness": (["mismatch.staleness=1"], "mismatch.staleness"),
    "bound": (["rollout.staleness_bound=1"], "rollout.staleness_bound"),
    # long responses from a sampler slowed to 80 ms a token (~1.8 s a batch): the worker cannot produce all four
    # batches from version 0 before the learner's first update, so newer weights land mid-response on any machine
    "refresh": (["rollout.refresh=retain", "rollout.refresh_every=1", "model.max_seq_len=32", "rollout.max_new_tokens=28",
                 "rollout.decode_latency=0.08", "train.trace=true", "rollout.staleness_bound=3"], "rollout.refresh"),
    "trace": (["train.trace=true"], "train.trace"),
    "workers": (["rollout.workers=2"], "rollout.workers"),
    "learner": (["train.learner_runtime=ray"], "train.learner_runtime"),
}
ACCEPTED = {
    "sync": {"lag", "staleness", "trace"},
    "thread": {"bound", "refresh", "trace"},
    "process": {"bound", "refresh", "trace", "workers"},
    "ray": {"bound", "refresh", "trace", "workers", "learner"},
}


@pytest.fixture(scope="module", autouse=True)
def ray_session():
    yield
    try:
        import ray
    except ImportError:
        return
    if ray.is_initialized():
        ray.shutdown()


def rows(run_dir):
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _traced(run_dir):
    return [read_batch(p) for p in sorted((run_dir / "trace").glob("step_*.safetensors"))]


def _check(setting: str, run: Run, lines: list[dict]) -> None:
    """What the recorded run must show for ``setting`` to have been honoured."""
    assert [r["step"] for r in lines] == list(range(STEPS)) and lines[-1]["version"] == STEPS
    if setting == "lag":  # batch s from the weights after max(0, s - 1) steps
        assert [r["sampler_age_max"] for r in lines] == [0, 1, 1, 1]
    elif setting == "staleness":  # new weights every second step only
        assert [r["sampler_refreshed"] for r in lines] == [True, False, True, False]
        assert [r["sampler_age_max"] for r in lines] == [0, 1, 0, 1]
    elif setting == "bound":
        assert max(r["staleness_max"] for r in lines) <= 1 and max(r["sampler_age_max"] for r in lines) <= 1
    elif setting == "refresh":  # responses picked up newer weights mid-way, keeping their stale cache (retain)
        batches = _traced(run.dir)
        changed = kv_behind = 0
        for b in batches:
            m = b.action_mask
            first = torch.where(m, b.version, 1 << 40).min(1).values
            changed += int(((b.version > first[:, None]) & m).any(1).sum())
            kv_behind += int(((b.kv_version < b.version) & m).sum())
            assert bool(((b.kv_version <= b.version) | ~m).all())
        assert changed > 0 and kv_behind > 0, (changed, kv_behind)
    elif setting == "trace":  # the traced batches replay to the run's very weights
        from driftless.train.trace import replay

        assert len(_traced(run.dir)) == STEPS
        _, replayed = replay(run.dir)
        trained = run.learner.policy.state_dict()
        assert all(torch.equal(v, trained[k]) for k, v in replayed.policy.state_dict().items())
    elif setting == "workers":  # two processes / actors, taking the batches in turn
        pids = [r["worker_pid"] for r in lines]
        assert len(set(pids)) == 2 and pids[0::2] == [pids[0]] * (STEPS // 2)
    elif setting == "learner":
        from driftless.train.learners import RemoteLearner

        assert isinstance(run.learner, RemoteLearner)


@pytest.mark.parametrize("runtime", RUNTIMES)
def test_every_runtime_honours_or_refuses_each_setting(tmp_path, runtime):
    if runtime == "ray":
        pytest.importorskip("ray")
    base = [*SMALL, f"train.steps={STEPS}", f"rollout.runtime={runtime}"]
    if runtime == "ray":
        base.append("rollout.ray_num_cpus=3")
    for setting, (overrides, key) in SETTINGS.items():
        if setting not in ACCEPTED[runtime]:
            with pytest.raises(ValueError, match=key.replace(".", r"\.")):
                load_config(None, [*base, *overrides])
            continue
        run = Run(load_config(None, [*base, *overrides]), tmp_path / setting)
        run.run()
        _check(setting, run, rows(tmp_path / setting))


def _learning_lines(run_dir):
    queue = {"stale_rows_dropped", "staleness_max", "prequeue_versions", "inqueue_versions", "worker_restarts", "worker_pid"}
    return [{k: v for k, v in r.items() if k not in TIMING_KEYS and k not in queue} for r in rows(run_dir)]


def test_at_eta_zero_every_runtime_writes_the_sync_runtimes_lines(tmp_path):
    """η = 0 admits batch s only once the weights after step s are published: the sync runtime's
    schedule. With aligned execution the sampler's bits do not depend on the process or its thread
    count, so every runtime must write the same lines (timings and queue counters aside); lag 1
    must not."""
    common = [*SMALL, "model.execution=aligned", "train.steps=5", "train.eval_every=5", "rollout.max_new_tokens=3"]
    Run(load_config(None, common), tmp_path / "sync").run()
    reference = _learning_lines(tmp_path / "sync")
    assert [r["step"] for r in reference] == list(range(5)) and "eval_reward" in reference[-1]
    runtimes = ["thread", "process"]
    try:
        import ray  # noqa: F401

        runtimes.append("ray")
    except ImportError:
        pass
    for runtime in runtimes:
        Run(load_config(None, [*common, f"rollout.runtime={runtime}", "rollout.staleness_bound=0"]),
            tmp_path / runtime).run()
        assert _learning_lines(tmp_path / runtime) == reference, runtime
    Run(load_config(None, [*common, "rollout.lag=1"]), tmp_path / "lag1").run()
    lagged = _learning_lines(tmp_path / "lag1")
    assert lagged != reference and [r["sampler_age_max"] for r in lagged] == [0, 1, 1, 1, 1]


def test_lag_and_staleness_compose(tmp_path):
    """Refreshed every second step with the weights of one step earlier: at most lag + staleness behind."""
    Run(load_config(None, [*SMALL, "train.steps=6", "rollout.lag=1", "mismatch.staleness=1"]), tmp_path).run()
    lines = rows(tmp_path)
    assert [r["sampler_age_max"] for r in lines] == [0, 1, 1, 2, 1, 2]


def test_old_keys_say_what_to_write_instead():
    with pytest.raises(ValueError, match=r"rollout.mode was replaced by rollout.runtime: .* write rollout.runtime: thread"):
        load_config(None, ["rollout.mode=async"])
    with pytest.raises(ValueError, match="write rollout.runtime: process"):
        load_config(None, ["rollout.mode=async", "rollout.runtime=process"])
    with pytest.raises(ValueError, match="rollout.runtime 'local' was renamed"):
        load_config(None, ["rollout.runtime=local"])
    with pytest.raises(ValueError, match="rollout.runtime must be one of sync, thread, process, ray, got 'gpu'"):
        load_config(None, ["rollout.runtime=gpu"])
