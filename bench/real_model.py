"""Seconds per step (generation / the learner's forward + backward / objective / optimizer) and peak resident memory of a training process on
SmolLM2-135M-Instruct (configs/smollm2.yaml; `make real` first), per batch shape, at a fixed train.micro_batch_tokens.

    .venv/bin/python bench/real_model.py [--batches 8x4 16x8] [--steps 3] [--micro-batch-tokens 768] [--out FILE]

Each shape trains in a process of its own (peak RSS is that process's ru_maxrss) from the same checkpoint, with
sc+tis and the sampler's top-32 head; the step times are the mean over the steps between the first and the last (the last evaluates and
checkpoints; step_time is the whole step, held-out evaluation excluded). Prints JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import tempfile
from pathlib import Path

from _timing import emit

PHASES = ("rollout_s", "score_s", "loss_s", "optim_s", "step_time")


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def one(shape: str, steps: int, micro: int | None, model: str) -> dict:
    prompts, group = (int(x) for x in shape.split("x"))
    with tempfile.TemporaryDirectory() as tmp:
        code = ("import resource, sys, json; from driftless.cli import main; rc = main(sys.argv[1:]); "
                "print('MAXRSS', resource.getrusage(resource.RUSAGE_SELF).ru_maxrss); sys.exit(rc)")
        cmd = [sys.executable, "-c", code, "train", "configs/smollm2.yaml", f"model.hf_path={model}",
               "objective.name=sc+tis", "objective.params={top_k: 32}", f"rollout.prompts_per_step={prompts}",
               f"rollout.group_size={group}", f"train.steps={steps}", f"train.eval_every={steps + 1}",
               f"train.checkpoint_every={steps + 1}", f"train.micro_batch_tokens={micro if micro else 'null'}",
               "--run-dir", tmp, "--no-progress"]
        done = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if done.returncode != 0:
            raise RuntimeError(done.stderr[-2000:])
        rss_kb = int(next(x for x in done.stdout.splitlines() if x.startswith("MAXRSS")).split()[1])
        rows = [json.loads(x) for x in (Path(tmp) / "metrics.jsonl").read_text().splitlines()]
    steady = rows[1:-1] or rows[1:] or rows  # not the first (warm-up) nor the last (final eval, checkpoint)
    out = {"batch": shape, "rows": prompts * group, "micro_batch_tokens": micro, "peak_rss_gb": round(rss_kb / 2**20, 3),
           "response_tokens_mean": round(sum(r["response_length"] for r in steady) / len(steady), 2)}
    for k in PHASES:
        out[k] = round(sum(r.get(k, 0.0) - (r.get("eval_s", 0.0) if k == "step_time" else 0.0) for r in steady)
                       / len(steady), 3)
    # with micro-batches the learner's forward and backward alternate per micro-batch: score_s holds both
    out["generation_s"], out["forward_backward_s"], out["objective_s"], out["optimizer_s"] = (
        out.pop("rollout_s"), out.pop("score_s"), out.pop("loss_s"), out.pop("optim_s"))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", nargs="+", default=["8x4", "16x8"])
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--micro-batch-tokens", type=int, default=768)
    ap.add_argument("--model", default=os.environ.get("DRIFTLESS_REAL_MODEL", "runs/models/smollm2-135m-instruct"))
    ap.add_argument("--out", help="also write the JSON here")
    args = ap.parse_args()
    result = {"bench": "real_model", "cpu": cpu_name(), "threads": int(os.environ.get("OMP_NUM_THREADS", "0")) or
              os.cpu_count(), "steps": args.steps,
              "runs": [one(b, args.steps, args.micro_batch_tokens, args.model) for b in args.batches],
              "driver_rss_gb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 3)}
    emit(result, args.out)


if __name__ == "__main__":
    main()
