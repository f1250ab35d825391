"""Run reports and plots: ``report.md`` and ``plots/*.png`` from a run directory's metrics."""

from __future__ import annotations

import io
import json
import math
import statistics
from pathlib import Path

from driftless.train import sinks

PALETTE_COLORS = 128  # a line plot's colours, its shaded bands and their anti-aliased edges


def save_figure(fig, path, *, dpi: int = 100, **kwargs) -> Path:
    """``fig`` written to ``path`` as a palette PNG (``PALETTE_COLORS`` colours, no dithering): about a third of
    the bytes of matplotlib's RGBA PNG, the same bytes for the same figure, so that the plots committed beside
    the records keep a clone small."""
    from PIL import Image

    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=dpi, **kwargs)
    buffer.seek(0)
    image = Image.open(buffer).convert("RGB").quantize(colors=PALETTE_COLORS, dither=Image.Dither.NONE)
    image.save(path, format="PNG", optimize=True)
    return Path(path)


def spread(values, fmt: str) -> str:
    """``mean [min, max]`` of the values (NaN and None left out; the mean alone for one; "—" for none)."""
    values = [v for v in values if v is not None and not math.isnan(v)]
    if not values:
        return "—"
    mean = statistics.fmean(values)
    if len(values) == 1:
        return format(mean, fmt)
    return f"{format(mean, fmt)} [{format(min(values), fmt)}, {format(max(values), fmt)}]"


def read_metrics(run_dir: str | Path) -> list[dict]:
    """A run's metric rows, from ``metrics.jsonl`` or its packed ``metrics.jsonl.xz`` (``driftless pack``)."""
    return sinks.read_metrics(run_dir)


def initial_eval(run_dir: str | Path) -> float | None:
    path = Path(run_dir) / "initial_eval.json"
    return json.loads(path.read_text())["eval_reward"] if path.exists() else None


def eval_curve(run_dir) -> tuple[list[int], list[float]]:
    """(completed steps, eval reward), starting with the pre-training evaluation at step 0."""
    rows = read_metrics(run_dir)
    xs, ys = [], []
    first = initial_eval(run_dir)
    if first is not None:
        xs.append(0)
        ys.append(first)
    for r in rows:
        if "eval_reward" in r:
            xs.append(r["step"] + 1)
            ys.append(r["eval_reward"])
    return xs, ys


def summarize(run_dir) -> dict:
    rows = read_metrics(run_dir)
    _, ys = eval_curve(run_dir)
    tail = rows[-max(1, len(rows) // 5):]
    return {
        "steps": len(rows),
        "initial_eval": ys[0] if ys else None,
        "final_eval": ys[-1] if ys else None,
        "best_eval": max(ys) if ys else None,
        "final_train_reward": sum(r["reward"] for r in tail) / len(tail),
        "mean_kl_k3": sum(r.get("kl_k3", 0.0) for r in rows) / len(rows),
        "max_ratio": max(r.get("ratio_max", 0.0) for r in rows),
        "collapsed_steps": sum(bool(r.get("collapsed")) for r in rows),
        "skipped_steps": rows[-1].get("skipped_steps", 0),
        "mean_step_time": sum(r["step_time"] for r in rows) / len(rows),
    }


def pyplot():
    """matplotlib's pyplot, imported when a plot is drawn (a training process that has not plotted yet holds none of
    matplotlib: about 25 MB resident), on the Agg backend unless the caller imported pyplot with a backend of its
    own (a notebook's is kept)."""
    import sys

    import matplotlib

    if "matplotlib.pyplot" not in sys.modules:
        matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_run(run_dir) -> list[Path]:
    plt = pyplot()
    run_dir = Path(run_dir)
    rows = read_metrics(run_dir)
    out = run_dir / "plots"
    out.mkdir(exist_ok=True)
    steps = [r["step"] + 1 for r in rows]
    fig, ax = plt.subplots(1, 2, figsize=(10, 3.5))
    ax[0].plot(steps, [r["reward"] for r in rows], label="train reward", alpha=0.6)
    xs, ys = eval_curve(run_dir)
    ax[0].plot(xs, ys, "o-", label="eval reward")
    ax[0].set_xlabel("step")
    ax[0].set_ylim(-0.02, 1.02)
    ax[0].legend()
    ax[1].semilogy(steps, [max(r.get("kl_k3", 0.0), 1e-12) for r in rows], label="KL(q‖p) k3")
    ax[1].semilogy(steps, [max(r.get("ratio_max", 1.0), 1e-12) for r in rows], label="max p/q")
    ax[1].set_xlabel("step")
    ax[1].legend()
    fig.tight_layout()
    path = out / "training.png"
    save_figure(fig, path, dpi=100)
    plt.close(fig)
    return [path]


def write_run_report(run_dir) -> Path:
    run_dir = Path(run_dir)
    s = summarize(run_dir)
    plots = plot_run(run_dir)
    config = (run_dir / "config.yaml").read_text() if (run_dir / "config.yaml").exists() else ""
    lines = [f"# Run report: {run_dir.name}", "", "| metric | value |", "|---|---|"]
    lines += [f"| {k} | {_fmt(v)} |" for k, v in s.items()]
    lines += ["", *[f"![{p.stem}](plots/{p.name})" for p in plots], "", "## Config", "", "```yaml", config, "```"]
    path = run_dir / "report.md"
    path.write_text("\n".join(lines) + "\n")
    return path


def _fmt(v):
    if isinstance(v, float):
        return f"{v:.4g}"
    return "—" if v is None else str(v)
