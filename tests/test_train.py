"""Countdown scoring, config validation, short end-to-end runs, resume and NaN handling."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch

from driftless.tasks import CharTokenizer, Countdown, CountdownConfig, score
from driftless.train import Run, load_config, train
from driftless.train.loop import TIMING_KEYS
from driftless.train.report import write_run_report
from driftless.train.sinks import has_record, read_metrics

TINY = [
    "task.name=arithmetic", "task.max_operand=9",
    "model.d_model=64", "model.n_head=1", "model.n_kv_head=1", "model.d_ff=128", "model.n_layer=1",
    "model.max_seq_len=32", "model.warm_start=false",
    "rollout.prompts_per_step=3", "rollout.group_size=4", "rollout.max_new_tokens=4", "rollout.head_k=8",
    "train.eval_problems=8", "train.progress=false", "optim.name=sgd", "optim.lr=0.5", "optim.schedule=constant",
    "train.steps=60", "train.eval_every=10", "train.checkpoint_every=20",
]


def tiny_config(*extra):
    return load_config(None, [*TINY, *extra])


# ---------------------------------------------------------------- Countdown rules
@pytest.mark.parametrize("completion,expected", [
    ("<answer>(7-3)*9-6</answer>", 0.0),  # uses 6, not given
    ("<answer>(7-3)*9</answer>", 1.0),
    ("<answer> ( 7 - 3 ) * 9 </answer>", 1.0),
    ("think <answer>1+1</answer> then <answer>9*(7-3)</answer>", 1.0),  # the last answer counts
    ("<answer>9*(7-3)</answer> and <answer>1+1</answer>", 0.0),
    ("<answer>(7-3)*9*1</answer>", 0.0),  # an extra number
    ("<answer>(7-3)*9.0</answer>", 0.0),  # '.' is not allowed
    ("<answer>(7-3)**9</answer>", 0.0),
    ("<answer>36//1</answer>", 0.0),
    ("<answer>9*7-3</answer>", 0.0),  # wrong value
    ("(7-3)*9", 0.0),  # no answer tag
    ("<answer></answer>", 0.0),
    ("<answer>(7-3)*9", 0.0),  # unterminated
    ("<answer>9/(3-3)*7</answer>", 0.0),  # division by zero is wrong, not a crash
    ("<answer>(9*3+7+2)</answer>", 0.0),
])
def test_countdown_score(completion, expected):
    assert score((3, 7, 9), 36, completion) == expected


def test_countdown_division_and_float_target():
    assert score((6, 4, 3), 8, "<answer>6/3*4</answer>") == 1.0
    assert score((1, 3, 1), 1, "<answer>1/3*3*1</answer>") == 0.0  # wrong multiset (3 used twice)
    assert score((2, 3, 5), 3, "<answer>(5+2)/3+2-2</answer>") == 0.0


def test_countdown_generation_is_seeded_solvable_and_split():
    task = Countdown(CountdownConfig(n_numbers=4, max_number=20, max_target=200))
    a = task.sample(50, random.Random(3))
    assert a == task.sample(50, random.Random(3))
    assert all(task.score(p, p.completion) == 1.0 for p in a)
    train = {(tuple(sorted(p.numbers)), p.target) for p in task.sample(500, random.Random(1))}
    held = {(tuple(sorted(p.numbers)), p.target) for p in task.eval_set(100)}
    assert not train & held
    with pytest.raises(ValueError, match="task.n_numbers"):
        CountdownConfig(n_numbers=5)


def test_warm_start_is_deterministic_and_cached(tmp_path):
    from driftless.models import TinyLMConfig
    from driftless.tasks import Arithmetic
    from driftless.train.warmstart import WarmStartConfig, warm_start

    config = TinyLMConfig(d_model=64, n_head=1, n_kv_head=1, d_ff=128, n_layer=1, max_seq_len=32)
    ws = WarmStartConfig(steps=5, batch_size=8, eval_problems=8)
    args = {"max_new_tokens": 4, "progress": False}
    a, info_a = warm_start(config, Arithmetic(9), CharTokenizer(), ws, cache_dir=tmp_path / "a", **args)
    b, info_b = warm_start(config, Arithmetic(9), CharTokenizer(), ws, cache_dir=tmp_path / "b", **args)
    for pa, pb in zip(a.state_dict().values(), b.state_dict().values()):
        assert torch.equal(pa, pb)
    assert info_a["final_loss"] == info_b["final_loss"]
    c, info_c = warm_start(config, Arithmetic(9), CharTokenizer(), ws, cache_dir=tmp_path / "a", **args)
    assert info_c == info_a  # loaded from the cache, not retrained
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), c.state_dict().values()))


def test_tokenizer_roundtrip():
    tok = CharTokenizer()
    ids = tok.encode("3 7 9=36:<answer>(7-3)*9</answer>")
    assert tok.decode(ids[1:] + [tok.eos_id, 5]) == "3 7 9=36:<answer>(7-3)*9</answer>"
    with pytest.raises(ValueError, match="not in the tokenizer"):
        tok.encode("x")


# ---------------------------------------------------------------- config
@pytest.mark.parametrize("override,match", [
    ("objective.nme=pg", "unknown config key objective.nme: did you mean objective.name"),
    ("trian.steps=3", "unknown config key trian: did you mean train"),
    ("train.steps=0", "train.steps must be a positive integer"),
    ("train.steps=abc", "train.steps must be an integer"),
    ("optim.lr=-1", "optim.lr must be > 0"),
    ("objective.name=grpo2", "unknown objective preset 'grpo2'"),
    ("objective.params={top_k: 4}", "preset 'pg' has no parameter 'top_k'"),
    ("mismatch.view=w16", "mismatch.view: unknown mismatch view 'w16'"),
    ("mismatch.trainer_numerics=fwd-fq", "needs a quantized mismatch.view"),
    ("rollout.top_p=1.5", "rollout: top_p must be in"),
    ("model.execution=turbo", "model.execution must be"),
    ("objective.reward_mode=binary", "objective.reward_mode"),
    ("task.max_number=-3", "task.min_number"),
])
def test_bad_configs_name_the_key(override, match):
    """Types and ranges are refused by the schema, what the domain cannot build by build.check: both by name."""
    from driftless.train import build

    with pytest.raises(ValueError, match=match.replace("(", r"\(").replace("'", "'")):
        build.check(load_config(None, [override]))


def test_yaml_config_and_overrides(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("objective:\n  name: sc+tis\n  params:\n    top_k: 16\ntrain:\n  steps: 7\n")
    cfg = load_config(path, ["objective.params.cap=3.0", "optim.name=adamw", "optim.schedule=constant", "optim.lr=3e-4"])
    assert cfg.objective.name == "sc+tis" and cfg.objective.params == {"top_k": 16, "cap": 3.0}
    assert cfg.train.steps == 7 and cfg.optim.name == "adamw" and cfg.optim.lr == 3e-4
    with pytest.raises(ValueError, match="optim.lr must be a number, got 'fast'"):
        load_config(path, ["optim.lr=fast"])
    with pytest.raises(ValueError, match="does not exist"):
        load_config(tmp_path / "missing.yaml")


# ---------------------------------------------------------------- end to end
EXPECTED_KEYS = {"step", "version", "reward", "loss", "grad_norm", "entropy", "response_length",
                 "sampler_age_mean", "sampler_age_max", "sampler_refreshed", "skipped_steps", "collapsed",
                 "rollout_s", "score_s", "loss_s", "optim_s", "step_time", "tokens_per_s", "kl_k1", "kl_k3",
                 "ratio_mean", "ratio_max", "weight_mean", "truncated_fraction", "masked_fraction", "ratio_ess",
                 "logp_absdiff_max", "wall_time"}


@pytest.mark.parametrize("preset", ["pg", "tis", "sc", "sc+kl", "ppo+tis", "reinforce-zero", "gspo"])
def test_a_few_steps_log_every_metric(tmp_path, preset):
    params = ["objective.params={top_k: 8}"] if preset.startswith("sc") else []
    cfg = tiny_config(f"objective.name={preset}", "train.steps=3", "train.eval_every=3",
                      "mismatch.view=w8a8+kv:int8", "mismatch.staleness=1", *params)
    Run(cfg, tmp_path).run()
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2]
    for r in rows:
        assert EXPECTED_KEYS <= set(r), EXPECTED_KEYS - set(r)
    assert rows[1]["sampler_refreshed"] is False and rows[1]["sampler_age_max"] == 1  # staleness 1: measured age
    assert rows[2]["sampler_refreshed"] is True and rows[2]["sampler_age_max"] == 0
    assert "eval_reward" in rows[2] and rows[0]["kl_k3"] > 0
    if preset.startswith("sc"):
        assert "sampler_head_mass" in rows[0] and "centering_l1" in rows[0]
    write_run_report(tmp_path)  # the caller writes the report (train does not import experiments)
    for name in ("config.yaml", "report.md", "plots/training.png", "checkpoints/latest"):
        assert (tmp_path / name).exists(), name


def test_resume_equals_an_uninterrupted_run(tmp_path):
    extra = ["objective.name=sc+tis", "objective.params={top_k: 8}", "mismatch.view=noise:0.05",
             "mismatch.staleness=2", "train.eval_every=2", "train.checkpoint_every=2"]
    Run(tiny_config("train.steps=5", *extra), tmp_path / "a").run()
    Run(tiny_config("train.steps=2", *extra), tmp_path / "b").run()  # "crashes" after a checkpoint at 2
    with (tmp_path / "b" / "metrics.jsonl").open("a") as f:  # and left a line of a step it never saved
        f.write(json.dumps({"step": 2, "reward": 123.0}) + "\n")
    Run(tiny_config("train.steps=5", *extra), tmp_path / "b").run(resume=True)
    a = [json.loads(line) for line in (tmp_path / "a" / "metrics.jsonl").read_text().splitlines()]
    b = [json.loads(line) for line in (tmp_path / "b" / "metrics.jsonl").read_text().splitlines()]
    assert len(a) == len(b) == 5
    for ra, rb in zip(a, b):
        ra = {k: v for k, v in ra.items() if k not in TIMING_KEYS}
        rb = {k: v for k, v in rb.items() if k not in TIMING_KEYS}
        assert ra == rb


@pytest.mark.parametrize("damage", ["truncate", "flip"])
def test_a_damaged_checkpoint_is_named_and_the_newest_intact_one_resumes(tmp_path, damage, capsys):
    """A truncated or bit-flipped file in the newest checkpoint: resume, eval and the checkpoint loader
    name it and fall back to the newest intact checkpoint; the resumed run still ends with the
    uninterrupted run's lines."""
    from driftless.cli import main
    from driftless.train.checkpoint import DamagedCheckpoint, load_checkpoint

    extra = ["train.eval_every=2", "train.checkpoint_every=2"]
    Run(tiny_config("train.steps=6", *extra), tmp_path / "a").run()
    Run(tiny_config("train.steps=6", *extra), tmp_path / "b").run()
    damaged = tmp_path / "b" / "checkpoints" / "step_000006" / "model.safetensors"
    data = bytearray(damaged.read_bytes())
    if damage == "truncate":
        damaged.write_bytes(data[: len(data) // 2])
    else:
        data[len(data) // 2] ^= 0x01
        damaged.write_bytes(bytes(data))
    with pytest.raises(DamagedCheckpoint, match=r"step_000006: model.safetensors does not match its recorded SHA-256"):
        load_checkpoint(damaged.parent)
    with pytest.warns(UserWarning, match="skipping damaged checkpoint step_000006"):
        assert main(["eval", str(tmp_path / "b"), "--problems", "4"]) == 0
    assert json.loads(capsys.readouterr().out)["checkpoint"] == "step_000004"
    with pytest.warns(UserWarning, match="skipping damaged checkpoint step_000006: .*model.safetensors"):
        Run(tiny_config("train.steps=6", *extra), tmp_path / "b").run(resume=True)
    strip = lambda d: [{k: v for k, v in json.loads(x).items() if k not in TIMING_KEYS}
                       for x in (d / "metrics.jsonl").read_text().splitlines()]
    assert strip(tmp_path / "b") == strip(tmp_path / "a")
    for ckpt in (tmp_path / "b" / "checkpoints").glob("step_*"):  # every checkpoint damaged: refused by name
        (ckpt / "optim.pt").write_bytes(b"")
    with pytest.raises(ValueError, match="holds no intact checkpoint"), pytest.warns(UserWarning):
        Run(tiny_config("train.steps=6", *extra), tmp_path / "b").run(resume=True)


def test_a_fresh_run_refuses_to_clobber_a_saved_one(tmp_path):
    Run(tiny_config("train.steps=1"), tmp_path).run()
    with pytest.raises(ValueError, match="already holds a run"):
        Run(tiny_config("train.steps=1"), tmp_path).run()
    Run(tiny_config("train.steps=1"), tmp_path).run(overwrite=True)


def test_non_finite_loss_skips_the_step_and_keeps_the_weights(tmp_path):
    run = Run(tiny_config("train.steps=3"), tmp_path)
    before = {k: v.clone() for k, v in run.policy.state_dict().items()}
    real = run.learner.objective
    run.learner.objective = lambda view, batch, totals=None: (view.logp.sum() * float("nan"), {})  # NaN gradients
    m = run.step()
    assert m["skipped_steps"] == 1 and m["version"] == 0

    def raising(view, batch, totals=None):
        raise FloatingPointError("non-finite loss")
    run.learner.objective = raising
    m = run.step()
    assert m["skipped_steps"] == 2 and m["version"] == 0
    for k, v in run.policy.state_dict().items():
        assert torch.equal(v, before[k])
    run.learner.objective = real
    m = run.step()
    assert m["version"] == 1 and m["skipped_steps"] == 2


def test_transformers_policy_runs_a_few_steps(tmp_path):
    pytest.importorskip("transformers")
    cfg = tiny_config("model.kind=hf", "objective.name=sc", "objective.params={top_k: 8}", "train.steps=2",
                      "train.eval_every=2", "mismatch.view=noise:0.02")
    Run(cfg, tmp_path).run()
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 2 and rows[-1]["version"] == 2 and all(r["kl_k3"] > 0 for r in rows)


def test_aligned_run_with_matching_quantized_trainer_has_zero_same_version_mismatch(tmp_path):
    cfg = tiny_config("model.execution=aligned", "mismatch.view=w8a8+kv:int8", "mismatch.trainer_numerics=fwd-fq",
                      "objective.name=reinforce-zero", "train.steps=2", "train.eval_every=2")
    Run(cfg, tmp_path).run()
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert rows[0]["logp_absdiff_max"] == 0.0 and rows[0]["kl_k3"] == 0.0  # TII: only weight movement is left


def test_demo_and_eval_commands(tmp_path, capsys):
    from driftless.cli import main

    overrides = [*TINY, "train.steps=2", "train.eval_every=1", "mismatch.view=noise:0.05"]
    assert main(["demo", "--run-dir", str(tmp_path / "demo"), "--methods", "baseline", "pg", "sc", "--seeds", "2",
                 "--workers", "2", "--no-progress", *overrides]) == 0
    report = (tmp_path / "demo" / "report.md").read_text()
    assert "| pg |" in report and "| sc |" in report and (tmp_path / "demo" / "eval_reward.png").exists()
    assert "| baseline |" in report and "steps to threshold" in report
    base = read_metrics(tmp_path / "demo" / "baseline" / "seed0")
    assert all(r["kl_k3"] < 1e-9 for r in base)  # the baseline samples without the mismatch view
    assert has_record(tmp_path / "demo" / "sc" / "seed1")
    first, second = read_metrics(tmp_path / "demo" / "pg" / "seed0"), read_metrics(tmp_path / "demo" / "pg" / "seed1")
    assert first[0]["entropy"] != second[0]["entropy"]  # the seed changes prompts and samples
    capsys.readouterr()
    assert main(["eval", str(tmp_path / "demo" / "pg" / "seed0")]) == 0
    out = json.loads(capsys.readouterr().out)
    assert 0.0 <= out["eval_reward"] <= 1.0 and out["checkpoint"] == "step_000002"


def test_demo_reading_is_computed_from_its_runs():
    from driftless.recipes.demo import reading

    def runs(*triples):
        return [{"initial_eval": a, "final_eval": b, "mean_kl_k3": kl} for a, b, kl in triples]
    claims = reading({"baseline": runs((0.2, 0.6, 0.0), (0.3, 0.5, 0.0)),
                      "pg": runs((0.2, 0.1, 0.08), (0.3, 0.55, 0.02)),
                      "sc": runs((0.2, 0.4, 0.01), (0.3, 0.5, 0.03))})
    assert claims == [
        "the baseline (no mismatch) ends above its start in all 2 runs (margin mean +0.300, worst +0.200)",
        "pg ends below its start in 1 of 2 runs (margin mean -0.075, worst -0.250)",
        "pg ends below the baseline in 1 of 2 runs (margin mean +0.225, worst -0.050)",
        "sc ends below its start in none of the runs (margin mean -0.200, worst -0.200)",
        "sc ends below the baseline in 1 of 2 runs (margin mean +0.100, worst +0.000)",  # a tie is not below
        "sc ends above pg in 1 of 2 runs (margin mean +0.125, worst -0.050)",
        "sc's mean KL(q‖p) is below pg's in 1 of 2 runs (margin mean +3.00e-02, worst -1.00e-02)",
    ]
    with_auc = reading({"baseline": [{"initial_eval": 0.2, "final_eval": 0.6, "mean_kl_k3": 0.0, "auc": 0.5}] * 2,
                        "pg": [{"initial_eval": 0.2, "final_eval": 0.65, "mean_kl_k3": 0.1, "auc": 0.45},
                               {"initial_eval": 0.2, "final_eval": 0.3, "mean_kl_k3": 0.1, "auc": 0.3}]})
    assert with_auc[2] == "pg ends below the baseline in 1 of 2 runs (margin mean +0.125, worst -0.050)"
    assert with_auc[3] == ("pg's mean held-out reward over the run is below the baseline's in all 2 runs "
                           "(margin mean +0.125, worst +0.050)")
    one = reading({"baseline": runs((0.2, 0.6, 0.0)), "pg": runs((0.2, 0.1, 0.08))})
    assert one[0] == ("the baseline (no mismatch) ends above its start: yes (margin +0.400; one run: "
                      "docs/calibration.md has the multi-seed checks)")
    assert one[2].startswith("pg ends below the baseline: yes (margin +0.500")


@pytest.mark.slow  # make test-slow
def test_demo_check_over_warm_starts_resumes_and_reads(tmp_path, capsys):
    """The demo's check: methods × warm starts × seeds; a second call trains nothing new."""
    from driftless.cli import main

    overrides = [o for o in TINY if o != "model.warm_start=false"] + [
        "warm_start.steps=2", "warm_start.batch_size=4", "warm_start.eval_problems=8",
        f"warm_start.cache_dir={tmp_path / 'ws'}", "train.steps=2", "train.eval_every=1", "mismatch.view=noise:0.05"]
    args = ["demo", "--warm-start-seeds", "2", "--run-dir", str(tmp_path / "check"), "--methods", "baseline", "pg",
            "sc", "--seeds", "1", "--workers", "2", "--no-progress", *overrides]
    assert main(args) == 0
    report = (tmp_path / "check" / "report.md").read_text()
    assert len(list((tmp_path / "ws").iterdir())) == 2  # one warm start per seed
    assert "| warm start | seed | initial | baseline | pg | sc |" in report
    assert "| 0 | 0 |" in report and "| 1 | 0 |" in report
    assert "- sc ends above pg in" in report and "- the baseline (no mismatch) ends above its start" in report
    metrics = sorted((tmp_path / "check").rglob("metrics.jsonl.xz"))  # finished: packed
    assert len(metrics) == 6 and has_record(tmp_path / "check" / "ws1" / "sc" / "seed0")
    stamps = [m.stat().st_mtime_ns for m in metrics]
    capsys.readouterr()
    assert main(args) == 0  # resumed: every run is finished, nothing retrained
    assert [m.stat().st_mtime_ns for m in metrics] == stamps
    assert capsys.readouterr().out.strip() == report.strip()  # the same report, from the same runs


def test_resume_after_sigkill_reproduces_the_uninterrupted_run(tmp_path):
    """A real crash: SIGKILL a training process mid-run, resume it, compare with an uninterrupted run."""
    import os
    import signal
    import subprocess
    import sys
    import time

    args = [*TINY, "train.steps=8", "train.checkpoint_every=1", "train.eval_every=4", "mismatch.view=noise:0.05",
            "objective.name=tis"]
    Run(tiny_config(*args[len(TINY):]), tmp_path / "a").run()
    cmd = [sys.executable, "-m", "driftless", "train", "-", *args, "--run-dir", str(tmp_path / "b"), "--no-progress"]
    cmd[cmd.index("-")] = str(tmp_path / "none.yaml")
    (tmp_path / "none.yaml").write_text("{}\n")
    import torch

    # the same thread count as this process (an earlier test may have changed it): the same bits in fast mode
    proc = subprocess.Popen(cmd, env={**os.environ, "OMP_NUM_THREADS": str(torch.get_num_threads())})
    metrics = tmp_path / "b" / "metrics.jsonl"
    deadline = time.time() + 120
    while time.time() < deadline and (not metrics.exists() or len(metrics.read_text().splitlines()) < 3):
        time.sleep(0.05)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    done = len(metrics.read_text().splitlines())
    assert 3 <= done < 8, done  # killed mid-run
    Run(tiny_config(*args[len(TINY):]), tmp_path / "b").run(resume=True)
    a = [json.loads(line) for line in (tmp_path / "a" / "metrics.jsonl").read_text().splitlines()]
    b = [json.loads(line) for line in metrics.read_text().splitlines()]
    strip = lambda rows: [{k: v for k, v in r.items() if k not in TIMING_KEYS} for r in rows]
    assert strip(a) == strip(b)


def test_the_vllm_engine_without_vllm_installed_is_a_clear_error(capsys):
    import importlib.util

    from driftless.cli import main

    if importlib.util.find_spec("vllm") is not None:
        pytest.skip("vLLM is installed here: tests/test_vllm.py covers the engine")
    assert main(["check-alignment", "--modes", "vllm", "--prompts", "1"]) == 2
    err = capsys.readouterr().err
    assert "the vLLM engine needs vLLM" in err and "make test-vllm" in err


SHIPPED = sorted((Path(__file__).resolve().parents[1] / "configs").glob("*.yaml"))


@pytest.mark.parametrize("path", SHIPPED, ids=[p.stem for p in SHIPPED])
def test_every_shipped_config_runs_one_step(tmp_path, path):
    """Each shipped config, shrunk to one small step (no warm start), trains: one line at version 1,
    and the run directory's config is the shipped one apart from the shrinking."""
    import importlib.util

    shrink = ["model.warm_start=false", "train.steps=1", "train.eval_problems=4", "rollout.prompts_per_step=2",
              "rollout.group_size=2", "rollout.max_new_tokens=4", "train.checkpoint_every=1", "train.progress=false",
              f"train.run_dir={tmp_path}"]
    config = load_config(path, shrink)
    if config.rollout.engine == "vllm" and importlib.util.find_spec("vllm") is None:
        pytest.skip("vLLM is not installed here (make test-vllm runs this config)")
    if config.model.hf_path:  # the checkpoint and data `make hf` builds, made small here in their real format
        from driftless.recipes.make_model import make_model
        from driftless.tasks.export import task_rows, write_jsonl

        task = Countdown(CountdownConfig(2, 1, 12, 100))
        train_rows, held = task_rows(task, "train", draws=500), task_rows(task, "eval", draws=2000)
        write_jsonl(train_rows, tmp_path / "data/train.jsonl")
        write_jsonl(held, tmp_path / "data/eval.jsonl")
        make_model(tmp_path / "model", rows_train=train_rows, rows_eval=held, vocab_size=300, hidden=32, layers=1,
                   heads=2, kv_heads=1, intermediate=64, max_positions=config.model.max_seq_len, sft_steps=2,
                   progress=False)
        shrink += [f"model.hf_path={tmp_path / 'model'}", f"task.path={tmp_path / 'data/train.jsonl'}",
                   f"task.eval_path={tmp_path / 'data/eval.jsonl'}"]
        config = load_config(path, shrink)
    d = train(config)
    lines = [json.loads(x) for x in (d / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines] == [0] and lines[0]["version"] == 1
    assert load_config(d / "config.yaml") == config


def test_the_dataclass_defaults_are_the_learning_reference():
    """configs/default.yaml writes out the defaults: loading it changes nothing."""
    assert load_config(SHIPPED[[p.stem for p in SHIPPED].index("default")]) == load_config(None)


def test_the_schemas_choices_are_the_domains():
    """config.py names its choices without importing the domain; they must be the domain's own."""
    import typing

    from driftless.objectives import ESTIMATORS, REWARD_MODES
    from driftless.ops.numerics import TRAINER_NUMERICS
    from driftless.rollout.sampler import REFRESH_POLICIES
    from driftless.rollout.worker import ENGINES
    from driftless.train import config as c
    from driftless.train.learner import PRECISIONS
    from driftless.train.sinks import LOGGERS
    from driftless.train.sources import SOURCES

    pairs = [(c.RewardMode, REWARD_MODES), (c.Estimator, ESTIMATORS), (c.TrainerNumerics, TRAINER_NUMERICS),
             (c.RefreshPolicy, REFRESH_POLICIES), (c.Engine, ENGINES), (c.LoggerName, LOGGERS),
             (c.Runtime, tuple(SOURCES)), (typing.get_type_hints(c.TrainSection)["precision"], PRECISIONS)]
    for literal, domain in pairs:
        assert typing.get_args(literal) == tuple(domain)
    import subprocess
    import sys

    probe = "import sys, driftless.train.config; print(sorted(m for m in ('torch', 'driftless.objectives', " \
            "'driftless.tasks', 'driftless.mismatch') if m in sys.modules))"
    assert subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout.strip() == "[]"


def test_held_out_evaluation_greedy_or_sampled(tmp_path):
    """train.eval_samples=0 is the greedy answer per problem; N > 0 the mean over N samples a problem under the
    rollout's sampling transform (the policy's expected reward). Repeating greedy answers leaves the mean."""
    from driftless.rollout import SamplingParams
    from driftless.train.evaluate import evaluate

    run = Run(tiny_config("task.name=first-token", "train.eval_problems=16", "train.eval_samples=4"), tmp_path)
    problems = run.eval_problems
    greedy = evaluate(run.policy, run.task, run.text, problems, max_new_tokens=4)["eval_reward"]
    assert evaluate(run.policy, run.task, run.text, problems, max_new_tokens=4, repeats=3)["eval_reward"] == greedy
    sampled = evaluate(run.policy, run.task, run.text, problems, max_new_tokens=4, params=SamplingParams(),
                       repeats=4)["eval_reward"]
    assert 0 < sampled != greedy and (sampled * 64) == round(sampled * 64)  # 64 answers: 16 problems x 4
    assert run._evaluate() == sampled  # the run's own evaluation is the sampled one (temperature 1)


def test_a_sync_run_without_a_view_samples_from_the_trainers_own_tensors_and_resumes_as_before(tmp_path):
    """No lag, no staleness, no mismatch view: the sampler adopts the learner's tensors (one copy of the weights in
    memory, Snapshot.sharing) and the lines, a resume included, are those of a sampler holding copies."""
    config = tiny_config("train.steps=4", "train.eval_every=2", "train.checkpoint_every=2")
    shared = Run(config, tmp_path / "shared")
    shared.run()
    learner = dict(shared.learner.policy.named_parameters())
    sampler = dict(shared.source.worker.sampler.policy.named_parameters())
    assert shared.source.adopt and learner.keys() == sampler.keys()
    assert all(sampler[k].data_ptr() == v.data_ptr() for k, v in learner.items())
    assert shared.source.sampler_snapshot().version == shared.learner.version == 4  # what a checkpoint labels them
    copies = Run(config, tmp_path / "copies")
    copies.source.adopt = False  # the sampler keeps copies, as with a view or a lag
    copies.run()
    assert not any(p.data_ptr() == learner[k].data_ptr()
                   for k, p in copies.source.worker.sampler.policy.named_parameters())
    resumed = tmp_path / "resumed"
    Run(tiny_config("train.steps=2", "train.eval_every=2", "train.checkpoint_every=2"), resumed).run()
    Run(config, resumed).run(resume=True)  # the checkpoint's sampler weights are loaded as copies, then adopted again

    def lines(d):
        return [{k: v for k, v in json.loads(x).items() if k not in TIMING_KEYS}
                for x in (tmp_path / d / "metrics.jsonl").read_text().splitlines()]
    assert lines("shared") == lines("copies") == lines("resumed")
    viewed = Run(tiny_config("train.steps=1", "mismatch.view=noise:0.05"), tmp_path / "viewed")
    assert not viewed.source.adopt


def test_ignore_eos_runs_every_response_to_max_new_tokens(tmp_path):
    stops = Run(tiny_config("train.steps=2", "rollout.max_new_tokens=8"), tmp_path / "stops")
    stops.run()
    assert min(r["response_length"] for r in read_metrics(tmp_path / "stops")) < 8  # end ids do stop responses
    full = Run(tiny_config("train.steps=2", "rollout.max_new_tokens=8", "rollout.ignore_eos=true"), tmp_path / "full")
    full.source.worker.load(full.learner.publish())
    batch, _ = full.source.worker.produce(0)
    assert ((batch.length - batch.prompt_len) == 8).all()
    full.run()
    assert [r["response_length"] for r in read_metrics(tmp_path / "full")] == [8.0, 8.0]
