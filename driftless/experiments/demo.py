"""``driftless demo`` (``make demo``): pg vs tis vs sc under a severe sampler mismatch.

Warm-starts the built-in model on Countdown if needed (cached), trains each method from the
same start under ``configs/demo.yaml`` for each of ``seeds`` RL seeds (the seed drives the
prompts and the sampling; the warm start is shared), and writes ``runs/demo/report.md`` with a
summary table (mean and range over seeds) and ``runs/demo/eval_reward.png`` (held-out reward
per step per method: the mean, with the seeds' range shaded).
"""

from __future__ import annotations

import statistics
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


def run_demo(run_dir="runs/demo", *, methods=("pg", "tis", "sc"), seeds: int = 3, config_path=None, overrides=(),
             progress=True) -> Path:
    if seeds < 1:
        raise ValueError(f"seeds must be >= 1, got {seeds}")
    run_dir = Path(run_dir)
    config_path = config_path or demo_config_path()
    runs: dict[str, list[Path]] = {}
    for method in methods:
        for seed in range(seeds):
            cfg = load_config(config_path, [*overrides, f"objective.name={method}", f"train.seed={seed}"])
            path = run_dir / method / f"seed{seed}"
            runs.setdefault(method, []).append(train(cfg, path, overwrite=True, progress=progress))  # regenerable
    return write_comparison(run_dir, runs, load_config(config_path, list(overrides)))


def _spread(values: list[float], fmt: str) -> str:
    mean = statistics.fmean(values)
    if len(values) == 1:
        return format(mean, fmt)
    return f"{format(mean, fmt)} [{format(min(values), fmt)}, {format(max(values), fmt)}]"


def write_comparison(run_dir: Path, runs: dict[str, list[Path]], config) -> Path:
    fig, ax = plt.subplots(1, 2, figsize=(11, 4))
    for method, paths in runs.items():
        curves = [eval_curve(p) for p in paths]
        xs = curves[0][0]
        ys = [c[1] for c in curves]
        mean = [statistics.fmean(col) for col in zip(*ys)]
        (line,) = ax[0].plot(xs, mean, "o-", label=method)
        if len(ys) > 1:
            ax[0].fill_between(xs, [min(col) for col in zip(*ys)], [max(col) for col in zip(*ys)],
                               color=line.get_color(), alpha=0.2)
        rows = [read_metrics(p) for p in paths]
        steps = [r["step"] + 1 for r in rows[0]]
        kl = [statistics.fmean(max(run[i].get("kl_k3", 0.0), 1e-12) for run in rows) for i in range(len(steps))]
        ax[1].semilogy(steps, kl, label=method)
    ax[0].set_xlabel("step")
    ax[0].set_ylabel("held-out reward (greedy)")
    ax[0].set_ylim(-0.02, 1.02)
    ax[0].legend()
    ax[1].set_xlabel("step")
    ax[1].set_ylabel("KL(q‖p), k3, sampled tokens (mean over seeds)")
    ax[1].legend()
    n_seeds = len(next(iter(runs.values())))
    fig.suptitle(f"sampler view {config.mismatch.view!r}, staleness {config.mismatch.staleness}, {n_seeds} seed(s)")
    fig.tight_layout()
    plot = run_dir / "eval_reward.png"
    fig.savefig(plot, dpi=100)
    plt.close(fig)
    setting = (f"Countdown ({config.task.n_numbers} numbers in {config.task.min_number}–{config.task.max_number}), "
               f"warm-started TinyLM, {config.train.steps} RL steps of {config.rollout.prompts_per_step} prompts × "
               f"{config.rollout.group_size} samples, optimizer {config.optim.name} lr {config.optim.lr}, "
               f"sampler view `{config.mismatch.view}`, staleness {config.mismatch.staleness}, {n_seeds} RL seed(s): "
               "mean [min, max] over seeds. Regenerate with `make demo`.")
    header = ("| method | initial eval | final eval | best eval | final train reward | mean KL(q‖p) | max p/q | "
              "collapsed steps | s/step |")
    lines = ["# driftless demo", "", setting, "", header, "|---|---|---|---|---|---|---|---|---|"]
    for method, paths in runs.items():
        s = [summarize(p) for p in paths]

        def col(key, fmt, s=s):
            return _spread([x[key] for x in s], fmt)
        lines.append(f"| {method} | {col('initial_eval', '.3f')} | {col('final_eval', '.3f')} | "
                     f"{col('best_eval', '.3f')} | {col('final_train_reward', '.3f')} | {col('mean_kl_k3', '.2e')} | "
                     f"{col('max_ratio', '.3g')} | {col('collapsed_steps', '.0f')} | {col('mean_step_time', '.2f')} |")
    lines += ["", "![held-out reward per step](eval_reward.png)", "",
              "Per-run directories (config, metrics.jsonl, checkpoints, report, plots): "
              + ", ".join(f"[{m}/seed{i}]({m}/seed{i}/report.md)" for m, ps in runs.items() for i in range(len(ps))),
              ""]
    path = run_dir / "report.md"
    path.write_text("\n".join(lines))
    return path
