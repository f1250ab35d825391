"""``driftless demo`` (``make demo``): pg vs tis vs sc under a severe sampler mismatch.

Warm-starts the built-in model on Countdown if needed (cached), trains each method from the
same start with the same seeds under ``configs/demo.yaml``, and writes ``runs/demo/report.md``
with a summary table and ``runs/demo/eval_reward.png`` (held-out reward per step per method).
"""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

from driftless.experiments.report import eval_curve, read_metrics, summarize
from driftless.train import load_config, train

REPO_CONFIGS = Path(__file__).resolve().parents[2] / "configs"


def demo_config_path() -> Path | None:
    path = REPO_CONFIGS / "demo.yaml"
    return path if path.exists() else None


def run_demo(run_dir="runs/demo", *, methods=("pg", "tis", "sc"), config_path=None, overrides=(),
             progress=True) -> Path:
    run_dir = Path(run_dir)
    config_path = config_path or demo_config_path()
    runs = {}
    for method in methods:
        cfg = load_config(config_path, [*overrides, f"objective.name={method}"])
        runs[method] = train(cfg, run_dir / method, overwrite=True, progress=progress)  # regenerable
    return write_comparison(run_dir, runs, load_config(config_path, list(overrides)))


def write_comparison(run_dir: Path, runs: dict, config) -> Path:
    fig, ax = plt.subplots(1, 2, figsize=(11, 4))
    for method, path in runs.items():
        xs, ys = eval_curve(path)
        ax[0].plot(xs, ys, "o-", label=method)
        rows = read_metrics(path)
        ax[1].semilogy([r["step"] + 1 for r in rows], [max(r.get("kl_k3", 0.0), 1e-12) for r in rows], label=method)
    ax[0].set_xlabel("step")
    ax[0].set_ylabel("held-out reward (greedy)")
    ax[0].set_ylim(-0.02, 1.02)
    ax[0].legend()
    ax[1].set_xlabel("step")
    ax[1].set_ylabel("KL(q‖p), k3, sampled tokens")
    ax[1].legend()
    title = f"sampler view {config.mismatch.view!r}, staleness {config.mismatch.staleness}"
    fig.suptitle(title)
    fig.tight_layout()
    plot = run_dir / "eval_reward.png"
    fig.savefig(plot, dpi=100)
    plt.close(fig)
    setting = (f"Countdown ({config.task.n_numbers} numbers in {config.task.min_number}–{config.task.max_number}), "
               f"warm-started TinyLM, {config.train.steps} RL steps of {config.rollout.prompts_per_step} prompts × "
               f"{config.rollout.group_size} samples, optimizer {config.optim.name} lr {config.optim.lr}, "
               f"sampler view `{config.mismatch.view}`, staleness {config.mismatch.staleness}. "
               "Regenerate with `make demo`.")
    header = ("| method | initial eval | final eval | best eval | final train reward | mean KL(q‖p) | max p/q | "
              "collapsed steps | skipped | s/step |")
    lines = ["# driftless demo", "", setting, "", header, "|---|---|---|---|---|---|---|---|---|---|"]
    for method, path in runs.items():
        s = summarize(path)
        lines.append(f"| {method} | {s['initial_eval']:.3f} | {s['final_eval']:.3f} | {s['best_eval']:.3f} | "
                     f"{s['final_train_reward']:.3f} | {s['mean_kl_k3']:.2e} | {s['max_ratio']:.3g} | "
                     f"{s['collapsed_steps']} | {s['skipped_steps']} | {s['mean_step_time']:.2f} |")
    lines += ["", "![held-out reward per step](eval_reward.png)", "",
              "Per-method runs (config, metrics.jsonl, checkpoints, report, plots): "
              + ", ".join(f"[{m}]({m}/report.md)" for m in runs), ""]
    path = run_dir / "report.md"
    path.write_text("\n".join(lines))
    return path
