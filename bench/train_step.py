"""Whole-step time split into rollout, scoring, loss and optimizer, for pg and sc; prints JSON.

    .venv/bin/python bench/train_step.py                  # 16 prompts x 8 samples, 24 new tokens
    .venv/bin/python bench/train_step.py --steps 20 --prompts 32

Both methods run from the same random-init TinyLM (no warm start) with a vanishing learning rate,
so every step generates the same tokens and only the objective differs. Reports medians over
--steps steps after one warm-up step; ``sc_step_overhead_ratio`` is sc's median step time over pg's.

``decomposition``: the cost of the Eq. 1 decomposition (``diagnostics.decomposition``), pg with it
on against off, without lag (no extra forward: every token is the trainer's current version) and
with ``rollout.lag=--lag`` (one extra no-grad forward per past version in the batch, plus a copy of
the weights per update).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile

import torch


def measure(preset: str, args, extra=()) -> dict:
    from driftless.train import Run, load_config

    params = [f"objective.params={{top_k: {args.top_k}}}"] if preset.startswith("sc") else []
    cfg = load_config(None, [
        f"objective.name={preset}", *params, "model.warm_start=false", "optim.lr=1e-12",
        f"rollout.prompts_per_step={args.prompts}", f"rollout.group_size={args.group}",
        f"rollout.max_new_tokens={args.new_tokens}", f"rollout.head_k={max(args.top_k, 1)}",
        f"train.steps={args.steps + 1}", "train.eval_every=100000", "train.progress=false",
        f"mismatch.view={args.view}", *extra,
    ])
    with tempfile.TemporaryDirectory() as tmp:
        run = Run(cfg, tmp, progress=False)
        rows = [run.step() for _ in range(args.steps + 1)][1:]
    keys = ("rollout_s", "score_s", "loss_s", "optim_s", "step_time")
    return {k: statistics.median(r[k] for r in rows) for k in keys}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=24)
    ap.add_argument("--top-k", type=int, default=32)
    ap.add_argument("--view", default="none")
    ap.add_argument("--lag", type=int, default=2)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    results = {preset: measure(preset, args) for preset in ("pg", "sc")}
    decomposition = {}
    for name, lag in (("no_lag", 0), (f"lag_{args.lag}", args.lag)):
        on, off = (measure("pg", args, [f"rollout.lag={lag}", f"diagnostics.decomposition={flag}"])["step_time"]
                   for flag in ("true", "false"))
        decomposition[name] = {"on_s": on, "off_s": off, "step_time_ratio": on / off}
    print(json.dumps({
        "prompts": args.prompts, "group": args.group, "new_tokens": args.new_tokens, "top_k": args.top_k,
        "threads": args.threads, "median_seconds": results,
        "sc_step_overhead_ratio": results["sc"]["step_time"] / results["pg"]["step_time"],
        "sc_loss_overhead_ratio": results["sc"]["loss_s"] / results["pg"]["loss_s"],
        "decomposition": decomposition,
    }, indent=2))


if __name__ == "__main__":
    main()
