"""The cost of reproducible training: a step and a warm start, fast vs aligned vs reproducible; prints JSON.

    .venv/bin/python bench/reproducible.py                    # the demo's batch (32 prompts x 8, 24 new tokens)
    .venv/bin/python bench/reproducible.py --steps 5 --warm-steps 40

``fast``: model.execution=fast (the demo before train.reproducible); ``aligned``: the aligned forward
with torch's optimizer and kernels elsewhere; ``reproducible``: train.reproducible=true (aligned
execution under ops.reproducible's dispatch mode, ExactAdamW). Every mode trains from the same
random-init TinyLM with a vanishing learning rate, so each step generates comparable batches;
medians over --steps steps after one warm-up step. ``warm_start_s``: a supervised warm start of
--warm-steps steps (its held-out evaluation on 16 problems included), from scratch (no cache).
``step_ratio`` / ``warm_start_ratio``: reproducible over fast (the issue's goal: at most 1.5).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
MODES = {"fast": ["model.execution=fast", "train.reproducible=false"],
         "aligned": ["model.execution=aligned", "train.reproducible=false"],
         "reproducible": ["model.execution=aligned", "train.reproducible=true"]}


def step_times(mode: str, args) -> dict:
    from driftless.train import Run, load_config

    cfg = load_config(REPO / "configs/demo.yaml", [
        *MODES[mode], "model.warm_start=false", "optim.lr=1e-12", f"rollout.prompts_per_step={args.prompts}",
        f"train.steps={args.steps + 1}", "train.eval_every=100000", "train.progress=false"])
    with tempfile.TemporaryDirectory() as tmp:
        run = Run(cfg, tmp, progress=False)
        rows = [run.step() for _ in range(args.steps + 1)][1:]
    return {k: statistics.median(r[k] for r in rows) for k in ("rollout_s", "score_s", "loss_s", "optim_s", "step_time")}


def warm_start_time(mode: str, args) -> float:
    from driftless.ops.reproducible import within
    from driftless.train import build, load_config
    from driftless.train.warmstart import warm_start

    cfg = load_config(REPO / "configs/demo.yaml", [*MODES[mode], f"warm_start.steps={args.warm_steps}",
                                                   "warm_start.eval_problems=16"])
    with tempfile.TemporaryDirectory() as tmp, within(cfg.train.reproducible):
        tok = build.tokenizer(cfg)
        t0 = time.perf_counter()
        warm_start(build.tiny_config(cfg, tok.vocab_size), build.task(cfg), tok, cfg.warm_start.settings(),
                   max_new_tokens=cfg.rollout.max_new_tokens, cache_dir=tmp, progress=False,
                   reproducible=cfg.train.reproducible)
        return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--warm-steps", type=int, default=40)  # torch's OneCycleLR needs 5 % of them >= 2 steps
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    steps = {mode: step_times(mode, args) for mode in MODES}
    warm = {mode: warm_start_time(mode, args) for mode in MODES}
    print(json.dumps({
        "cpu_capability": torch.backends.cpu.get_cpu_capability(), "threads": args.threads,
        "prompts": args.prompts, "steps": args.steps, "warm_steps": args.warm_steps,
        "median_seconds": steps, "warm_start_s": warm,
        "step_ratio": steps["reproducible"]["step_time"] / steps["fast"]["step_time"],
        "step_ratio_vs_aligned": steps["reproducible"]["step_time"] / steps["aligned"]["step_time"],
        "warm_start_ratio": warm["reproducible"] / warm["fast"],
    }, indent=2))


if __name__ == "__main__":
    main()
