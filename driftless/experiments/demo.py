"""``driftless demo`` (``make demo``): the no-mismatch baseline, then pg vs tis vs sc under mismatch.

Warm-starts the built-in model if needed (cached, once, before any run), then trains each
method from the same start under ``configs/demo.yaml`` for each of ``seeds`` RL seeds (the seed
drives the prompts and the sampling; the warm start is shared). ``baseline`` is pg with the
mismatch view switched off: the learning curve every correction is read against. Runs go to
``workers`` processes at once (one BLAS thread each, so every run is bit-reproducible whatever
the worker count). Writes ``runs/demo/report.md`` (summary table: mean and range over seeds of
final / best held-out reward, area under the curve, steps to a threshold) and
``runs/demo/eval_reward.png`` (held-out reward per step per method, seeds' range shaded).
"""

from __future__ import annotations

import os
import statistics
from concurrent.futures import ProcessPoolExecutor, as_completed
from multiprocessing import get_context
from pathlib import Path

import matplotlib
from tqdm import tqdm

matplotlib.use("Agg")
import matplotlib.pyplot as plt

from driftless.experiments.report import eval_curve, read_metrics, summarize, write_run_report
from driftless.train import load_config, train

REPO_CONFIGS = Path(__file__).resolve().parents[2] / "configs"
METHODS = ("baseline", "pg", "tis", "sc")


def demo_config_path() -> Path | None:
    path = REPO_CONFIGS / "demo.yaml"
    return path if path.exists() else None


def method_overrides(method: str) -> list[str]:
    """``baseline``: pg without the sampler's mismatch view; anything else: that objective preset."""
    if method == "baseline":
        return ["objective.name=pg", "mismatch.view=none", "mismatch.staleness=0"]
    return [f"objective.name={method}"]


def _train_one(config_path, overrides, path, threads: int) -> str:
    import torch

    torch.set_num_threads(threads)
    cfg = load_config(config_path, overrides)
    run_dir = train(cfg, path, overwrite=True, progress=False)  # regenerable: a demo overwrites
    write_run_report(run_dir)
    return str(run_dir)


def run_demo(run_dir="runs/demo", *, methods=METHODS, seeds: int = 3, config_path=None, overrides=(),
             progress=True, workers: int | None = None) -> Path:
    if seeds < 1:
        raise ValueError(f"seeds must be >= 1, got {seeds}")
    workers = workers or min(2, os.cpu_count() or 1)
    if workers < 1:
        raise ValueError(f"workers must be >= 1, got {workers}")
    run_dir = Path(run_dir)
    config_path = config_path or demo_config_path()
    base = load_config(config_path, list(overrides))
    _prepare_warm_start(base, progress)  # once, here: the workers only read the cache
    jobs = {(m, seed): ([*overrides, *method_overrides(m), f"train.seed={seed}"], run_dir / m / f"seed{seed}")
            for m in methods for seed in range(seeds)}
    train_many(config_path, list(jobs.values()), workers=workers, progress=progress, desc="demo")
    runs = {m: [jobs[(m, seed)][1] for seed in range(seeds)] for m in methods}
    return write_comparison(run_dir, runs, base)


def train_many(config_path, jobs: list[tuple[list[str], Path]], *, workers: int, progress: bool = True,
               desc: str = "runs") -> None:
    """Train ``(overrides, run_dir)`` jobs, ``workers`` at a time, each with its share of the CPU threads."""
    threads = max(1, (os.cpu_count() or 1) // workers)
    bar = tqdm(total=len(jobs), desc=f"{desc} ({workers} worker(s))", disable=not progress)
    if workers == 1:
        for ov, path in jobs:
            _train_one(config_path, ov, path, threads)
            bar.update()
    else:
        with ProcessPoolExecutor(workers, mp_context=get_context("spawn")) as pool:
            futures = [pool.submit(_train_one, config_path, ov, path, threads) for ov, path in jobs]
            for f in as_completed(futures):
                f.result()
                bar.update()
    bar.close()


def _prepare_warm_start(config, progress: bool) -> None:
    if config.model.kind != "tiny" or not config.model.warm_start:
        return
    from driftless.tasks import CharTokenizer
    from driftless.train.factory import initial_state

    initial_state(config, CharTokenizer(), progress)


def _spread(values: list[float], fmt: str) -> str:
    mean = statistics.fmean(values)
    if len(values) == 1:
        return format(mean, fmt)
    return f"{format(mean, fmt)} [{format(min(values), fmt)}, {format(max(values), fmt)}]"


def _threshold(curves: dict) -> float:
    """Halfway from the mean initial eval to the baseline's (else the first method's) mean final eval."""
    ref = curves.get("baseline") or next(iter(curves.values()))
    start = statistics.fmean(ys[0] for _, ys in ref)
    end = statistics.fmean(ys[-1] for _, ys in ref)
    return start + 0.5 * (end - start)


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
    fig.suptitle(f"baseline: no mismatch; others: sampler view {config.mismatch.view!r}, "
                 f"staleness {config.mismatch.staleness}; {n_seeds} seed(s)")
    fig.tight_layout()
    plot = run_dir / "eval_reward.png"
    fig.savefig(plot, dpi=100)
    plt.close(fig)
    setting = (f"Countdown ({config.task.n_numbers} numbers in {config.task.min_number}–{config.task.max_number}), "
               f"warm-started TinyLM, {config.train.steps} RL steps of {config.rollout.prompts_per_step} prompts × "
               f"{config.rollout.group_size} samples, rewards `{config.objective.reward_mode}`, advantage "
               f"`{config.objective.advantage}`, optimizer {config.optim.name} lr {config.optim.lr}; baseline without "
               f"mismatch, the others with sampler view `{config.mismatch.view}`, staleness "
               f"{config.mismatch.staleness}; {n_seeds} RL seed(s): mean [min, max] over seeds. "
               "Regenerate with `make demo`.")
    curves = {m: [eval_curve(p) for p in paths] for m, paths in runs.items()}
    threshold = _threshold(curves)
    header = ("| method | initial eval | final eval | best eval | AUC (mean eval) | steps to threshold | "
              "final train reward | mean KL(q‖p) | max p/q | s/step |")
    lines = ["# driftless demo", "", setting, "",
             (f"Threshold: {threshold:.3f}, halfway from the initial held-out reward to the baseline's mean final "
              "one (steps: the first evaluation at or above it; runs that never reach it count as the run length "
              "and are marked 'never')."),
             "", header, "|---|---|---|---|---|---|---|---|---|---|"]
    for method, paths in runs.items():
        s = [summarize(p) for p in paths]
        for x, (xs, ys) in zip(s, curves[method]):
            x["auc"] = statistics.fmean(ys)
            x["to_threshold"] = next((step for step, y in zip(xs, ys) if y >= threshold), None)

        def col(key, fmt, s=s):
            return _spread([x[key] for x in s], fmt)
        reached = [x["to_threshold"] for x in s]
        to_thr = _spread([r if r is not None else x["steps"] for r, x in zip(reached, s)], ".0f")
        to_thr += "" if all(r is not None for r in reached) else f" ({sum(r is None for r in reached)} never)"
        lines.append(f"| {method} | {col('initial_eval', '.3f')} | {col('final_eval', '.3f')} | "
                     f"{col('best_eval', '.3f')} | {col('auc', '.3f')} | {to_thr} | {col('final_train_reward', '.3f')} | "
                     f"{col('mean_kl_k3', '.2e')} | {col('max_ratio', '.3g')} | {col('mean_step_time', '.2f')} |")
    lines += ["", "![held-out reward per step](eval_reward.png)", "",
              "Per-run directories (config, metrics.jsonl, checkpoints, report, plots): "
              + ", ".join(f"[{m}/seed{i}]({m}/seed{i}/report.md)" for m, ps in runs.items() for i in range(len(ps))),
              ""]
    path = run_dir / "report.md"
    path.write_text("\n".join(lines))
    return path
