"""Synchronous vs asynchronous collection at equal updates and equal samples per update; prints JSON.

    .venv/bin/python bench/async.py                       # 12 updates, reward latency 0, 50, 200 ms per group
    .venv/bin/python bench/async.py --updates 20 --latencies 0 0.2
    .venv/bin/python bench/async.py --runtime process    # the worker in a process of its own (no shared GIL)

On the built-in setup (configs/default.yaml, warm start cached), each mode trains `--updates`
steps; the reward latency (`rollout.reward_latency`, seconds per prompt group) stands in for
tool calls and verifiers. For each latency: wall time of each mode, their ratio, the idle
fractions (learner waiting for a batch, worker waiting for admission) and the ceiling
(t_gen + t_train + t_wait) / max(t_gen + t_wait, t_train) from the synchronous run's own
timings: what perfect overlap would give. Wall times are also given in steady state (from the end
of the first update to the end of the last: without the start-up of a worker process or actor and
the first-call warm-ups, which a short benchmark would otherwise mostly measure). Top-level keys:
`async_vs_sync_ratio` (at the largest latency, whole runs), `steady_async_vs_sync_ratio`,
`ceiling`, `staleness_bound`, `max_staleness_observed`.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--updates", type=int, default=12)
    ap.add_argument("--latencies", type=float, nargs="+", default=[0.0, 0.05, 0.2])
    ap.add_argument("--staleness-bound", type=int, default=1)
    ap.add_argument("--prompts", type=int, default=16)  # the worker waits latency x prompts per batch
    ap.add_argument("--runtime", choices=("thread", "process", "ray"), default="thread",
                    help="where the async worker runs: a thread, a spawned process, a Ray actor")
    ap.add_argument("--async-threads", type=int, default=0,
                    help="torch threads for the asynchronous runs (0: unchanged; the synchronous runs keep the default)")
    args = ap.parse_args()

    import torch

    from driftless.train import Run, load_config
    out: dict = {"updates": args.updates, "prompts_per_step": args.prompts, "staleness_bound": args.staleness_bound,
                 "runtime": args.runtime, "async_threads": args.async_threads or torch.get_num_threads(), "latencies": {}}
    max_seen = 0
    with tempfile.TemporaryDirectory() as tmp:
        for latency in args.latencies:
            row = {}
            for mode in ("sync", "async"):
                cfg = load_config(REPO / "configs" / "default.yaml", [
                    f"train.steps={args.updates}", f"train.eval_every={10 ** 6}", "train.checkpoint_every=1000000",
                    f"rollout.prompts_per_step={args.prompts}", f"rollout.reward_latency={latency}",
                    "train.progress=false", f"rollout.runtime={args.runtime if mode == 'async' else 'sync'}",
                    *([f"rollout.staleness_bound={args.staleness_bound}"] if mode == "async" else [])])
                run = Run(cfg, Path(tmp) / f"{mode}-{latency}", progress=False)
                threads = torch.get_num_threads()
                if mode == "async" and args.async_threads:
                    torch.set_num_threads(args.async_threads)
                t0 = time.perf_counter()
                try:
                    run.run()
                finally:
                    torch.set_num_threads(threads)
                wall = time.perf_counter() - t0
                lines = [json.loads(x) for x in (run.dir / "metrics.jsonl").read_text().splitlines()]
                row[mode] = {"wall_s": wall, "steady_wall_s": lines[-1]["wall_time"] - lines[0]["wall_time"]}
                if mode == "sync":
                    gen = statistics.fmean(r["rollout_s"] for r in lines)
                    trn = statistics.fmean(r["score_s"] + r["loss_s"] + r["optim_s"] for r in lines)
                    row["t_gen_plus_wait_s"], row["t_train_s"] = gen, trn
                    row["ceiling"] = (gen + trn) / max(gen, trn)
                else:  # how much slower each side runs while the other runs beside it (shared cores, the GIL)
                    row[mode]["t_train_s"] = statistics.fmean(r["score_s"] + r["loss_s"] + r["optim_s"] for r in lines)
                    row[mode]["t_gen_plus_wait_s"] = statistics.fmean(r["rollout_s"] for r in lines)
                    row[mode]["learner_idle_fraction"] = lines[-1]["learner_wait_s"] / wall
                    if "worker_wait_s" in lines[-1]:  # measured on the thread runtime
                        row[mode]["worker_idle_fraction"] = lines[-1]["worker_wait_s"] / wall
                    seen = max(r["staleness_max"] for r in lines)
                    row[mode]["max_staleness"] = seen
                    max_seen = max(max_seen, seen)
            row["async_vs_sync_ratio"] = row["sync"]["wall_s"] / row["async"]["wall_s"]
            row["fraction_of_ceiling"] = row["async_vs_sync_ratio"] / row["ceiling"]
            row["steady_async_vs_sync_ratio"] = row["sync"]["steady_wall_s"] / row["async"]["steady_wall_s"]
            row["train_slowdown_when_overlapped"] = row["async"]["t_train_s"] / row["t_train_s"]
            row["generation_slowdown_when_overlapped"] = row["async"]["t_gen_plus_wait_s"] / row["t_gen_plus_wait_s"]
            row["steady_fraction_of_ceiling"] = row["steady_async_vs_sync_ratio"] / row["ceiling"]
            out["latencies"][str(latency)] = row
    last = out["latencies"][str(args.latencies[-1])]
    out["async_vs_sync_ratio"] = last["async_vs_sync_ratio"]
    out["steady_async_vs_sync_ratio"] = last["steady_async_vs_sync_ratio"]
    out["ceiling"] = last["ceiling"]
    out["max_staleness_observed"] = max_seen
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
