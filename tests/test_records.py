"""Run records a clone can afford: ``driftless pack`` compresses finished runs' line records in place,
every reader reads both forms, a packed run resumes, and user errors print one line without a traceback."""

from __future__ import annotations

import json
import lzma
import subprocess
import sys
from pathlib import Path

import pytest

from driftless.cli import main
from driftless.recipes.sweep_report import write_sweep_report
from driftless.train import load_config, train
from driftless.train.loop import TIMING_KEYS
from driftless.train.report import summarize
from driftless.train.sinks import pack_run, read_metrics, record_path, unpack_run

REPO = Path(__file__).resolve().parents[1]
SMALL = ["model.warm_start=false", "model.d_model=32", "model.n_layer=1", "model.n_head=2", "model.n_kv_head=1",
         "model.d_ff=64", "model.max_seq_len=16", "task.name=first-token", "rollout.prompts_per_step=4",
         "rollout.group_size=4", "rollout.max_new_tokens=2", "rollout.head_k=4", "train.eval_every=2",
         "train.eval_problems=16", "train.checkpoint_every=2", "train.steps=4", "train.progress=false",
         "optim.schedule=constant"]  # a constant rate: a run extended from 4 to 6 steps is the 6-step run


def test_a_packed_record_reads_back_equal_to_the_original_bytes_and_rows(tmp_path):
    run = train(load_config(None, SMALL), tmp_path / "run", progress=False)
    original = (run / "metrics.jsonl").read_bytes()
    samples = (run / "samples.jsonl").read_bytes()
    rows, summary = read_metrics(run), summarize(run)
    before, after = pack_run(run)
    assert not (run / "metrics.jsonl").exists() and record_path(run).name == "metrics.jsonl.xz"
    assert lzma.decompress((run / "metrics.jsonl.xz").read_bytes()) == original  # byte for byte
    assert lzma.decompress((run / "samples.jsonl.xz").read_bytes()) == samples
    assert before == len(original) + len(samples) and 0 < after < before
    assert read_metrics(run) == rows and summarize(run) == summary
    assert pack_run(run) == (before, after)  # packing again changes nothing
    packed = (run / "metrics.jsonl.xz").read_bytes()
    unpack_run(run)
    assert (run / "metrics.jsonl").read_bytes() == original and not (run / "metrics.jsonl.xz").exists()
    pack_run(run)
    assert (run / "metrics.jsonl.xz").read_bytes() == packed  # the same bytes every time (git sees no change)


def test_a_packed_run_trained_further_resumes_from_its_checkpoint_and_matches_an_unbroken_run(tmp_path):
    unbroken = train(load_config(None, [*SMALL, "train.steps=6"]), tmp_path / "unbroken", progress=False)
    run = train(load_config(None, SMALL), tmp_path / "run", progress=False)
    pack_run(run)
    train(load_config(None, [*SMALL, "train.steps=6"]), run, resume=True, progress=False)
    assert (run / "metrics.jsonl").exists() and not (run / "metrics.jsonl.xz").exists()

    def strip(rows):
        return [{k: v for k, v in r.items() if k not in TIMING_KEYS} for r in rows]
    assert strip(read_metrics(run)) == strip(read_metrics(unbroken))


def test_driftless_pack_packs_finished_runs_only_and_the_report_reads_them(tmp_path, capsys):
    from driftless.recipes.sweep import run_trial

    sweep = tmp_path / "sweep"
    run_trial(None, [*SMALL, "train.seed=0"], sweep / "a")  # a sweep trial packs its record when it finishes
    assert record_path(sweep / "a").name == "metrics.jsonl.xz"
    train(load_config(None, [*SMALL, "train.seed=1"]), sweep / "b", progress=False)  # no done.json: unfinished
    first = write_sweep_report(sweep).read_text()
    capsys.readouterr()
    assert main(["pack", str(sweep)]) == 0
    out = capsys.readouterr()
    assert json.loads(out.out)["runs"] == 1 and "skipped" in out.err and "b: no done.json" in out.err
    assert (sweep / "b" / "metrics.jsonl").exists()
    assert main(["pack", "--unfinished", str(sweep / "b")]) == 0
    assert record_path(sweep / "b").name == "metrics.jsonl.xz"
    assert write_sweep_report(sweep).read_text() == first  # the same table from the packed records


def test_a_slimmed_record_keeps_the_reports_columns_and_gives_the_same_report_and_plots(tmp_path, capsys):
    from driftless.recipes.sweep import run_trial
    from driftless.recipes.sweep_report import RECORD_COLUMNS

    sweep = tmp_path / "sweep"
    for seed in (0, 1):
        run_trial(None, [*SMALL, f"train.seed={seed}"], sweep / f"s{seed}")
    full = {seed: read_metrics(sweep / f"s{seed}") for seed in (0, 1)}
    first = write_sweep_report(sweep).read_text()
    plots = {p.name: p.read_bytes() for p in (sweep / "plots").glob("*.png")}
    assert plots and all(p.startswith(b"\x89PNG") for p in plots.values())
    assert main(["pack", "--slim", str(sweep)]) == 0
    assert json.loads(capsys.readouterr().out)["runs"] == 2
    for seed, rows in full.items():
        slim = read_metrics(sweep / f"s{seed}")
        assert len(slim) == len(rows) and len(rows[0]) > len(RECORD_COLUMNS)
        assert slim == [{k: v for k, v in r.items() if k in RECORD_COLUMNS} for r in rows]  # kept values, same order
    packed = (sweep / "s0" / "metrics.jsonl.xz").read_bytes()
    assert main(["pack", "--slim", str(sweep)]) == 0 and (sweep / "s0" / "metrics.jsonl.xz").read_bytes() == packed
    assert write_sweep_report(sweep).read_text() == first
    assert {p.name: p.read_bytes() for p in (sweep / "plots").glob("*.png")} == plots


@pytest.mark.slow  # make test-slow: every study report (about a minute)
def test_every_study_report_regenerates_byte_for_byte_from_the_committed_records():
    """The records committed under results/study keep only the columns the reports read (``pack --slim``):
    each experiment's report.md and plots, regenerated from them, are the committed bytes."""
    from driftless.recipes import study

    root = REPO / "results" / "study"
    names = [c.name for c in study.CLAIMS if (root / c.name / "sweep.json").exists()]
    files = [p for n in names for p in [root / n / "report.md", *sorted((root / n / "plots").glob("*.png"))]]
    before = {p: p.read_bytes() for p in files}
    import os

    cwd = os.getcwd()
    os.chdir(REPO)  # the reports name their sweeps as seen from the repository root, as `make study` writes them
    try:
        study.write_reports(root, only=names)
    finally:
        os.chdir(cwd)
    changed = [str(p.relative_to(REPO)) for p in files if p.read_bytes() != before[p]]
    for p in files:
        p.write_bytes(before[p])  # the checkout as it was, whatever the verdict
    assert not changed, f"reports that do not regenerate from the committed records: {changed[:5]}"


def test_a_bad_line_in_a_record_is_named_by_file_and_line(tmp_path):
    (tmp_path / "metrics.jsonl").write_text('{"step": 0}\n{"step": 1\n')
    with pytest.raises(ValueError, match=r"metrics.jsonl, line 2: not JSON"):
        read_metrics(tmp_path)
    with pytest.raises(ValueError, match="has no metrics.jsonl"):
        read_metrics(tmp_path / "nothing")


@pytest.mark.parametrize("args, message", [
    (["train", "missing.yaml"], "driftless: error: config file missing.yaml does not exist"),
    (["train", "{bad}"], "driftless: error: config file {bad}, line 2, column 1: not valid YAML"),
    (["train", "configs/default.yaml", "optim.lrr=1"], "driftless: error: unknown config key optim.lrr: did you mean optim.lr?"),
    (["report", "nowhere"], "driftless: error: nowhere is not a directory"),
    (["eval", "nowhere"], "driftless: error: "),
])
def test_user_errors_print_one_line_without_a_traceback_and_debug_shows_it(tmp_path, args, message):
    if args[1] == "{bad}":
        (tmp_path / "bad.yaml").write_text("model: [\n")
        args = ["train", str(tmp_path / "bad.yaml")]
        message = message.replace("{bad}", str(tmp_path / "bad.yaml"))
    cmd = [sys.executable, "-m", "driftless", *args]
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, check=False)
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.startswith(message) and len(done.stderr.strip().splitlines()) == 1, done.stderr
    debug = subprocess.run([sys.executable, "-m", "driftless", "--debug", *args], cwd=REPO, capture_output=True, check=False,
                           text=True)
    assert debug.returncode != 0 and "Traceback (most recent call last)" in debug.stderr


def test_every_command_has_a_one_line_help():
    done = subprocess.run([sys.executable, "-m", "driftless", "--help"], cwd=REPO, capture_output=True, text=True, check=False)
    listed = done.stdout.split("COMMAND\n", 1)[1].split("\noptions:")[0].splitlines()
    commands = [line.split()[0] for line in listed if line.strip()]
    assert all(len(line.split()) > 1 for line in listed if line.strip()), listed  # name and help on one line
    assert {"train", "sweep", "study", "demo", "report", "pack", "make-model"} <= set(commands)


RESULTS_BUDGET = 25_000_000  # bytes of tracked results/: a clone stays small (docs/RESULTS.md, "What a record keeps")


def test_the_tracked_results_stay_within_their_budget():
    tracked = subprocess.run(["git", "ls-files", "results"], cwd=REPO, capture_output=True, text=True,
                             check=False).stdout.split()
    if not tracked:
        pytest.skip("not a git checkout")
    size = sum((REPO / f).stat().st_size for f in tracked if (REPO / f).exists())
    assert size <= RESULTS_BUDGET, (f"tracked results/ holds {size / 1e6:.1f} MB (budget {RESULTS_BUDGET / 1e6:.0f} MB): "
                                    "`driftless pack --slim` finished sweeps' records (docs/RESULTS.md)")


def test_every_committed_finished_run_has_its_metrics_record():
    """A finished run (done.json) is committed with its line record (metrics.jsonl packed, or plain where git
    keeps it): a report regenerated on a fresh clone must find every run it cites."""
    repo = Path(__file__).resolve().parents[1]
    tracked = subprocess.run(["git", "ls-files", "results"], cwd=repo, capture_output=True, text=True,
                             check=False).stdout.split()
    if not tracked:
        pytest.skip("not a git checkout")
    files = set(tracked)
    missing = [f for f in tracked if f.endswith("/done.json")
               and not {f[:-9] + "metrics.jsonl.xz", f[:-9] + "metrics.jsonl"} & files]
    assert not missing, f"finished runs committed without metrics: {missing[:5]}"


@pytest.mark.parametrize("argv", [
    ["check-alignment", "rollout.temprature=0.5"],
    ["mismatch-table", "rollout.temprature=0.5"],
    ["export-task", "OUT", "rollout.temprature=0.5"],
    ["make-model", "OUT", "rollout.temprature=0.5"],
    ["audit", "records", "--model", "M", "--records", "R", "rollout.temprature=0.5"],
    ["audit", "engine", "--model", "M", "--prompts", "P", "rollout.temprature=0.5"],
    ["train", "configs/default.yaml", "rollout.temprature=0.5"],
])
def test_every_command_takes_trains_keys_and_names_the_nearest_one(argv, capsys, tmp_path, monkeypatch):
    """One name per setting: a command's config settings are train's ``a.b=c`` keys, a misspelt one refused by
    train's schema with the nearest valid name, before anything is read or built."""
    monkeypatch.chdir(REPO)
    assert main([a.replace("OUT", str(tmp_path / "out")) for a in argv]) == 2
    err = capsys.readouterr().err
    assert "unknown config key rollout.temprature" in err and "did you mean rollout.temperature?" in err, err
    assert not (tmp_path / "out").exists()


def test_a_command_is_registered_once_and_sampling_keys_a_command_does_not_take_are_named():
    from driftless.commands import COMMANDS, command, given_keys

    with pytest.raises(ValueError, match="driftless train: registered twice"):
        command("train", "again", arguments=lambda p: None)(lambda args: 0)
    assert COMMANDS["train"].run.__module__ == "driftless.train.commands"
    assert given_keys("x", ["rollout.top_k=5", "train.seed=3"], ("rollout.top_k", "train.seed")) == {
        "rollout.top_k": 5, "train.seed": 3}
    with pytest.raises(ValueError, match="x: objective.name is a config key this command does not take; it takes "
                                         "rollout.top_k"):
        given_keys("x", ["objective.name=sc"], ("rollout.top_k",))
    with pytest.raises(ValueError, match="rollout.top_k"):  # train's ranges: top_k >= 0
        given_keys("x", ["rollout.top_k=-1"], ("rollout.top_k",))
