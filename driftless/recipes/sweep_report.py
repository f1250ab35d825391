"""``driftless report SWEEP_DIR``: one table and plots across a sweep's runs, grouped by grid keys.

Every number is recomputed from the run directories (``metrics.jsonl``, ``initial_eval.json``).
Runs are grouped by every grid key except the seeds (``train.seed``, ``warm_start.seed``), or by
the keys given; each cell is the mean over a group's runs with their range ``[min, max]``.

Definitions (docs/diagnostics.md):

- **AUC**: the mean of a run's held-out evaluations, the initial one included.
- **steps to threshold**: the first evaluation at or above the threshold, halfway from the mean
  initial held-out reward to the reference group's mean final one (the reference: the
  experiment's ``reference`` when it has one, else the group with ``mismatch.view=none`` if there
  is one, else the group with the best mean final reward); runs that never reach it count as
  their length and are marked.
- **collapse step**: the first evaluation below the run's initial held-out reward minus
  ``COLLAPSE_MARGIN`` after which no evaluation recovers above that line; "—" if none.
- **Δ vs the reference** pairs a run with the reference run of the same seeds *and the same initial
  model* (the warm start's weight digest, or its held-out reward in records older than the digest):
  a warm start recomputed on another CPU is another model. A run whose seeds' reference started
  elsewhere is still compared, marked † and named under the table.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

from driftless.recipes.sweep import SEED_KEYS, recorded_start
from driftless.train.report import eval_curve, read_metrics, save_figure, spread
from driftless.train.sinks import has_record

COLLAPSE_MARGIN = 0.05
LEVEL = 0.95  # the paired intervals' coverage
PHASE = 0.2  # the drift table's early and late phases: the first and the last fifth of a run's steps
# The per-step columns a sweep report and the study's index read from a run's metrics (``summarize_run``, the
# drift table, the plots; ``study.run_seconds``): what a record committed to git keeps (``driftless pack --slim``),
# the rest of each line staying in the run's own directory (and TensorBoard / W&B) where it was trained.
RECORD_COLUMNS = ("step", "eval_reward", "kl_k3", "renyi_d2", "ratio_p99", "eq1_movement_abs", "eq1_disagreement_abs",
                  "masked_fraction", "tokens_per_s", "stale_rows_dropped", "wall_time")
DRIFT_KEYS = (("kl_k3", "KL(q‖p)", ".2e"), ("eq1_movement_abs", "Eq. 1 mean abs movement", ".2e"),
              ("eq1_disagreement_abs", "Eq. 1 mean abs disagreement", ".2e"), ("ratio_p99", "p99 p/q", ".3g"))
# movement is lag's share of Eq. 1 (weights moved since the sample), disagreement the sampler's own numerics


def early_late(rows: list[dict], key: str, phase: float = PHASE) -> tuple[float, float]:
    """Mean of ``key`` over the first and over the last ``phase`` of a run's steps (at least one step each):
    whether a mismatch measure grows while the run trains (drift accumulating) or holds still."""
    vals = [r[key] for r in rows if key in r]
    if not vals:
        return float("nan"), float("nan")
    n = max(1, round(len(vals) * phase))
    return statistics.fmean(vals[:n]), statistics.fmean(vals[-n:])


def paired_interval(deltas: list[float], level: float = LEVEL) -> tuple[float, float, float] | None:
    """Mean of per-seed paired differences and its Student-t interval over the seeds (``level`` coverage,
    n − 1 degrees of freedom): ``(mean, low, high)``; None for fewer than two pairs. With 3 to 5 seeds a
    bootstrap over seeds has too few distinct resamples to give an interval; t assumes the differences are
    roughly normal, which is what there is to assume with so few."""
    from scipy import stats

    if len(deltas) < 2:
        return None
    mean = statistics.fmean(deltas)
    half = stats.t.ppf(0.5 + level / 2, len(deltas) - 1) * statistics.stdev(deltas) / len(deltas) ** 0.5
    return mean, mean - half, mean + half


def separation(interval: tuple[float, float, float] | None) -> str:
    """``above`` / ``below`` when the interval excludes zero on that side, ``no`` when it holds zero."""
    if interval is None:
        return "— (one pair)"
    _, low, high = interval
    return "above" if low > 0 else "below" if high < 0 else "no"


def _interval_cell(interval, n: int) -> str:
    if interval is None:
        return "—"
    mean, low, high = interval
    return f"{mean:+.3f} [{low:+.3f}, {high:+.3f}] ({n})"


def collapse_step(xs: list[int], ys: list[float], margin: float = COLLAPSE_MARGIN) -> int | None:
    """The first evaluation step below ``ys[0] − margin`` never followed by one at or above it."""
    line = ys[0] - margin
    step = None
    for x, y in zip(xs[1:], ys[1:]):
        if y < line:
            step = x if step is None else step
        else:
            step = None
    return step


def run_row(run_dir: Path) -> dict:
    rows = read_metrics(run_dir)
    xs, ys = eval_curve(run_dir)

    def mean(key):
        vals = [r[key] for r in rows if key in r]
        return statistics.fmean(vals) if vals else float("nan")
    return {
        "curve": (xs, ys), "rows": rows, "digest": recorded_start(Path(run_dir)),  # which initial model
        "initial": ys[0], "final": ys[-1], "best": max(ys), "auc": statistics.fmean(ys),
        "collapse": collapse_step(xs, ys), "steps": len(rows),
        "kl": mean("kl_k3"), "d2": mean("renyi_d2"), "p99": mean("ratio_p99"),
        "movement": mean("eq1_movement_abs"), "disagreement": mean("eq1_disagreement_abs"),
        "masked": mean("masked_fraction"), "stale": rows[-1].get("stale_rows_dropped", 0),
        "wall": rows[-1].get("wall_time", float("nan")), "tokens_per_s": mean("tokens_per_s"),
    }


def find_runs(sweep_dir: Path) -> tuple[dict[str, dict], list[str], list[str]]:
    """(``{trial: values}`` of the runs found, grid keys, problems): from ``sweep.json`` when there is one."""
    sweep_dir = Path(sweep_dir)
    if not sweep_dir.is_dir():
        raise ValueError(f"{sweep_dir} is not a directory")
    spec = sweep_dir / "sweep.json"
    problems = []
    if spec.exists():
        data = json.loads(spec.read_text())
        keys = (["variant"] if data.get("variants") or data.get("reference") is not None else []) + list(data["grid"])
        runs = {}
        for name, trial in data["trials"].items():
            if (sweep_dir / name / "done.json").exists():
                runs[name] = trial["values"]
            elif has_record(sweep_dir / name):
                steps = len(read_metrics(sweep_dir / name))
                problems.append(f"{name}: unfinished ({steps} steps so far)")
            else:
                problems.append(f"{name}: no metrics.jsonl (not run yet, or failed before its first step)")
        return runs, keys, problems
    runs = {p.name: {"run": p.name} for p in sorted(sweep_dir.iterdir())
            if p.is_dir() and has_record(p) and (p / "config.yaml").exists()}
    if not runs:
        others = sorted(p.name for p in sweep_dir.iterdir())[:8]
        raise ValueError(f"{sweep_dir} holds no runs: no sweep.json and no subfolder with config.yaml and "
                         f"metrics.jsonl (found: {', '.join(others) or 'nothing'})")
    return runs, ["run"], problems


def same_start(a: dict, b: dict) -> bool:
    """Did two runs start from the same model? The warm start's weight digest where both records have one
    (newer runs), else their initial held-out reward (records older than the digest)."""
    if a["digest"] and b["digest"]:
        return a["digest"] == b["digest"]
    return a["initial"] == b["initial"]


def reference_runs(sweep_dir: Path) -> list[dict]:
    """The rows of a sweep's ``reference`` runs (its experiment's no-mismatch reference), with their seeds."""
    runs, _, _ = find_runs(Path(sweep_dir))
    rows = []
    for name, values in runs.items():
        if values.get("variant") == "reference":
            row = run_row(Path(sweep_dir) / name)
            row["seeds"], row["name"] = tuple(values.get(k) for k in SEED_KEYS), f"{Path(sweep_dir).name}/{name}"
            rows.append(row)
    if not rows:
        raise ValueError(f"report --references {sweep_dir}: that sweep has no finished reference run")
    return rows


def group_runs(sweep_dir, by: list[str] | None = None) -> tuple[dict[str, list[dict]], dict[str, tuple], list[str],
                                                               str, list[str]]:
    """A sweep's finished runs grouped by the keys ``by`` (default: every grid key but the seeds):
    ``(groups {label: run rows}, group_values {label: the keys' values}, by, the reference group's label,
    problems)``. The reference: the experiment's ``reference`` variant, else the group with
    ``mismatch.view=none``, else the group with the best mean final reward."""
    sweep_dir = Path(sweep_dir)
    runs, keys, problems = find_runs(sweep_dir)
    if not runs:
        raise ValueError(f"{sweep_dir}: none of the sweep's trials has run yet ({len(problems)} listed)")
    by = by or [k for k in keys if k not in SEED_KEYS] or keys
    unknown = [k for k in by if k not in keys]
    if unknown:
        raise ValueError(f"report --by {unknown[0]!r}: not a grid key of this sweep ({', '.join(keys)})")
    groups: dict[str, list[dict]] = {}
    group_values: dict[str, tuple] = {}
    reference = None
    for name, values in runs.items():
        label = ", ".join("—" if values.get(k) is None else f"{values.get(k)}" for k in by)
        group_values[label] = tuple(values.get(k) for k in by)
        row = run_row(sweep_dir / name)
        row["seeds"], row["name"] = tuple(values.get(k) for k in SEED_KEYS), name
        groups.setdefault(label, []).append(row)
        if values.get("variant") == "reference":
            reference = label
    ref = reference if "variant" in by else None
    ref = ref or next((g for g, rs in groups.items() if "none" in g.split(", ") and "mismatch.view" in by), None)
    ref = ref or max(groups, key=lambda g: statistics.fmean(r["final"] for r in groups[g]))
    return groups, group_values, by, ref, problems


def shown(path) -> str:
    """``path`` as a command written into a report shows it: relative to the working directory when it is
    under it (the study passes resolved paths; a report committed with /home/... in it regenerates nowhere)."""
    try:
        return str(Path(path).resolve().relative_to(Path.cwd().resolve()))
    except ValueError:
        return str(path)


def write_sweep_report(sweep_dir, by: list[str] | None = None, references=(), pairs=()) -> Path:
    """The sweep's table and plots; ``references``: other sweeps whose reference runs a run pairs with
    when they started from its initial model and the sweep's own reference of its seeds did not; ``pairs``:
    ``(A, B)`` group labels compared seed by seed (a table of A − B)."""
    sweep_dir = Path(sweep_dir)
    outside = [row for other in references for row in reference_runs(Path(other))]
    def shell(word: str) -> str:
        return f"'{word}'" if any(c in word for c in " ,") else word
    command = (f"driftless report {shown(sweep_dir)}" + (f" --by {' '.join(by)}" if by else "")
               + (f" --references {' '.join(shown(r) for r in references)}" if references else "")
               + (" --pairs " + " ".join(shell(p if isinstance(p, str) else ":".join(p)) for p in pairs)
                  if pairs else ""))
    groups, group_values, by, ref, problems = group_runs(sweep_dir, by)
    pairs = [split_pair(p, groups, sweep_dir, by) if isinstance(p, str) else tuple(p) for p in pairs]
    for label in (x for pair in pairs for x in pair):
        if label not in groups:
            raise ValueError(f"report --pairs: no group {label!r} in {sweep_dir} (groups by {', '.join(by)}: "
                             f"{', '.join(groups)})")
    runs = [r for rs in groups.values() for r in rs]
    start = statistics.fmean(r["initial"] for rs in groups.values() for r in rs)
    threshold = start + 0.5 * (statistics.fmean(r["final"] for r in groups[ref]) - start)
    lines = [f"# Sweep report: {sweep_dir.name}", "",
             (f"{len(runs)} runs in {len(groups)} groups by {', '.join(by)}; mean [min, max] over each group's runs. "
             f"Threshold {threshold:.3f} (halfway from the mean initial held-out reward to `{ref}`'s mean final); "
             f"collapse: held-out reward below its start − {COLLAPSE_MARGIN} for good. Regenerate with "
             f"`{command}`."), "",
             (f"Δ vs `{ref}`: final held-out reward minus that of the `{ref}` run with the same seeds; "
              "how many runs end below it."), "",
             (f"| {' / '.join(by)} | runs | final eval | Δ vs `{ref}` | best eval | AUC | steps to threshold | "
              "collapse step | mean KL(q‖p) | mean D2 | mean p99 p/q | Eq. 1 mean abs movement / disagreement | "
              "stale rows dropped | masked fraction | wall s | tokens/s |"),
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    ref_by_seeds = {r["seeds"]: r for r in groups[ref]}
    if len(ref_by_seeds) != len(groups[ref]):  # the reference group pools runs of the same seeds: no pairing
        ref_by_seeds = {}
    candidates = [*groups[ref], *outside] if ref_by_seeds else []  # the sweep's own reference first
    paired_outside = set()
    elsewhere = []  # (run, its start, the reference's start): compared across two initial models
    paired: dict[str, list[float]] = {}  # per group: the per-seed differences from the reference
    for label, rs in groups.items():
        deltas, crossed = [], 0
        for r in rs:
            match = next((c for c in candidates if c["seeds"] == r["seeds"] and same_start(c, r)), None)
            if match is not None:
                deltas.append(r["final"] - match["final"])
                paired[label] = [*paired.get(label, []), r["final"] - match["final"]]
                if match is not ref_by_seeds[r["seeds"]]:
                    paired_outside.add(r["name"])
            elif r["seeds"] in ref_by_seeds:
                other = ref_by_seeds[r["seeds"]]
                deltas.append(r["final"] - other["final"])
                crossed += 1
                elsewhere.append((r["name"], r["initial"], other["initial"]))
        delta = "—" if label == ref or not deltas else (
            f"{spread(deltas, '+.3f')} ({sum(d < 0 for d in deltas)} of {len(deltas)} below)"
            + (f" † {crossed}" if crossed else ""))
        reached = [next((x for x, y in zip(*r["curve"]) if y >= threshold), None) for r in rs]
        to_thr = spread([x if x is not None else r["steps"] for x, r in zip(reached, rs)], ".0f")
        never = sum(x is None for x in reached)
        to_thr += f" ({never} never)" if never else ""
        collapsed = [r["collapse"] for r in rs if r["collapse"] is not None]
        col = f"{spread(collapsed, '.0f')} ({len(collapsed)} of {len(rs)})" if collapsed else "—"
        lines.append(
            f"| {label} | {len(rs)} | {spread([r['final'] for r in rs], '.3f')} | {delta} | "
            f"{spread([r['best'] for r in rs], '.3f')} | {spread([r['auc'] for r in rs], '.3f')} | {to_thr} | "
            f"{col} | {spread([r['kl'] for r in rs], '.2e')} | {spread([r['d2'] for r in rs], '.2e')} | "
            f"{spread([r['p99'] for r in rs], '.3g')} | {spread([r['movement'] for r in rs], '.1e')} / "
            f"{spread([r['disagreement'] for r in rs], '.1e')} | {spread([r['stale'] for r in rs], '.0f')} | "
            f"{spread([r['masked'] for r in rs], '.3f')} | {spread([r['wall'] for r in rs], '.0f')} | "
            f"{spread([r['tokens_per_s'] for r in rs], '.0f')} |")
    lines += _paired_table(groups, group_values, by, ref, paired)
    lines += _pairs_table(groups, pairs)
    lines += _seed_table(groups) + _seed_table(groups, "best")
    lines += _drift_table(groups, ref)
    if paired_outside:
        lines += ["", (f"{len(paired_outside)} runs started from another initial model than the `{ref}` run of their "
                       f"seeds and are paired with the reference run of their seeds and initial model from "
                       f"{', '.join(f'`{Path(o)}`' for o in references)}: {', '.join(sorted(paired_outside))}.")]
    if elsewhere:
        lines += ["", (f"† {len(elsewhere)} runs started from another initial model than the `{ref}` run of their "
                       "seeds (a warm start recomputed elsewhere: its weights differ): their Δ compares two starting "
                       "points. Initial held-out reward, the run's / the reference's:"), "",
                  *[f"- {name}: {mine:.3f} / {theirs:.3f}" for name, mine, theirs in elsewhere]]
    if problems:
        lines += ["", "Not in the table:", "", *[f"- {p}" for p in problems]]
    plots = _plots(sweep_dir / "plots", groups)
    if len(by) >= 2:
        plots.append(_panels(sweep_dir / "plots", groups, group_values, ref, by))
    lines += ["", *[f"![{p.stem}](plots/{p.name})" for p in plots], ""]
    out = sweep_dir / "report.md"
    out.write_text("\n".join(lines))
    return out


def pg_partner(group_values: dict[str, tuple], by: list[str], label: str) -> str | None:
    """The group that differs from ``label`` only in its method (``variant`` or ``objective.name``), which is pg."""
    method = next((i for i, k in enumerate(by) if k in ("variant", "objective.name")), None)
    if method is None:
        return None
    mine = group_values[label]
    return next((g for g, v in group_values.items() if v[method] == "pg" and g != label
                 and all(x == y for i, (x, y) in enumerate(zip(v, mine)) if i != method)), None)


def partners(runs: list[dict], others: list[dict]) -> list[tuple[dict, dict]]:
    """Each run with the run in ``others`` of the same seeds and initial model, where there is one."""
    by_seeds = {r["seeds"]: r for r in others}
    return [(r, by_seeds[r["seeds"]]) for r in runs if r["seeds"] in by_seeds and same_start(by_seeds[r["seeds"]], r)]


def paired_deltas(runs: list[dict], others: list[dict], key: str = "final") -> list[float]:
    """Final held-out reward (or ``key``: ``auc``) of each run minus that of the run in ``others`` with the same
    seeds and initial model."""
    return [r[key] - other[key] for r, other in partners(runs, others)]


def _paired_table(groups: dict[str, list[dict]], group_values: dict[str, tuple], by: list[str], ref: str,
                  paired: dict[str, list[float]]) -> list[str]:
    """Per group: the per-seed differences of final held-out reward from the reference run of the same seeds
    and initial model, and from the pg run of the same seeds and other keys (where the sweep has pg), each
    with its mean, a Student-t interval over the seeds and whether the interval excludes zero."""
    rows = []
    for label, rs in groups.items():
        if label == ref:
            continue
        vs_ref = paired.get(label, [])
        partner = pg_partner(group_values, by, label)
        vs_pg = paired_deltas(rs, groups[partner]) if partner is not None else []
        auc = paired_deltas(rs, groups[ref], "auc")
        ref_i, pg_i, auc_i = paired_interval(vs_ref), paired_interval(vs_pg), paired_interval(auc)
        rows.append(f"| {label} | {_interval_cell(ref_i, len(vs_ref))} | {separation(ref_i)} | "
                    + (f"{_interval_cell(pg_i, len(vs_pg))} | {separation(pg_i)} | " if partner else "— | — | ")
                    + f"{_interval_cell(auc_i, len(auc))} | {separation(auc_i) if auc else '—'} |")
    if not rows:
        return []
    return ["", (f"Paired differences of final held-out reward, per seed: mean [{LEVEL:.0%} Student-t interval over "
                 f"the seeds] (pairs). *Separates*: the interval excludes zero (above / below); *no*: it holds zero. "
                 f"The last two columns pair the AUC (the mean of the run's held-out evaluations): a run that dips and "
                 f"recovers before its last evaluation shows there, not in its final reward."),
            "", f"| {' / '.join(by)} | Δ vs `{ref}` | separates | Δ vs pg | separates | Δ AUC vs `{ref}` | separates |",
            "|---|---|---|---|---|---|---|", *rows]


def split_pair(text: str, groups, sweep_dir, by) -> tuple[str, str]:
    """``A:B`` into two group labels; labels may hold colons themselves (``pg, noise:0.3``), so the split is the
    one colon at which both sides are groups of the sweep."""
    splits = [(text[:i], text[i + 1:]) for i, c in enumerate(text) if c == ":"]
    known = [(a, b) for a, b in splits if a in groups and b in groups]
    if len(known) == 1:
        return known[0]
    if not splits:
        raise ValueError(f"report --pairs: {text!r} is not A:B (two group labels, e.g. pg+replay:tis)")
    raise ValueError(f"report --pairs: {text!r} does not split into two groups of {sweep_dir} (groups by "
                     f"{', '.join(by)}: {', '.join(groups)})")


# A run without a mismatch logs KL(q‖p) at rounding level (fast execution: about 1e-13 a token); a ratio over it
# says nothing, so a pair against such a run shows "—" in the KL column.
NO_MISMATCH_KL = 1e-9


def _pairs_table(groups: dict[str, list[dict]], pairs) -> list[str]:
    """``--pairs A:B``: per pair of groups, A − B seed by seed (same seeds, same initial model): final held-out
    reward and AUC with their Student-t intervals, and the ratio of the runs' mean KL(q‖p), A's over B's."""
    rows = []
    for a, b in pairs:
        final, auc = paired_deltas(groups[a], groups[b]), paired_deltas(groups[a], groups[b], "auc")
        kl = [r["kl"] / other["kl"] for r, other in partners(groups[a], groups[b]) if other["kl"] > NO_MISMATCH_KL]
        fi, ai = paired_interval(final), paired_interval(auc)
        rows.append(f"| {a} − {b} | {_interval_cell(fi, len(final))} | {separation(fi) if final else '—'} | "
                    f"{_interval_cell(ai, len(auc))} | {separation(ai) if auc else '—'} | "
                    f"{', '.join(f'{x:.2f}' for x in kl) or '—'} |")
    if not rows:
        return []
    return ["", (f"Pairs asked for (`--pairs A:B`): A − B seed by seed, mean [{LEVEL:.0%} Student-t interval over "
                 "the seeds] (pairs); the last column is each seed's mean KL(q‖p) of A's run over B's (— where B has no "
                 "mismatch: its KL is rounding)."),
            "", "| pair | Δ final | separates | Δ AUC | separates | KL A / B per seed |", "|---|---|---|---|---|---|",
            *rows]


def compare_sweeps(sweeps: list, labels: list[str] | None = None, by: list[str] | None = None) -> str:
    """``driftless compare A B …``: the same groups (methods) of several sweeps side by side — each sweep's paired
    Δ vs its own reference and vs its own pg (mean [Student-t interval over its seeds], whether it separates),
    and how many runs collapsed — with a last column saying whether every sweep gives the same verdicts
    (the separations vs the reference and vs pg). For one comparison rerun under another setting (an optimizer,
    a run length): do the verdicts change?"""
    sweeps = [Path(x) for x in sweeps]
    labels = list(labels or [x.name for x in sweeps])
    if len(labels) != len(sweeps):
        raise ValueError(f"compare --labels: {len(labels)} labels for {len(sweeps)} sweeps")
    if len(sweeps) < 2:
        raise ValueError("compare: name at least two sweep directories")
    read = [group_runs(x, by) for x in sweeps]
    order = [g for g in read[0][0] if all(g in groups for groups, *_ in read)]
    if not order:
        raise ValueError(f"compare: no group is in every sweep ({', '.join(map(str, sweeps))})")
    head = "| group | " + " | ".join(f"{lab}: Δ vs reference | {lab}: Δ vs pg | {lab}: collapsed" for lab in labels)
    lines = [f"# Side by side: {', '.join(f'{lab} (`{x}`)' for lab, x in zip(labels, sweeps))}", "",
             (f"Per group, in each sweep: final held-out reward minus that of the same sweep's reference (and pg) run of "
              f"the same seeds, mean [{LEVEL:.0%} Student-t interval over the seeds] (pairs), **above** / **below** "
              f"when the interval excludes zero; collapsed: runs whose held-out reward fell below its start − "
              f"{COLLAPSE_MARGIN} for good. *Same verdicts*: every sweep separates alike vs the reference and vs pg. "
              f"Regenerate with `driftless compare {' '.join(map(shown, sweeps))} --labels {' '.join(labels)}`."), "",
             head + " | same verdicts |", "|---|" + "---|---|---|" * len(sweeps) + "---|"]
    for g in order:
        cells, verdicts = [], []
        for groups, values, keys, ref, _ in read:
            rs = groups[g]
            vs_ref = paired_deltas(rs, groups[ref]) if g != ref else []
            partner = pg_partner(values, keys, g)
            vs_pg = paired_deltas(rs, groups[partner]) if partner is not None else []
            ref_i, pg_i = paired_interval(vs_ref), paired_interval(vs_pg)
            verdicts.append((separation(ref_i), separation(pg_i)))
            mark = {"above": " **above**", "below": " **below**"}
            cells += ["—" if g == ref else _interval_cell(ref_i, len(vs_ref)) + mark.get(separation(ref_i), ""),
                      "—" if partner is None else _interval_cell(pg_i, len(vs_pg)) + mark.get(separation(pg_i), ""),
                      f"{sum(r['collapse'] is not None for r in rs)} of {len(rs)}"]
        same = "—" if g == read[0][3] else "yes" if len(set(verdicts)) == 1 else "**no**"
        lines.append(f"| {g} | " + " | ".join(cells) + f" | {same} |")
    return "\n".join(lines) + "\n"


def _seed_table(groups: dict[str, list[dict]], key: str = "final") -> list[str]:
    """Each group's final (``key="final"``) or best (``"best"``: the highest of the run's evaluations) held-out
    reward per seed, so a verdict can be read seed by seed (with each run's initial held-out reward where the runs
    did not all start from one); only when no group pools runs of one seed."""
    seeds = sorted({r["seeds"] for rs in groups.values() for r in rs}, key=str)
    if len(seeds) < 2 or any(len({r["seeds"] for r in rs}) != len(rs) for rs in groups.values()):
        return []
    starts = {r["initial"] for rs in groups.values() for r in rs}
    one_start = len(starts) == 1

    def cell(r):
        return f"{r[key]:.3f}" if one_start else f"{r[key]:.3f} (from {r['initial']:.3f})"
    rows = []
    for label, rs in groups.items():
        by_seed = {r["seeds"]: r for r in rs}
        rows.append(f"| {label} | " + " | ".join(cell(by_seed[x]) if x in by_seed else "—" for x in seeds) + " |")
    head = [", ".join(str(v) for v in x if v is not None) or "—" for x in seeds]
    what = {"final": "Final held-out reward", "best": "Best held-out reward (the highest evaluation of the run)"}[key]
    return ["", f"{what} per seed" + (f" (every run starts at {starts.pop():.3f}):" if one_start else
                                      " (from the run's initial held-out reward):"), "",
            "| group | " + " | ".join(f"seed {h}" for h in head) + " |", "|---|" + "---|" * len(seeds), *rows]


def _drift_table(groups: dict[str, list[dict]], ref: str) -> list[str]:
    """Per group with a mismatch: each sampler–trainer measure's mean over the first and the last fifth of the
    steps (mean over the runs) and their ratio: does the disagreement grow as the run trains? KL(q‖p) bounds
    the size of the drift per token: the mean score under q in logit space is q − p, whose L1 norm is at most
    √(2 KL) (Pinsker)."""
    rows = []
    for label, rs in groups.items():
        if label == ref:
            continue
        cells = []
        for key, _, fmt in DRIFT_KEYS:
            pairs = [early_late(r["rows"], key) for r in rs]
            early, late = statistics.fmean(e for e, _ in pairs), statistics.fmean(x for _, x in pairs)
            growth = f" (×{late / early:.2f})" if early > 0 else ""
            cells.append(f"{early:{fmt}} → {late:{fmt}}{growth}")
        each = [early_late(r["rows"], "kl_k3") for r in sorted(rs, key=lambda r: str(r["seeds"]))]
        cells.append(", ".join(f"×{x / e:.2f}" if e > 0 else "—" for e, x in each))  # NaN (no KL) prints ×nan
        rows.append(f"| {label} | " + " | ".join(cells) + " |")
    if not rows:
        return []
    return ["", (f"Mismatch over the run: each measure's mean over the first and the last {PHASE:.0%} of the steps "
                 "(mean over the group's runs), and late / early. A growing KL is drift growing per token (the score's "
                 "mean under q is q − p in logit space, of L1 norm at most √(2 KL)); a collapsed run's late phase is "
                 "its collapsed policy's. Eq. 1's movement is the share from weights that moved since the sample (lag), its "
                 "disagreement the sampler's own numerics at the sample's weights. The last column: each run's own KL "
                 "late / early, in seed order."),
            "", "| group | " + " | ".join(name for _, name, _ in DRIFT_KEYS) + " | KL late / early, each run |",
            "|---|" + "---|" * (len(DRIFT_KEYS) + 1), *rows]


def _band(ax, xs_list, ys_list, label):
    n = min(len(y) for y in ys_list)
    xs = [statistics.fmean(col) for col in zip(*(x[:n] for x in xs_list))]
    cols = list(zip(*(y[:n] for y in ys_list)))
    (line,) = ax.plot(xs, [statistics.fmean(c) for c in cols], label=label)
    if len(ys_list) > 1:
        ax.fill_between(xs, [min(c) for c in cols], [max(c) for c in cols], color=line.get_color(), alpha=0.2)


def _series(rows, key):
    return [r.get(key, float("nan")) for r in rows]


def _plots(out: Path, groups: dict[str, list[dict]]) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    fig, ax = plt.subplots(1, 2, figsize=(12, 4))
    for label, rs in groups.items():
        _band(ax[0], [r["curve"][0] for r in rs], [r["curve"][1] for r in rs], label)
        walls = []
        for r in rs:  # wall time at each evaluation: 0 at the start, then the step's wall time
            by_step = {row["step"] + 1: row.get("wall_time", float("nan")) for row in r["rows"]}
            walls.append([0.0] + [by_step.get(x, float("nan")) for x in r["curve"][0][1:]])
        _band(ax[1], walls, [r["curve"][1] for r in rs], label)
    for a, xl in zip(ax, ("step", "wall time (s)")):
        a.set_xlabel(xl)
        a.set_ylabel("held-out reward")
    _legend(ax[-1], len(groups))
    fig.tight_layout()
    paths.append(out / "eval_reward.png")
    save_figure(fig, paths[-1], dpi=90, bbox_inches="tight")
    plt.close(fig)
    for name, keys in (("divergence", ("kl_k3", "renyi_d2")), ("eq1", ("eq1_movement_abs", "eq1_disagreement_abs"))):
        fig, ax = plt.subplots(1, 2, figsize=(12, 4))
        for a, key in zip(ax, keys):
            for label, rs in groups.items():
                _band(a, [[row["step"] + 1 for row in r["rows"]] for r in rs], [_series(r["rows"], key) for r in rs],
                      label)
            a.set_xlabel("step")
            a.set_ylabel(key)
        _legend(ax[-1], len(groups))
        fig.tight_layout()
        paths.append(out / f"{name}.png")
        save_figure(fig, paths[-1], dpi=90, bbox_inches="tight")
        plt.close(fig)
    return paths


def _legend(ax, n: int) -> None:
    """One legend beside the figure (many groups would cover the curves), in columns of at most 20."""
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.02, 1.0), ncol=max(1, -(-n // 20)))


def _panels(out: Path, groups: dict[str, list[dict]], group_values: dict[str, tuple], ref: str,
            by: list[str]) -> Path:
    """Held-out reward per step, one panel per value of the last grouping key (e.g. each noise scale),
    one line per value of the others, the reference (dashed, black) in every panel."""
    facets = sorted({v[-1] for label, v in group_values.items() if label != ref and v[-1] is not None},
                    key=lambda v: (0, v, "") if isinstance(v, (int, float)) else (1, 0, str(v)))  # 4 before 16
    fig, axes = plt.subplots(1, len(facets), figsize=(4.2 * len(facets), 3.6), sharey=True, squeeze=False)
    names = list(dict.fromkeys(", ".join(str(x) for x in v[:-1]) for label, v in group_values.items() if label != ref))
    colors = {name: plt.cm.tab10(i % 10) if len(names) <= 10 else plt.cm.tab20(i % 20) for i, name in enumerate(names)}
    for ax, facet in zip(axes[0], facets):
        for label, rs in groups.items():
            values = group_values[label]
            if label == ref:
                xs, ys = [r["curve"][0] for r in rs], [r["curve"][1] for r in rs]
                n = min(len(y) for y in ys)
                ax.plot(xs[0][:n], [statistics.fmean(c) for c in zip(*(y[:n] for y in ys))], "k--", label=ref)
            elif values[-1] == facet:
                name = ", ".join(str(x) for x in values[:-1])
                n = min(len(r["curve"][1]) for r in rs)
                ax.plot(rs[0]["curve"][0][:n], [statistics.fmean(c) for c in zip(*(r["curve"][1][:n] for r in rs))],
                        color=colors[name], label=name)
        ax.set_title(f"{by[-1]} = {facet}", fontsize=9)
        ax.set_xlabel("step")
    axes[0][0].set_ylabel("held-out reward (mean over seeds)")
    _legend(axes[0][-1], len(names) + 1)
    fig.tight_layout()
    path = out / "eval_reward_panels.png"
    save_figure(fig, path, dpi=90, bbox_inches="tight")
    plt.close(fig)
    return path
