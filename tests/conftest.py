"""Shared helpers for the test suite."""

from __future__ import annotations

import os

import pytest

# The suite runs aligned execution eager (the definitions) and checks the fused, compiled pieces against
# it in test_fuse.py, including across processes and kernel sets: compiling in every test and subprocess
# would cost minutes. Subprocesses inherit this. A test that wants fusion sets the variable itself.
os.environ.setdefault("DRIFTLESS_FUSED_ALIGNED", "0")


def run_until_killed(run, at_step: int) -> None:
    """Run ``run`` and crash it just before step ``at_step`` (after the checkpoints before it)."""
    real = run.step

    def step():
        if run.step_index == at_step:
            raise RuntimeError("killed")
        return real()
    run.step = step
    with pytest.raises(RuntimeError, match="killed"):
        run.run()


def hf_stand_in(tmp_path) -> list[str]:
    """What a user brings, small: Countdown rows as JSONL files and a save_pretrained Qwen3 checkpoint with its
    BPE tokenizer and chat template (driftless make-model, 2 layers of 32), under ``tmp_path``; the overrides
    that train it with the countdown reward, sc+tis over an 8-token head and sampler noise 0.1, for 2 steps."""
    from driftless.recipes.make_model import make_model
    from driftless.tasks import Countdown, CountdownConfig
    from driftless.tasks.export import task_rows, write_jsonl

    task = Countdown(CountdownConfig(2, 1, 12, 100))
    train, held = task_rows(task, "train", draws=500), task_rows(task, "eval", draws=500)
    write_jsonl(train, tmp_path / "data/train.jsonl")
    write_jsonl(held, tmp_path / "data/eval.jsonl")
    make_model(tmp_path / "model", rows_train=train, rows_eval=held, vocab_size=300, hidden=32, layers=2, heads=2,
               kv_heads=1, intermediate=64, max_positions=64, sft_steps=10, sft_batch=8, progress=False)
    return ["model.kind=hf", f"model.hf_path={tmp_path / 'model'}", "model.max_seq_len=64", "task.name=dataset",
            f"task.path={tmp_path}/data/train.jsonl", f"task.eval_path={tmp_path}/data/eval.jsonl",
            "task.reward=countdown", "rollout.prompts_per_step=4", "rollout.group_size=4", "rollout.max_new_tokens=10",
            "rollout.head_k=8", "objective.name=sc+tis", "objective.params={top_k: 8}", "mismatch.view=noise:0.1",
            "train.eval_problems=8", "train.steps=2", "train.eval_every=2", "train.checkpoint_every=2",
            "optim.lr=1e-3"]
