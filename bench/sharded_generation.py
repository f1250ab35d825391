"""Sharded generation under torchrun (rollout.shard_across_ranks): a step's time and its generation time; prints JSON.

    .venv/bin/python bench/sharded_generation.py                  # 2 rounds, 6 steps a run
    .venv/bin/python bench/sharded_generation.py --rounds 3 --steps 8
    .venv/bin/python bench/sharded_generation.py model.max_seq_len=160 rollout.max_new_tokens=128 rollout.ignore_eos=true
                                                  # longer responses: KEY=VALUE overrides after the default config
    .venv/bin/python bench/sharded_generation.py --config configs/smollm2.yaml --steps 4 rollout.prompts_per_step=8 \
        rollout.group_size=4 rollout.max_new_tokens=64 rollout.ignore_eos=true model.max_seq_len=128   # the real model

A generation-heavy config (the default TinyLM, not warm-started, so responses run to ``max_new_tokens``; 16 prompts
x 8 samples, 40 new tokens; rollout.draws=row everywhere, so every layout samples the same batch) trained by
``driftless train`` in four layouts, interleaved round by round on an otherwise idle machine:

- ``one_1t``: one process, one thread;
- ``ranks2_sharded``: 2 torchrun ranks x 1 thread, each generating half of the prompt groups, then gathering;
- ``ranks2_repeated``: 2 torchrun ranks x 1 thread, each generating the whole batch (the layout before sharding);
- ``one_2t``: one process, two threads.

Per layout: the median over steps (the first step of each run left out: warm-up) of ``generate_s`` (rank 0's own
decode: the batch's tokens over ``tokens_per_s``, which divides them by this rank's generation time), ``rollout_s``
(rank 0's generation, rewards and, sharded, the exchange of the shares, which waits for the slower rank),
``step_time`` and the learner's part (``step_time - rollout_s``). The ratios: sharded against
one process at one thread (goals: generation <= 0.6, step <= 0.65) and against one process at two threads (the same
two cores used otherwise: goal, throughput >= 0.9 of it, i.e. a step time ratio <= 1 / 0.9).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CONFIG = ["model.warm_start=false", "rollout.prompts_per_step=16", "rollout.group_size=8", "rollout.max_new_tokens=40",
          "rollout.draws=row", "train.eval_every=1000", "train.checkpoint_every=1000", "train.eval_problems=8"]
CONFIG_FILE = ["configs/default.yaml"]  # --config replaces it
LAYOUTS = {
    "one_1t": (1, 1, []),
    "ranks2_sharded": (2, 1, ["train.learner_ranks=2", "rollout.shard_across_ranks=true"]),
    "ranks2_repeated": (2, 1, ["train.learner_ranks=2"]),
    "one_2t": (1, 2, []),
}


def run(layout: str, steps: int, out: Path, port: int, config: list[str]) -> list[dict]:
    ranks, threads, extra = LAYOUTS[layout]
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    args = ["-m", "driftless", "train", CONFIG_FILE[0], *config, f"train.steps={steps}", *extra,
            "--run-dir", str(out), "--no-progress"]
    if ranks > 1:
        cmd = [str(Path(sys.executable).with_name("torchrun")), "--nproc-per-node", str(ranks), "--master-port",
               str(port), *args]
    else:
        cmd = [sys.executable, *args]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=REPO, check=False)
    if done.returncode != 0:
        raise SystemExit(f"{layout}: {done.stderr[-2000:]}")
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=list(LAYOUTS),
                    help="the layouts to run (default: all; the ratios need one_1t, ranks2_sharded and the rest theirs)")
    ap.add_argument("--config", default=CONFIG_FILE[0], help="the run config the layouts train (default: %(default)s)")
    ap.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="train's keys applied after the bench's config")
    args = ap.parse_args()
    config = CONFIG + args.overrides
    CONFIG_FILE[0] = args.config
    samples = {name: {"generate_s": [], "rollout_s": [], "step_time": [], "learner_s": []} for name in args.layouts}
    generated = {}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            for i, name in enumerate(args.layouts):
                lines = run(name, args.steps, Path(tmp) / f"{name}-{r}", 29600 + 10 * r + i, config)
                for line in lines[1:]:
                    samples[name]["generate_s"].append(line["tokens"] / line["tokens_per_s"])  # rank 0's decode
                    samples[name]["rollout_s"].append(line["rollout_s"])
                    samples[name]["step_time"].append(line["step_time"])
                    samples[name]["learner_s"].append(line["step_time"] - line["rollout_s"])
                if "generated_rows_max" in lines[-1]:
                    generated[name] = {"rows_per_rank": lines[-1]["generated_rows_max"],
                                       "tokens_busiest_rank": lines[-1]["generated_tokens_max"],
                                       "tokens_batch": lines[-1]["tokens"]}
    med = {name: {k: round(statistics.median(v), 4) for k, v in s.items()} for name, s in samples.items()}
    ratios = {}
    if {"one_1t", "ranks2_sharded"} <= set(med):
        one, sharded = med["one_1t"], med["ranks2_sharded"]
        ratios.update(decode_sharded_over_one_1t=round(sharded["generate_s"] / one["generate_s"], 3),
                      generation_sharded_over_one_1t=round(sharded["rollout_s"] / one["rollout_s"], 3),
                      step_sharded_over_one_1t=round(sharded["step_time"] / one["step_time"], 3))
        if "ranks2_repeated" in med:
            ratios["step_repeated_over_one_1t"] = round(med["ranks2_repeated"]["step_time"] / one["step_time"], 3)
        if "one_2t" in med:
            ratios["throughput_sharded_over_one_2t"] = round(med["one_2t"]["step_time"] / sharded["step_time"], 3)
    print(json.dumps({
        "bench": "sharded_generation", "cpu": platform.processor() or platform.machine(), "rounds": args.rounds,
        "steps": args.steps, "config_file": args.config, "config": config, "median_s": med, "generated": generated,
        "ratios": ratios}, indent=2))


if __name__ == "__main__":
    main()
