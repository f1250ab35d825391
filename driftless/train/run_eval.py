"""``driftless eval RUN``: the held-out reward of a run's latest checkpoint."""

from __future__ import annotations

from pathlib import Path

from driftless.tasks import CharTokenizer
from driftless.train.checkpoint import latest_checkpoint, load_checkpoint
from driftless.train.config import load_config
from driftless.train.evaluate import evaluate
from driftless.train.factory import make_policy


def evaluate_run(run_dir, problems: int | None = None) -> dict:
    run_dir = Path(run_dir)
    if not (run_dir / "config.yaml").exists():
        raise ValueError(f"{run_dir} is not a run directory (no config.yaml)")
    ckpt = latest_checkpoint(run_dir)
    if ckpt is None:
        raise ValueError(f"{run_dir} has no checkpoint yet")
    config = load_config(run_dir / "config.yaml")
    tokenizer = CharTokenizer()
    policy = make_policy(config, tokenizer, load_checkpoint(ckpt, weights_only=True)["model"])
    task = config.task.build()
    result = evaluate(policy, task, tokenizer, task.eval_set(problems or config.train.eval_problems),
                      max_new_tokens=config.rollout.max_new_tokens)
    return {"run": str(run_dir), "checkpoint": ckpt.name, **result}
