"""Tokens per second of rollout and training: a transformers checkpoint (the HF path) vs TinyLM of similar size; JSON.

    .venv/bin/driftless export-task runs/data/countdown && .venv/bin/driftless make-model runs/models/countdown-qwen3
    .venv/bin/python bench/hf_path.py                      # 32 prompts x 8 samples, 24 new tokens, 6 steps
    .venv/bin/python bench/hf_path.py --model DIR --data DIR --steps 10

Both run the same loop on the same Countdown problems with a vanishing learning rate (so every
step samples from the same weights), each from its warm start: TinyLM (192 wide, 4 layers,
character tokenizer) on the built-in problems, and the checkpoint with its own BPE tokenizer and
chat template on the exported file of the same problems. Rollout tokens/s is the worker's own measure (generated tokens over generation time);
training tokens/s is action tokens over scoring + loss + optimizer time. Medians after one warm-up step.
The head's coverage (``sampler_head_mass``: the sampler's top-k mass of q, and ``trainer_head_mass``: the
trainer's mass on the same ids) is reported for both, since a k = 32 head covers 32 of 64 characters
but only 32 of the checkpoint's several hundred tokens.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
from pathlib import Path

import torch


def measure(name: str, overrides: list[str], steps: int) -> dict:
    from driftless.train import Run, load_config

    cfg = load_config(None, [*overrides, "optim.lr=1e-12", f"train.steps={steps + 1}", "train.eval_every=100000",
                             "train.progress=false"])
    with tempfile.TemporaryDirectory() as tmp:
        run = Run(cfg, tmp, progress=False)
        rows = [run.step() for _ in range(steps + 1)][1:]
        params = sum(p.numel() for p in run.policy.parameters())
    train_tps = [r["tokens"] / (r["score_s"] + r["loss_s"] + r["optim_s"]) for r in rows]
    out = {"parameters": params, "vocab_size": int(run.policy.vocab_size),
           "rollout_tokens_per_s": statistics.median(r["tokens_per_s"] for r in rows),
           "train_tokens_per_s": statistics.median(train_tps),
           "step_time_s": statistics.median(r["step_time"] for r in rows),
           "response_length": statistics.median(r["response_length"] for r in rows)}
    for key in ("sampler_head_mass", "trainer_head_mass"):
        values = [r[key] for r in rows if key in r]
        if values:
            out[key] = statistics.median(values)
    return {name: out}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="runs/models/countdown-qwen3")
    ap.add_argument("--data", default="runs/data/countdown")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=24)
    ap.add_argument("--head-k", type=int, default=32)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    data = Path(args.data)
    data_task = ["task.name=dataset", f"task.path={data / 'train.jsonl'}", f"task.eval_path={data / 'eval.jsonl'}",
                 "task.reward=countdown"]
    common = ["objective.name=sc", f"objective.params={{top_k: {args.head_k}}}",
              f"rollout.prompts_per_step={args.prompts}", f"rollout.group_size={args.group}",
              f"rollout.max_new_tokens={args.new_tokens}", f"rollout.head_k={args.head_k}", "train.eval_problems=8"]
    results = {"threads": args.threads, "cpu_capability": torch.backends.cpu.get_cpu_capability(),
               "torch": torch.__version__, "settings": vars(args)}
    results.update(measure("tinylm", [*common, "model.kind=tiny"], args.steps))  # its warm start, built-in problems
    results.update(measure("hf", [*common, *data_task, "model.kind=hf", f"model.hf_path={args.model}"], args.steps))
    results["hf_over_tinylm"] = {k: results["hf"][k] / results["tinylm"][k]
                                 for k in ("rollout_tokens_per_s", "train_tokens_per_s")}
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
