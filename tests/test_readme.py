"""The README's code runs as written: its Python blocks are executed, its commands are checked.

Every ``driftless train`` line (plain or under torchrun) must load as a config and pass the start-up checks a
run makes, every ``make`` target must exist, and each block names the test that trains its path."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from driftless.train import load_config
from driftless.train.build import check

REPO = Path(__file__).resolve().parents[1]
README = (REPO / "README.md").read_text()
BLOCKS = re.findall(r"```(\w+)\n(.*?)```", README, flags=re.DOTALL)


def commands(block: str) -> list[list[str]]:
    """Shell lines with continuations joined and comments dropped, split as the shell would."""
    joined = re.sub(r"\\\n\s*", " ", block)
    return [shlex.split(line, comments=True) for line in joined.splitlines() if line.strip()]


def train_args(words: list[str]) -> list[str] | None:
    """The arguments after ``driftless train`` (``.venv/bin/driftless`` or ``torchrun ... -m driftless``)."""
    for i, w in enumerate(words[:-1]):
        if (w.endswith("/driftless") or (w == "driftless" and words[i - 1] == "-m")) and words[i + 1] == "train":
            return words[i + 2:]
    return None


def test_the_readme_has_the_blocks_it_promises():
    kinds = [kind for kind, _ in BLOCKS]
    assert kinds.count("python") == 2 and kinds.count("bash") >= 3


@pytest.mark.parametrize("line", [" ".join(w) for kind, b in BLOCKS if kind == "bash" for w in commands(b)
                                  if train_args(w) is not None])
def test_every_train_command_loads_and_passes_the_start_up_checks(line, monkeypatch):
    monkeypatch.chdir(REPO)
    args = train_args(shlex.split(line))
    overrides = [a for a in args[1:] if not a.startswith("--")]
    config = load_config(args[0], overrides)
    if config.task.name == "dataset":  # a data file is read when the task is built: make hf makes it
        return
    try:
        import torch

        check(config)
    except ValueError as err:  # a GPU line on a machine without one: refused for that reason only
        if "train.device=cuda" not in overrides or torch.cuda.is_available():
            raise
        assert "torch.cuda.is_available() is False" in str(err)
        check(load_config(args[0], [o if o != "train.device=cuda" else "train.device=auto" for o in overrides]))


def test_every_make_target_exists():
    targets = set(re.findall(r"^([\w-]+):", (REPO / "Makefile").read_text(), flags=re.MULTILINE))
    named = {w[1] for kind, b in BLOCKS if kind == "bash" for w in commands(b) if w[:1] == ["make"]}
    named |= set(re.findall(r"`make ([\w-]+)`", README))
    assert named and named <= targets, named - targets


@pytest.mark.parametrize("index", [i for i, (kind, _) in enumerate(BLOCKS) if kind == "python"])
def test_each_python_block_runs_as_written(index, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # where the TRL block's output_dir would go
    namespace: dict = {}
    exec(compile(BLOCKS[index][1], f"README.md python block {index}", "exec"), namespace)  # noqa: S102 (the README)
    if "loss" in namespace:  # the objective block: a finite loss whose gradient reached the trainer's logits
        assert namespace["loss"].isfinite() and namespace["logits"].grad is not None
        assert namespace["logits"].grad.abs().sum() > 0 and "ratio_mean" in namespace["metrics"]
    else:  # the TRL / verl block
        assert namespace["args"].objective == "sc+tis" and namespace["args"].head_k == 8
        assert namespace["loss_fn"].__name__.startswith("driftless_")
