"""``driftless eval RUN``: the held-out reward of a run's newest intact checkpoint."""

from __future__ import annotations

from pathlib import Path

from driftless.train import build
from driftless.train.checkpoint import latest_checkpoint, load_checkpoint, newest_intact
from driftless.train.config import load_config
from driftless.train.evaluate import evaluate


def evaluate_run(run_dir, problems: int | None = None) -> dict:
    run_dir = Path(run_dir)
    if not (run_dir / "config.yaml").exists():
        raise ValueError(f"{run_dir} is not a run directory (no config.yaml)")
    if latest_checkpoint(run_dir) is None:
        raise ValueError(f"{run_dir} has no checkpoint yet")
    intact = newest_intact(run_dir)  # a damaged one is skipped with a warning naming it
    if intact is None:
        raise ValueError(f"{run_dir} holds no intact checkpoint (each failed its checksums)")
    ckpt, verified = intact
    config = load_config(run_dir / "config.yaml")
    tokenizer = build.tokenizer(config)
    policy = build.policy(config, load_checkpoint(ckpt, weights_only=True, verified=verified)["model"], tokenizer)
    task = build.task(config)
    result = evaluate(policy, task, build.codec(config, tokenizer), task.eval_set(problems or config.train.eval_problems),
                      max_new_tokens=config.rollout.max_new_tokens, stop=tuple(config.rollout.stop))
    return {"run": str(run_dir), "checkpoint": ckpt.name, **result}
