"""Sweeps on Ray Tune (driftless sweep) and the report across runs (driftless report)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from driftless.cli import main
from driftless.recipes.sweep import load_experiment
from driftless.recipes.sweep_report import collapse_step, write_sweep_report
from driftless.train.loop import TIMING_KEYS
from driftless.train.sinks import read_metrics, record_path

SMALL = {"model.warm_start": False, "model.d_model": 32, "model.n_layer": 1, "model.n_head": 2,
         "model.n_kv_head": 1, "model.d_ff": 64, "model.max_seq_len": 16, "task.name": "first-token",
         "rollout.prompts_per_step": 4, "rollout.group_size": 4, "rollout.max_new_tokens": 2, "rollout.head_k": 4,
         "train.eval_every": 2, "train.eval_problems": 16, "train.checkpoint_every": 2, "optim.name": "adamw", "optim.schedule": "constant",
         "optim.lr": 1.0e-2, "train.steps": 6, "train.progress": False}


def experiment(tmp_path, grid, **extra) -> Path:
    path = tmp_path / "exp.yaml"
    path.write_text(yaml.safe_dump({"set": SMALL, "grid": grid, **extra}))
    return path


def lines(run_dir):
    return [{k: v for k, v in row.items() if k not in TIMING_KEYS} for row in read_metrics(run_dir)]


def test_bad_experiments_are_refused_by_name_before_any_trial(tmp_path):
    with pytest.raises(ValueError, match=r"unknown config key objective.nmae: did you mean objective.name\?"):
        load_experiment(experiment(tmp_path, {"objective.nmae": ["pg"]}))
    with pytest.raises(ValueError, match="trial 'objective.name=nope'.*unknown objective preset 'nope'"):
        load_experiment(experiment(tmp_path, {"objective.name": ["pg", "nope"]}))
    with pytest.raises(ValueError, match="the experiment has no grid"):
        load_experiment(experiment(tmp_path, {}))
    with pytest.raises(ValueError, match="grid.train.seed must be a non-empty list"):
        load_experiment(experiment(tmp_path, {"train.seed": 3}))
    assert main(["sweep", str(experiment(tmp_path, {"train.sed": [0]})), "--run-dir", str(tmp_path / "out")]) == 2
    assert not (tmp_path / "out").exists()  # refused before anything was written
    (tmp_path / "notruns" / "a").mkdir(parents=True)
    with pytest.raises(ValueError, match="holds no runs.*found: a"):
        write_sweep_report(tmp_path / "notruns")


def test_collapse_step_is_the_first_evaluation_below_the_line_never_recovered():
    xs = [0, 10, 20, 30, 40]
    assert collapse_step(xs, [0.5, 0.3, 0.6, 0.2, 0.1]) == 30  # 10 recovered at 20
    assert collapse_step(xs, [0.5, 0.46, 0.4, 0.3, 0.2]) == 20  # 0.46 is within the margin
    assert collapse_step(xs, [0.5, 0.3, 0.2, 0.1, 0.45]) is None  # recovered to within the margin


@pytest.mark.slow  # make test-slow
def test_a_killed_sweep_resumes_where_it_stopped_and_matches_an_uninterrupted_one(tmp_path):
    exp = experiment(tmp_path, {"objective.name": ["pg", "sc"]},
                     variants={"noisy": {"mismatch.view": "noise:0.05"}, "stale": {"rollout.lag": 1}})
    assert main(["sweep", str(exp), "--run-dir", str(tmp_path / "a"), "--no-progress"]) == 0
    trials = json.loads((tmp_path / "a" / "sweep.json").read_text())["trials"]
    assert sorted(trials) == ["noisy,objective.name=pg", "noisy,objective.name=sc", "stale,objective.name=pg",
                              "stale,objective.name=sc"]

    # the same sweep, one trial at a time, its driver SIGKILLed once a trial is done and another is midway
    cmd = [sys.executable, "-m", "driftless", "sweep", str(exp), "--run-dir", str(tmp_path / "b"), "--no-progress",
           "--max-concurrent", "1"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.time() + 300
    b = tmp_path / "b"
    while time.time() < deadline:
        done = list(b.glob("*/done.json"))
        midway = [p.parent.parent for p in b.glob("*/checkpoints/latest") if not (p.parent.parent / "done.json").exists()]
        if done and midway:
            break
        time.sleep(0.05)
    else:
        proc.kill()
        pytest.fail("the sweep never had a finished and a midway trial at once")
    os.killpg(proc.pid, signal.SIGKILL)  # the driver and everything it started
    proc.wait()
    time.sleep(1)
    finished = {p.parent.name for p in b.glob("*/done.json")}
    assert main(["sweep", str(exp), "--run-dir", str(b), "--no-progress"]) == 0
    for name in trials:
        assert lines(b / name) == lines(tmp_path / "a" / name), name  # as if never interrupted
        attempts = [json.loads(x) for x in (b / name / "attempts.jsonl").read_text().splitlines()]
        if name in finished:  # not re-run
            assert attempts[-1]["done_before"] is True
        elif len(attempts) > 1:  # started before the kill: continued from its checkpoint
            assert attempts[-1]["resumed_from"] is not None
    assert any(len((b / n / "attempts.jsonl").read_text().splitlines()) > 1 and n not in finished for n in trials)

    report = (b / "report.md").read_text()
    assert "4 runs in 4 groups by variant, objective.name" in report
    for row in ("| noisy, pg | 1 |", "| stale, sc | 1 |"):
        assert row in report
    assert (b / "plots" / "eq1.png").exists() and (b / "plots" / "eval_reward.png").exists()
    assert "![eval_reward_panels](plots/eval_reward_panels.png)" in report  # two grouping keys: a panel per value
    (b / "plots" / "eval_reward_panels.png").unlink()
    by_variant = write_sweep_report(b, by=["variant"]).read_text()
    assert "panels" not in by_variant and not (b / "plots" / "eval_reward_panels.png").exists()
    assert "| noisy | 2 |" in by_variant and "| stale | 2 |" in by_variant


def test_a_failing_trial_is_named_and_the_others_finish(tmp_path, capsys):
    exp = experiment(tmp_path, {"objective.name": ["pg", "sc"]})
    out = tmp_path / "out"
    out.mkdir()
    (out / "objective.name=sc").write_text("a file where the trial's run directory goes")  # that trial crashes
    assert main(["sweep", str(exp), "--run-dir", str(out), "--no-progress"]) == 1
    captured = capsys.readouterr()
    assert "driftless: trial objective.name=sc failed: FileExistsError" in captured.err
    assert (out / "objective.name=pg" / "done.json").exists()
    assert "- objective.name=sc: no metrics.jsonl" in captured.out  # the report says which is missing


def test_reuse_gives_every_twin_the_record_and_drops_a_killed_trials_partial_lines(tmp_path):
    from driftless.recipes.sweep import reuse_finished
    from driftless.train.config import dump_config, load_config

    def config(seed):
        return load_config(None, [f"{k}={v}" for k, v in {**SMALL, "train.seed": seed}.items()])

    source = tmp_path / "old" / "run"
    source.mkdir(parents=True)
    (source / "config.yaml").write_text(dump_config(config(0)))
    (source / "metrics.jsonl").write_text('{"step": 0, "reward": 0.5}\n{"step": 1, "reward": 0.75}\n')
    (source / "initial_eval.json").write_text("{}")
    (source / "done.json").write_text("{}")
    killed, twin, other = (tmp_path / "new" / n for n in ("killed", "twin", "other"))
    (killed / "checkpoints" / "step_000001").mkdir(parents=True)
    (killed / "metrics.jsonl").write_text('{"step": 0, "reward": 0.1}\n')
    copied = reuse_finished({killed: config(0), twin: config(0), other: config(1)}, [tmp_path / "old"])
    assert copied == {killed: source, twin: source}  # both trials of that computation; not the other seed
    for target in (killed, twin):
        assert read_metrics(target) == [{"step": 0, "reward": 0.5}, {"step": 1, "reward": 0.75}]
        assert (target / "done.json").exists() and not (target / "checkpoints").exists()
    assert not other.exists()
    assert reuse_finished({other: config(1)}, [tmp_path / "old"]) == {}


def test_reuse_takes_only_a_run_that_started_from_the_weights_this_machine_would_start_from(tmp_path):
    """A fast-mode warm start's bits follow the CPU's kernels: the same computation recorded on another machine
    started from other weights, and pairing it with runs trained here would compare two starting points."""
    from driftless.recipes.sweep import recorded_start, reuse_finished, start_digests
    from driftless.train.config import dump_config, load_config

    cfg = load_config(None, [f"{k}={v}" for k, v in SMALL.items()])
    here = start_digests()(cfg)  # this machine's starting weights (a seeded random init here)
    assert here == start_digests()(cfg) and len(here) == 16

    def finished(name, initial):
        run = tmp_path / "old" / name
        run.mkdir(parents=True)
        (run / "config.yaml").write_text(dump_config(cfg))
        (run / "metrics.jsonl").write_text('{"step": 0, "reward": 0.5}\n')
        (run / "initial_eval.json").write_text(json.dumps(initial))
        (run / "done.json").write_text("{}")
        return run
    elsewhere = finished("a-elsewhere", {"eval_reward": 0.3, "start_weights_sha256": "0" * 16})
    older = finished("b-older", {"eval_reward": 0.3, "warm_start": None})  # a record without a digest: can't tell
    assert recorded_start(elsewhere) == "0" * 16 and recorded_start(older) is None
    target = tmp_path / "new" / "run"
    assert reuse_finished({target: cfg}, [tmp_path / "old"], start=start_digests()) == {}
    assert reuse_finished({target: cfg}, [tmp_path / "old"]) == {target: elsewhere}  # without the check: taken
    target2 = tmp_path / "new" / "run2"
    same = finished("c-same", {"eval_reward": 0.3, "warm_start": {"weights_sha256": here}})  # an older record's place
    assert reuse_finished({target2: cfg}, [tmp_path / "old"], start=start_digests()) == {target2: same}


@pytest.mark.slow  # make test-slow: two sweeps (~50 s)
def test_a_sweep_reuses_the_finished_runs_of_another_folder_with_the_same_computation(tmp_path, capsys):
    first = experiment(tmp_path, {"train.seed": [0]}, reference={"mismatch.view": "none"}, variants={"noisy": {"mismatch.view": "noise:0.05"}})
    a = tmp_path / "a"
    assert main(["sweep", str(first), "--run-dir", str(a), "--no-progress"]) == 0
    second = tmp_path / "second.yaml"
    second.write_text(yaml.safe_dump({"set": SMALL, "grid": {"train.seed": [0]}, "reference": {"mismatch.view": "none"},
                                      "variants": {"pg": {"objective.name": "pg"}, "sc": {"objective.name": "sc"}}}))
    b = tmp_path / "b"
    capsys.readouterr()
    assert main(["sweep", str(second), "--run-dir", str(b), "--reuse", str(a), "--no-progress"]) == 0
    # pg without a mismatch is the reference's computation: both of b's trials take a's reference
    assert f"2 trial(s) took the record of a finished run under {a}" in capsys.readouterr().out
    ref_a = a / "reference,train.seed=0"
    for twin in (b / "reference,train.seed=0", b / "pg,train.seed=0"):
        assert read_metrics(twin) == read_metrics(ref_a)  # wall times too: copied, not trained again
        assert not (twin / "checkpoints").exists()
    assert (b / "sc,train.seed=0" / "checkpoints").exists()  # trained here
    assert main(["sweep", str(second), "--run-dir", str(b), "--reuse", str(tmp_path / "nowhere")]) == 2
    assert f"sweep --reuse: {tmp_path / 'nowhere'} is not a directory" in capsys.readouterr().err


def final(run_dir):
    return [x for x in lines(run_dir) if "eval_reward" in x][-1]["eval_reward"]


def test_a_reference_is_crossed_with_the_seeds_only(tmp_path):
    exp = load_experiment(experiment(tmp_path, {"mismatch.view": ["noise:0.1", "noise:0.2"], "train.seed": [0, 1]},
                                     variants={"pg": {"objective.name": "pg"}, "sc": {"objective.name": "sc"}},
                                     reference={"mismatch.view": "none"}))
    trials = {t.name: t for t in exp.trials()}
    assert len(trials) == 2 * 2 * 2 + 2
    assert list(trials) == [  # seed by seed: an interrupted sweep leaves whole paired seeds
        "reference,train.seed=0", "pg,mismatch.view=noise:0.1,train.seed=0", "pg,mismatch.view=noise:0.2,train.seed=0",
        "sc,mismatch.view=noise:0.1,train.seed=0", "sc,mismatch.view=noise:0.2,train.seed=0",
        "reference,train.seed=1", "pg,mismatch.view=noise:0.1,train.seed=1", "pg,mismatch.view=noise:0.2,train.seed=1",
        "sc,mismatch.view=noise:0.1,train.seed=1", "sc,mismatch.view=noise:0.2,train.seed=1"]
    ref = trials["reference,train.seed=1"]
    assert ref.values == {"variant": "reference", "train.seed": 1}
    assert exp.config(ref).mismatch.view == "none" and exp.config(ref).train.seed == 1
    assert exp.config(trials["sc,mismatch.view=noise:0.2,train.seed=0"]).mismatch.view == "noise:0.2"
    with pytest.raises(ValueError, match="may not be named 'reference'"):
        load_experiment(experiment(tmp_path, {"train.seed": [0]}, variants={"reference": {}}, reference={}))


def test_every_study_experiment_loads():
    from driftless.recipes.study import CLAIMS, QUICK, STUDY_DIR

    names = {p.stem for p in STUDY_DIR.glob("*.yaml")}
    assert names == {c.name for c in (*CLAIMS, QUICK)}
    for claim in (*CLAIMS, QUICK):
        if claim.stand_in or claim.real:  # its checkpoint is built first: test_make_model / test_real ask the same
            continue
        exp = load_experiment(STUDY_DIR / f"{claim.name}.yaml")
        seeds = exp.grid.get("train.seed", [])
        assert claim.name in ("async", "quick") or len(seeds) >= 3, claim.name  # every claim over 3+ seeds
        assert exp.reference is not None, claim.name  # every method beside the no-mismatch reference
        assert set(claim.by) <= {"variant", *exp.grid}, claim.name  # the report groups by keys it has


@pytest.mark.slow  # make test-slow
def test_the_study_reuses_identical_finished_runs_and_continues_where_it_stopped(tmp_path, monkeypatch):
    from driftless.recipes import study

    exps = tmp_path / "exps"
    exps.mkdir()
    common = {"set": SMALL, "reference": {"mismatch.view": "none"}, "grid": {"train.seed": [0]}}
    (exps / "first.yaml").write_text(yaml.safe_dump({**common, "variants": {"noisy": {"mismatch.view": "noise:0.05"}}}))
    (exps / "second.yaml").write_text(yaml.safe_dump({**common, "variants": {"stale": {"rollout.lag": 1}}}))
    monkeypatch.setattr(study, "STUDY_DIR", exps)
    (exps / "extra.yaml").write_text(yaml.safe_dump({**common, "variants": {"pg": {}}}))
    monkeypatch.setattr(study, "CLAIMS", (study.Claim("first", ("variant",), "a"),
                                          study.Claim("second", ("variant",), "b"),
                                          study.Claim("extra", ("variant",), "c", extra=True)))
    root = tmp_path / "results"
    index = study.run_study(root, progress=False, workers=1)
    log = json.loads((root / "study.json").read_text())
    assert {k: (v["trials"], v["reused"]) for k, v in log.items()} == {"first": (2, 0), "second": (2, 1)}
    assert not (root / "extra").exists()  # an extra experiment runs only when named
    spent = study.run_seconds(root)
    assert [spent[k]["distinct"] for k in ("first", "second", "extra")] == [2, 1, 0]  # the reused reference once
    stale_rows = read_metrics(root / "second" / "stale,train.seed=0")
    assert spent["second"]["run_s"] == round(stale_rows[-1]["wall_time"], 1)
    ref_a, ref_b = root / "first" / "reference,train.seed=0", root / "second" / "reference,train.seed=0"
    assert record_path(ref_b).name == "metrics.jsonl.xz"  # a finished trial's record is packed
    assert record_path(ref_a).read_bytes() == record_path(ref_b).read_bytes()
    assert not (ref_b / "checkpoints").exists()  # the record only: config, metrics, initial eval, done
    report = (root / "second" / "report.md").read_text()
    assert "| reference | 1 |" in report
    assert "| stale | — | — (one pair) | — | — |" in report  # one seed: no interval, said so
    stale = next(line for line in report.splitlines() if line.startswith("| stale | 1 |"))
    delta = final(root / "second" / "stale,train.seed=0") - final(ref_b)  # paired with the same seed's reference
    assert f"| {delta:+.3f} ({int(delta < 0)} of 1 below) |" in stale
    assert "[first](first/report.md)" in index.read_text()

    # what a fresh clone holds (the committed records, no checkpoints): nothing is trained again
    for ckpt in root.glob("*/*/checkpoints"):
        shutil.rmtree(ckpt)
    study.run_study(root, progress=False, workers=1)
    for attempts in root.glob("*/*/attempts.jsonl"):
        assert json.loads(attempts.read_text().splitlines()[-1])["done_before"] is True

    # a run that started from another initial model (a warm start recomputed on another CPU) is marked, not hidden
    stale_start = root / "second" / "stale,train.seed=0" / "initial_eval.json"
    record = json.loads(stale_start.read_text())
    elsewhere = {"eval_reward": record["eval_reward"] + 0.25, "start_weights_sha256": "f" * 16}
    stale_start.write_text(json.dumps({**record, **elsewhere}))
    report = write_sweep_report(root / "second", by=["variant"]).read_text()
    assert f"| {delta:+.3f} ({int(delta < 0)} of 1 below) † 1 |" in report
    assert "† 1 runs started from another initial model than the `reference` run of their seeds" in report
    ref_start = json.loads((ref_b / "initial_eval.json").read_text())["eval_reward"]
    assert f"- stale,train.seed=0: {record['eval_reward'] + 0.25:.3f} / {ref_start:.3f}" in report
    # a reference of the same seeds from that other initial model (another sweep) takes the pairing
    other = tmp_path / "other"
    shutil.copytree(root / "second", other, ignore=shutil.ignore_patterns("stale*", ".tune", "plots"))
    moved = other / "reference,train.seed=0" / "initial_eval.json"
    moved.write_text(json.dumps({**json.loads(moved.read_text()), **elsewhere}))
    report = write_sweep_report(root / "second", by=["variant"], references=[other]).read_text()
    assert "†" not in report and f"| {delta:+.3f} ({int(delta < 0)} of 1 below) |" in report  # same final: same Δ
    assert f"paired with the reference run of their seeds and initial model from `{other}`: stale,train.seed=0." in report
    with pytest.raises(ValueError, match="holds no runs"):
        write_sweep_report(root / "second", by=["variant"], references=[exps])
    stale_start.write_text(json.dumps(record))
    assert "†" not in write_sweep_report(root / "second", by=["variant"]).read_text()

    (root / "first" / "noisy,train.seed=0" / "done.json").unlink()  # as if killed midway: out of the table, named
    report = write_sweep_report(root / "first", by=["variant"]).read_text()
    assert "- noisy,train.seed=0: unfinished (6 steps so far)" in report and "| noisy |" not in report


def test_a_finished_trial_can_drop_its_checkpoints_and_keep_its_record(tmp_path):
    """The study trains ~250 runs: lagged runs keep past weights in their checkpoints (GBs per experiment)."""
    from driftless.recipes.sweep import RUN_RECORD, run_trial

    overrides = [f"{k}={v}" for k, v in {**SMALL, "train.trace": True}.items()]
    kept, pruned = tmp_path / "kept", tmp_path / "pruned"
    first = run_trial(None, overrides, kept)
    assert (kept / "checkpoints").is_dir() and (kept / "trace").is_dir()
    second = run_trial(None, overrides, pruned, keep_checkpoints=False)
    assert not (pruned / "checkpoints").exists() and not (pruned / "trace").exists()
    assert all(record_path(pruned, f) is not None for f in RUN_RECORD)  # metrics.jsonl packed: .xz
    assert lines(pruned) == lines(kept) and second["final_eval"] == first["final_eval"]
    assert run_trial(None, overrides, pruned, keep_checkpoints=False) == second  # finished: not trained again


def test_paired_intervals_are_student_t_over_the_seeds_and_say_when_they_exclude_zero():
    from driftless.recipes.sweep_report import paired_interval, separation

    mean, low, high = paired_interval([0.1, 0.2, 0.3])
    half = 4.302652729749462 * 0.1 / 3 ** 0.5  # t(0.975, 2 degrees of freedom) × sd / sqrt(n)
    assert mean == pytest.approx(0.2) and low == pytest.approx(0.2 - half) and high == pytest.approx(0.2 + half)
    assert separation((mean, low, high)) == "no"  # 3 seeds this far apart: the interval holds zero
    assert separation(paired_interval([0.20, 0.21, 0.19, 0.20, 0.22])) == "above"
    assert separation(paired_interval([-0.20, -0.21, -0.19])) == "below"
    assert paired_interval([0.3]) is None and separation(None) == "— (one pair)"


def test_early_late_means_the_first_and_last_fifth_of_the_steps():
    import math

    from driftless.recipes.sweep_report import early_late

    rows = [{"kl_k3": float(i)} for i in range(10)] + [{"other": 1.0}]
    assert early_late(rows, "kl_k3") == (0.5, 8.5)  # steps 0-1 and 8-9
    assert early_late(rows[:3], "kl_k3") == (0.0, 2.0)  # at least one step each
    assert all(math.isnan(x) for x in early_late(rows, "missing"))  # no such metric


def test_the_drift_table_gives_each_groups_growth_and_each_runs_own():
    from driftless.recipes.sweep_report import _drift_table

    def run(seed, kls):
        return {"seeds": (seed, None), "rows": [{"kl_k3": k, "eq1_movement_abs": 0.5 * k, "eq1_disagreement_abs": 1.0,
                                                 "ratio_p99": 2.0} for k in kls]}
    groups = {"reference": [run(0, [0.0] * 5)], "pg": [run(1, [1, 1, 1, 1, 8]), run(0, [1, 1, 1, 1, 2])]}
    table = _drift_table(groups, "reference")
    assert table[-1] == ("| pg | 1.00e+00 → 5.00e+00 (×5.00) | 5.00e-01 → 2.50e+00 (×5.00) | 1.00e+00 → 1.00e+00 (×1.00) "
                         "| 2 → 2 (×1.00) | ×2.00, ×8.00 |")
    assert len(table) == 6  # the reference has no mismatch to follow


def test_the_seed_table_lists_each_groups_final_reward_by_seed():
    from driftless.recipes.sweep_report import _seed_table

    def run(seed, final, initial=0.3):
        return {"seeds": (seed, None), "final": final, "best": final + 0.1, "initial": initial}
    groups = {"reference": [run(0, 0.5), run(1, 0.45)], "pg": [run(1, 0.0)]}
    assert _seed_table(groups)[3:] == ["| group | seed 0 | seed 1 |", "|---|---|---|",
                                       "| reference | 0.500 | 0.450 |", "| pg | — | 0.000 |"]
    assert "every run starts at 0.300" in _seed_table(groups)[1]
    assert _seed_table(groups, "best")[1].startswith("Best held-out reward")
    assert _seed_table(groups, "best")[5:] == ["| reference | 0.600 | 0.550 |", "| pg | — | 0.100 |"]
    groups["pg"] = [run(1, 0.0, initial=0.2)]  # another start: each cell says where its run began
    assert _seed_table(groups)[-1] == "| pg | — | 0.000 (from 0.200) |"
    assert _seed_table({"pg": [run(0, 0.1), run(0, 0.2)]}) == []  # pooled runs of one seed: no per-seed reading


def fake_sweep(root, finals: dict[str, list[float]], start=0.3, kl: dict[str, float] | None = None):
    """A sweep's records without training: per variant, one run a seed whose held-out reward goes start → final
    (and, for the variants in ``kl``, whose every step logs that KL(q‖p))."""
    trials = {}
    for variant, values in finals.items():
        for seed, final in enumerate(values):
            name = f"{variant},train.seed={seed}"
            trials[name] = {"values": {"variant": variant, "train.seed": seed}}
            run = root / name
            run.mkdir(parents=True)
            (run / "initial_eval.json").write_text(json.dumps({"eval_reward": start}))
            logged = {"kl_k3": kl[variant]} if kl and variant in kl else {}
            (run / "metrics.jsonl").write_text("".join(json.dumps({"step": i, "eval_reward": y, **logged}) + "\n"
                                                       for i, y in enumerate([start, (start + final) / 2, final])))
            (run / "done.json").write_text("{}")
    (root / "sweep.json").write_text(json.dumps({"reference": {}, "variants": {}, "grid": {"train.seed": [0, 1, 2]},
                                                 "trials": trials}))
    return root


def test_compare_puts_two_sweeps_verdicts_side_by_side_and_says_where_they_differ(tmp_path, capsys):
    from driftless.cli import main
    from driftless.recipes.sweep_report import compare_sweeps

    a = fake_sweep(tmp_path / "sgd", {"reference": [0.5, 0.5, 0.5], "pg": [0.0, 0.0, 0.1], "sc": [0.5, 0.52, 0.48]})
    b = fake_sweep(tmp_path / "adamw", {"reference": [0.5, 0.5, 0.5], "pg": [0.45, 0.5, 0.56], "sc": [0.5, 0.51, 0.49],
                                        "tis": [0.5, 0.5, 0.5]})
    text = compare_sweeps([a, b], labels=["SGD", "AdamW"])
    rows = {line.split(" | ")[0][2:]: line for line in text.splitlines() if line.startswith("| ")}
    assert "tis" not in rows  # only the groups every sweep has
    assert rows["pg"] == ("| pg | -0.467 [-0.610, -0.323] (3) **below** | — | 3 of 3 | +0.003 [-0.133, +0.140] (3) | — "
                          "| 0 of 3 | **no** |")  # pg collapses under one setting only: the verdict changed
    assert rows["sc"] == ("| sc | +0.000 [-0.050, +0.050] (3) | +0.467 [+0.279, +0.655] (3) **above** | 0 of 3 "
                          "| +0.000 [-0.025, +0.025] (3) | -0.003 [-0.155, +0.148] (3) | 0 of 3 | **no** |")
    assert rows["reference"].startswith("| reference | — | +0.467 [+0.323, +0.610] (3) **above** |")
    assert rows["reference"].endswith("| — |")
    same = compare_sweeps([a, a], labels=["one", "again"])
    assert "**no**" not in same and same.count("| yes |") == 2  # a sweep beside itself: the same verdicts
    assert main(["compare", str(a), str(b), "--labels", "SGD", "AdamW", "--out", str(tmp_path / "side.md")]) == 0
    assert (tmp_path / "side.md").read_text() == text == capsys.readouterr().out
    with pytest.raises(ValueError, match="2 labels for 1 sweeps|at least two"):
        compare_sweeps([a], labels=["SGD", "AdamW"])


def test_the_paired_table_pairs_the_auc_too_so_a_dip_that_recovers_shows(tmp_path):
    from driftless.recipes.sweep_report import _interval_cell, paired_interval

    sweep = fake_sweep(tmp_path / "s", {"reference": [0.5, 0.5, 0.5], "pg": [0.0, 0.0, 0.1]})
    report = write_sweep_report(sweep).read_text()
    row = next(line for line in report.splitlines() if line.startswith("| pg | ") and "separates" not in line
               and line.count("|") == 8)
    # held-out curves 0.3, 0.3, (0.3 + final) / 2, final: AUC 0.375 for the reference, 0.1875 / 0.1875 / 0.225 for pg
    assert row.endswith(f"| {_interval_cell(paired_interval([-0.1875, -0.1875, -0.15]), 3)} | below |")
    assert "| Δ AUC vs `reference` | separates |" in report


def test_report_pairs_compare_two_chosen_groups_seed_by_seed(tmp_path, capsys):
    sweep = fake_sweep(tmp_path / "s", {"reference": [0.5, 0.5, 0.5], "pg": [0.0, 0.0, 0.1],
                                        "pg+replay": [0.4, 0.5, 0.45]})
    assert main(["report", str(sweep), "--by", "variant", "--pairs", "pg+replay:pg"]) == 0
    row = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("| pg+replay − pg |"))
    # finals 0.4 − 0.0, 0.5 − 0.0, 0.45 − 0.1; the fake records log no KL
    assert row.startswith("| pg+replay − pg | +0.417 [+0.227, +0.606] (3) | above |") and row.endswith("| — |")
    assert main(["report", str(sweep), "--pairs", "tis:pg"]) == 2
    assert "report --pairs: 'tis:pg' does not split into two groups" in capsys.readouterr().err
    assert main(["report", str(sweep), "--pairs", "pg"]) == 2
    assert "'pg' is not A:B" in capsys.readouterr().err


def test_report_pairs_give_no_kl_ratio_over_a_run_without_mismatch(tmp_path, capsys):
    sweep = fake_sweep(tmp_path / "s", {"reference": [0.5, 0.5, 0.5], "pg": [0.0, 0.0, 0.1], "tis": [0.5, 0.5, 0.5]},
                       kl={"reference": 8e-14, "pg": 0.2, "tis": 0.05})
    assert main(["report", str(sweep), "--by", "variant", "--pairs", "tis:pg", "tis:reference"]) == 0
    rows = {line.split(" | ")[0][2:]: line for line in capsys.readouterr().out.splitlines()
            if line.startswith("| tis − ")}
    assert rows["tis − pg"].endswith("| 0.25, 0.25, 0.25 |")
    assert rows["tis − reference"].endswith("| — |")  # not 6e11: the reference's KL is rounding


def test_report_pairs_split_labels_that_hold_colons_themselves(tmp_path):
    from driftless.recipes.sweep_report import split_pair

    groups = {"pg, noise:0.3": [], "sc, noise:0.3": [], "pg, noise:0.6": []}
    assert split_pair("sc, noise:0.3:pg, noise:0.3", groups, "s", ["variant"]) == ("sc, noise:0.3", "pg, noise:0.3")
    with pytest.raises(ValueError, match="does not split into two groups"):
        split_pair("sc, noise:0.3:tis, noise:0.3", groups, "s", ["variant"])


def test_a_reports_regenerate_line_names_the_sweep_as_seen_from_here(tmp_path, monkeypatch):
    sweep = fake_sweep(tmp_path / "results" / "s", {"reference": [0.5, 0.5, 0.5], "pg": [0.0, 0.0, 0.1]})
    monkeypatch.chdir(tmp_path)  # the study passes resolved paths: a committed report must not carry this machine's
    report = write_sweep_report(sweep.resolve(), by=["variant"]).read_text()
    assert "Regenerate with `driftless report results/s --by variant`." in report
    assert str(tmp_path) not in report
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)  # a sweep outside the working directory keeps the path it was given
    assert f"`driftless report {sweep.resolve()}`" in write_sweep_report(sweep.resolve()).read_text()


def test_the_claims_file_names_a_bad_entry_and_its_key(tmp_path):
    from driftless.recipes.study import CLAIMS, CLAIMS_FILE, load_claims

    assert load_claims(CLAIMS_FILE)[0] == CLAIMS and [c.name for c in CLAIMS][:2] == ["calibration", "noise"]
    bad = tmp_path / "claims.yaml"
    bad.write_text("claims:\n- {name: a, by: [variant], what: x}\n- {name: b, by: [variant], what: y, extar: true}\n"
                   "quick: {name: q, by: [variant], what: z}\n")
    with pytest.raises(ValueError, match=r"claims\[1\] \(b\): unknown key\(s\) \['extar'\]"):
        load_claims(bad)
    bad.write_text("claims:\n- {name: a, by: [variant]}\nquick: {name: q, by: [variant], what: z}\n")
    with pytest.raises(ValueError, match=r"claims\[0\] \(a\): missing \['what'\]"):
        load_claims(bad)
    bad.write_text("claims:\n- {name: a, by: [variant], what: x}\n- {name: a, by: [variant], what: y}\n"
                   "quick: {name: q, by: [variant], what: z}\n")
    with pytest.raises(ValueError, match=r"named twice: \['a'\]"):
        load_claims(bad)
