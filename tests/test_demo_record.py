"""The README's demo numbers are the committed record's, and the record is what configs/demo.yaml trains.

`make demo` runs reproducible training (train.reproducible), so its numbers are the same bits on every
x86-64 CPU. The record (results/demo-reproducible: the 5-seed record, seed 0 being `make demo`'s runs)
carries them; this test ties the README to the record and the record to the config. `make demo-verify`
(CI) trains the demo afresh and compares every metric line with the record's (``driftless demo --expect``).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import yaml

from driftless.recipes.demo import (
    METHODS,
    RECORD,
    differences,
    late_reward,
    method_overrides,
    numbers_table,
    readme_numbers,
    story,
    story_summary,
)
from driftless.train import load_config
from driftless.train.config import dump_config
from driftless.train.sinks import read_text

REPO = Path(__file__).resolve().parents[1]


def test_the_readme_states_the_records_numbers():
    assert readme_numbers(REPO / "README.md") == numbers_table(RECORD), (
        "README.md's demo numbers are not the record's: paste driftless.recipes.demo.numbers_table() "
        "between its demo-numbers markers")


@pytest.mark.parametrize("method", METHODS)
def test_the_record_was_trained_from_configs_demo_yaml(method):
    """A change to configs/demo.yaml without a new record (and README) fails here."""
    # read through the schema: a setting added since the record, at its default, is the record's behaviour
    recorded = yaml.safe_load(dump_config(load_config(RECORD / method / "seed0" / "config.yaml")))
    current = yaml.safe_load(dump_config(load_config(REPO / "configs/demo.yaml",
                                                     [*method_overrides(method), "train.seed=0"])))
    for section, key in (("train", "run_dir"), ("train", "progress"), ("train", "loggers"), ("warm_start", "cache_dir")):
        recorded[section].pop(key, None)
        current[section].pop(key, None)
    assert recorded == current


RECORD_STORY_COUNT = 4  # seeds of the record's 5 where all four statements hold (docs/calibration.md)


def test_the_record_tells_the_story_in_the_readmes_seed_and_in_its_stated_count_of_seeds():
    """The baseline learns, pg ends below it, tis and sc each end above pg and within 0.05 of the baseline
    (demo.story, on the mean of the last 3 evaluations): in seed 0, the one `make demo` shows, and in
    RECORD_STORY_COUNT of the record's 5 seeds."""
    seeds = sorted(int(p.name.removeprefix("seed")) for p in (RECORD / "baseline").glob("seed*"))
    assert seeds == [0, 1, 2, 3, 4]
    rows = story({m: [story_summary(RECORD / m / f"seed{s}") for s in seeds] for m in METHODS})
    assert all(rows[0].values()), rows[0]
    assert sum(all(r.values()) for r in rows) == RECORD_STORY_COUNT, rows


def test_the_story_is_checked_in_every_seed_on_the_late_evaluations():
    """demo.story: the baseline learns, pg ends below it, tis and sc each end above pg and within the margin."""
    def runs(*lates):
        return [{"initial_eval": 0.40, "late_eval": x} for x in lates]
    summaries = {"baseline": runs(0.50, 0.50, 0.39, 0.50), "pg": runs(0.10, 0.10, 0.10, 0.55),
                 "tis": runs(0.46, 0.44, 0.30, 0.60), "sc": runs(0.49, 0.45, 0.30, 0.60)}
    rows = story(summaries, margin=0.05)
    assert [all(r.values()) for r in rows] == [True, False, False, False]
    assert rows[1] == {"baseline learns": True, "pg falls": True, "tis holds": False, "sc holds": True}  # 0.06 below
    assert rows[2]["baseline learns"] is False and rows[3]["pg falls"] is False
    assert story({m: summaries[m] for m in ("baseline", "pg")}) is None  # --methods without the corrections


def test_the_late_reward_is_the_mean_of_the_last_three_evaluations_after_the_start():
    assert late_reward([0.1, 0.2, 0.3, 0.4, 0.0]) == pytest.approx((0.3 + 0.4 + 0.0) / 3)
    assert late_reward([0.1, 0.2, 0.3]) == pytest.approx(0.25)  # two evaluations: both, the start left out
    assert late_reward([0.1]) == 0.1  # never evaluated after the start


def test_a_record_compared_with_itself_has_no_differences_and_a_changed_line_is_named(tmp_path):
    assert differences(RECORD, RECORD) == []

    for m in METHODS:
        shutil.copytree(RECORD / m / "seed0", tmp_path / m / "seed0", ignore=shutil.ignore_patterns("checkpoints"))
    path = tmp_path / "sc" / "seed0" / "metrics.jsonl"
    lines = read_text(path.parent).splitlines()  # the record is packed (metrics.jsonl.xz); a plain copy wins
    path.with_name("metrics.jsonl.xz").unlink(missing_ok=True)
    lines[3] = lines[3].replace('"step": 3', '"step": 3, "extra": 1', 1)  # one more key on one line
    path.write_text("\n".join(lines) + "\n")
    found = differences(tmp_path, RECORD)
    assert len(found) == 1 and found[0].startswith("sc: step 3 differs in extra")
