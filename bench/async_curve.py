"""Held-out reward against wall time, synchronous vs asynchronous collection; writes a PNG, prints JSON.

    .venv/bin/python bench/async_curve.py --steps 40 --latency 0.05 --out runs/async_curve

Both train configs/default.yaml for --steps steps (async with η = --staleness-bound) with the
same injected reward latency per prompt group, one after the other, and plot held-out greedy
reward at each evaluation against the wall time at which it was reached.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--latency", type=float, default=0.05, help="seconds per prompt group")
    ap.add_argument("--staleness-bound", type=int, default=1)
    ap.add_argument("--out", default="runs/async_curve")
    args = ap.parse_args()

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from driftless.train import load_config, train

    out = Path(args.out)
    curves = {}
    for mode in ("sync", "async"):
        cfg = load_config(REPO / "configs" / "default.yaml", [
            f"train.steps={args.steps}", "train.eval_every=10", f"rollout.reward_latency={args.latency}",
            "train.progress=false", f"rollout.runtime={'thread' if mode == 'async' else 'sync'}",
            *([f"rollout.staleness_bound={args.staleness_bound}"] if mode == "async" else [])])
        d = train(cfg, out / mode, overwrite=True, progress=False)
        lines = [json.loads(x) for x in (d / "metrics.jsonl").read_text().splitlines()]
        start = json.loads((d / "initial_eval.json").read_text())["eval_reward"]
        curves[mode] = [(0.0, start)] + [(r["wall_time"], r["eval_reward"]) for r in lines if "eval_reward" in r]
    fig, ax = plt.subplots(figsize=(6, 4))
    for mode, pts in curves.items():
        ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-", label=mode)
    ax.set_xlabel("wall time (s)")
    ax.set_ylabel("held-out reward (greedy)")
    ax.set_title(f"reward latency {args.latency * 1000:.0f} ms per group, η = {args.staleness_bound}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "reward_vs_wall_time.png", dpi=100)
    print(json.dumps({"curves": curves, "plot": str(out / "reward_vs_wall_time.png")}, indent=2))


if __name__ == "__main__":
    main()
