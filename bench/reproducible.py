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

``--profile``: one more step of each mode under torch.profiler, its CPU time split by what the operations serve
(``profile_s``): each operation's own time goes to the nearest enclosing operation (itself included) of a known
kind: ``gemm`` (the fixed-order GEMM, the aligned linear layers, torch's mm / addmm / bmm), ``attention``,
``norms``, ``log_softmax`` (the output layer's log-probabilities), ``optimizer``, ``compiled`` (inductor's graphs'
own loops), ``dispatch`` (the reproducible mode's Python on every operation, dynamo's guards), else ``other``
(elementwise operations of the loss, sampling and bookkeeping). Where a reproducible step's extra time goes on a CPU
kind: compare a category across modes.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
MODES = {"fast": ["model.execution=fast", "train.reproducible=false"],
         "aligned": ["model.execution=aligned", "train.reproducible=false"],
         "reproducible": ["model.execution=aligned", "train.reproducible=true"]}


# (category, pattern of profiler event names): the first that matches an event or its nearest ancestor names it
CATEGORIES = [
    ("gemm", re.compile(r"fixed_order|_AlignedLinear|aten::(mm|addmm|bmm|baddbmm|matmul|linear)$")),
    ("attention", re.compile(r"Attention|scaled_dot_product")),
    ("norms", re.compile(r"RMSNorm|rms_norm|layer_norm")),
    ("log_softmax", re.compile(r"LogSoftmax|log_softmax|Logprobs|logsumexp")),
    ("optimizer", re.compile(r"Optimizer|ExactAdamW|_foreach_")),
    ("compiled", re.compile(r"CompiledFxGraph|Torch-Compiled Region")),
    ("dispatch", re.compile(r"PythonDispatchMode|TorchDynamo Cache Lookup|Pregraph bytecode")),
]


def _category(event) -> str:
    while event is not None:
        for name, pattern in CATEGORIES:
            if pattern.search(event.name):
                return name
        event = event.cpu_parent
    return "other"


def profile_split(run) -> dict:
    """Seconds of one ``run.step()``'s CPU time by category (``CATEGORIES``), and the step's wall time."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        t0 = time.perf_counter()
        run.step()
        wall = time.perf_counter() - t0
    split = dict.fromkeys([name for name, _ in CATEGORIES] + ["other"], 0.0)
    for event in prof.events():
        split[_category(event)] += event.self_cpu_time_total / 1e6
    return {k: round(v, 4) for k, v in split.items()} | {"wall_s_profiled": round(wall, 4)}


def step_times(mode: str, args) -> dict:
    from driftless.train import Run, load_config

    cfg = load_config(REPO / "configs/demo.yaml", [
        *MODES[mode], "model.warm_start=false", "optim.lr=1e-12", f"rollout.prompts_per_step={args.prompts}",
        f"train.steps={args.steps + 1 + args.profile}", "train.eval_every=100000", "train.progress=false"])
    with tempfile.TemporaryDirectory() as tmp:
        run = Run(cfg, tmp, progress=False)
        rows = [run.step() for _ in range(args.steps + 1)][1:]
        profiled = profile_split(run) if args.profile else None
    times = {k: statistics.median(r[k] for r in rows) for k in ("rollout_s", "score_s", "loss_s", "optim_s", "step_time")}
    return times | ({"profile_s": profiled} if profiled else {})


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
    ap.add_argument("--profile", action="store_true", help="one more step of each mode under torch.profiler: profile_s")
    ap.add_argument("--no-warm-start", action="store_true", help="time the steps only")
    ap.add_argument("--modes", nargs="+", choices=list(MODES), default=list(MODES),
                    help="the modes to time (the ratios need fast, reproducible and aligned where they name them)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    steps = {mode: step_times(mode, args) for mode in args.modes}
    warm = {mode: None if args.no_warm_start else warm_start_time(mode, args) for mode in args.modes}

    def ratio(num: float | None, den: float | None) -> float | None:  # None where a mode was not timed
        return num / den if num and den else None

    step = {mode: times["step_time"] for mode, times in steps.items()}

    print(json.dumps({
        "cpu_capability": torch.backends.cpu.get_cpu_capability(), "threads": args.threads,
        "prompts": args.prompts, "steps": args.steps, "warm_steps": args.warm_steps,
        "median_seconds": steps, "warm_start_s": warm,
        "step_ratio": ratio(step.get("reproducible"), step.get("fast")),
        "step_ratio_vs_aligned": ratio(step.get("reproducible"), step.get("aligned")),
        "warm_start_ratio": ratio(warm.get("reproducible"), warm.get("fast")),
    }, indent=2))


if __name__ == "__main__":
    main()
