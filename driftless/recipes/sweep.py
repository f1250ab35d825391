"""``driftless sweep EXPERIMENT.yaml --run-dir DIR``: a grid of runs on Ray Tune, resumable.

An experiment file names a base config, overrides for every trial, optional named variants and a
grid over any config keys::

    base: configs/default.yaml          # relative to the current folder, else to this file's
    set: {train.steps: 40}              # every trial
    variants:                           # optional: named override sets, each crossed with the grid
      baseline: {objective.name: pg, mismatch.view: none}
      sc: {objective.name: sc}
    grid: {mismatch.view: ["noise:0.3"], train.seed: [0, 1, 2]}
    reference: {mismatch.view: none}    # optional: the no-mismatch reference, crossed with the seeds only

Each trial is a normal run directory, ``DIR/<its variant and grid values>/`` (config.yaml,
metrics.jsonl, checkpoints, report), trained by a Ray Tune function trainable that reports every
step to Tune (the ``tune`` metric sink). Local Ray with this machine's CPUs by default, one trial
per CPU and one torch thread each; set ``RAY_ADDRESS`` to run the same command on a cluster.

Resumable: a trial whose run finished (``DIR/<trial>/done.json``) is not trained again; an
unfinished one continues from its last checkpoint (bit-identical lines, one thread per trial);
every start is recorded in ``DIR/<trial>/attempts.jsonl``. A failing trial is reported by name and
does not stop the others. Every trial's config is built and checked before any trial starts, and
the warm starts are computed once, before the trials.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import shutil
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path

import yaml

from driftless.train import build, load_config
from driftless.train.config import RunConfig, read_yaml
from driftless.train.sinks import METRICS_FILE, PACKABLE, PACKED_SUFFIX, has_record, pack_run, record_path

SEED_KEYS = ("train.seed", "warm_start.seed")


@dataclass
class Trial:
    name: str
    values: dict  # the grid values (and "variant") that name the trial
    overrides: list[str]


@dataclass
class Experiment:
    base: Path | None
    set: dict = field(default_factory=dict)
    grid: dict = field(default_factory=dict)
    variants: dict = field(default_factory=dict)
    source: Path | None = None
    reference: dict | None = None  # one more variant, "reference", crossed with the grid's seed keys only

    def trials(self) -> list[Trial]:
        """Seed by seed (the grid's seed keys outermost): each seed's reference first (every comparison reads
        against it, and a calibration is read from it before its variants finish), then each variant crossed with
        the rest of the grid. An interrupted sweep thus leaves whole seeds, each method paired with the
        reference and with pg of the same seeds, rather than every seed of a few methods."""
        keys = list(self.grid)
        seeds = [k for k in keys if k in SEED_KEYS]
        others = [k for k in keys if k not in SEED_KEYS]
        variants = list(self.variants.items()) or [(None, {})]
        out = []
        for seed_combo in itertools.product(*(self.grid[k] for k in seeds)):
            seed_values = dict(zip(seeds, seed_combo))
            if self.reference is not None:
                overrides = [f"{k}={_yaml(v)}" for k, v in {**self.set, **self.reference, **seed_values}.items()]
                name = ",".join(["reference"] + [f"{k}={_fmt(v)}" for k, v in seed_values.items()])
                out.append(Trial(name.replace("/", "_"), {"variant": "reference", **seed_values}, overrides))
            for vname, vset in variants:
                for combo in itertools.product(*(self.grid[k] for k in others)):
                    picked = {**dict(zip(others, combo)), **seed_values}
                    values = {k: picked[k] for k in keys}  # the grid's own key order names the trial
                    parts = ([vname] if vname is not None else []) + [f"{k}={_fmt(v)}" for k, v in values.items()]
                    overrides = [f"{k}={_yaml(v)}" for k, v in {**self.set, **vset, **values}.items()]
                    named = {"variant": vname, **values} if vname is not None else values
                    out.append(Trial(",".join(parts).replace("/", "_") or "default", named, overrides))
        return out

    def config(self, trial: Trial) -> RunConfig:
        return build.check(load_config(self.base, trial.overrides))

    def check(self) -> list[RunConfig]:
        """Every trial's config: every key exists and every value is accepted, before any trial runs."""
        where = f"{self.source}: " if self.source else ""
        configs = []
        for trial in self.trials():
            try:
                configs.append(self.config(trial))
            except ValueError as err:
                raise ValueError(f"{where}trial {trial.name!r}: {err}") from None
        return configs


def _fmt(value) -> str:
    return value if isinstance(value, str) else json.dumps(value)


def _yaml(value) -> str:
    """A value as the command line's ``key=value`` reads it back (YAML)."""
    return value if isinstance(value, str) else yaml.safe_dump(value, default_flow_style=True).strip().removesuffix("...").strip()


def load_experiment(path) -> Experiment:
    """Read and check an experiment file; every problem is refused by name before anything runs."""
    path = Path(path)
    if not path.exists():
        raise ValueError(f"experiment file {path} does not exist")
    data = read_yaml(path, "experiment file")
    if not isinstance(data, dict):
        raise ValueError(f"{path}: an experiment file is a mapping with base, set, variants and grid")
    unknown = sorted(set(data) - {"base", "set", "grid", "variants", "reference"})
    if unknown:
        raise ValueError(f"{path}: unknown key {unknown[0]!r}; an experiment file has base, set, variants, grid, "
                         "reference")
    grid = data.get("grid")
    if not grid or not isinstance(grid, dict):
        raise ValueError(f"{path}: the experiment has no grid (grid: {{key: [values, ...]}})")
    for key, values in grid.items():
        if not isinstance(values, list) or not values:
            raise ValueError(f"{path}: grid.{key} must be a non-empty list, got {values!r}")
    for name in ("set", "variants", "reference"):
        if not isinstance(data.get(name) or {}, dict):
            raise ValueError(f"{path}: {name} must be a mapping, got {data[name]!r}")
    variants = data.get("variants") or {}
    for vname, vset in variants.items():
        if not isinstance(vset, dict):
            raise ValueError(f"{path}: variants.{vname} must be a mapping of config keys, got {vset!r}")
    if "reference" in variants and "reference" in data:
        raise ValueError(f"{path}: a variant may not be named 'reference' when the file has a reference")
    base = data.get("base")
    if base is not None:
        base = Path(base)
        if not base.exists() and (path.parent / base).exists():
            base = path.parent / base
        if not base.exists():
            raise ValueError(f"{path}: base config {data['base']} does not exist (relative to the current "
                             f"folder or to {path.parent})")
    reference = data.get("reference")
    exp = Experiment(base, data.get("set") or {}, grid, variants, path,
                     None if reference is None and "reference" not in data else dict(reference or {}))
    exp.check()
    return exp


# ---------------------------------------------------------------- one trial (runs in a Ray worker)
def _numeric(metrics: dict) -> dict:
    return {k: v for k, v in metrics.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}


def run_trial(base, overrides: list[str], run_dir: Path, *, threads: int = 1, report=None,
              keep_checkpoints: bool = True) -> dict:
    """Train one trial in ``run_dir``: resume it, or do nothing when it is done; its summary.

    A directory holding a run of another config (the experiment changed) is trained afresh.
    ``keep_checkpoints=False`` deletes a finished run's checkpoints and trace (a lagged run keeps
    its past weights there: tens of MB per checkpoint, tens of GB over a study); its record stays."""
    import torch

    caller_threads = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return _run_trial(base, overrides, Path(run_dir), report, keep_checkpoints)
    finally:
        torch.set_num_threads(caller_threads)  # called in-process (tests, one worker), the caller keeps its own


def _run_trial(base, overrides: list[str], run_dir: Path, report, keep_checkpoints: bool) -> dict:
    from driftless.train import train
    from driftless.train.checkpoint import latest_checkpoint
    from driftless.train.report import summarize, write_run_report


    run_dir.mkdir(parents=True, exist_ok=True)
    cfg = load_config(base, overrides)
    if report is not None and "tune" not in cfg.train.loggers:
        cfg.train.loggers = [*cfg.train.loggers, "tune"]
    done, saved = run_dir / "done.json", run_dir / "config.yaml"
    same = saved.exists() and _saved_computation(saved) == _computation(cfg)
    finished = same and done.exists()
    latest = latest_checkpoint(run_dir) if same and not finished else None
    attempt = {"done_before": finished, "resumed_from": None if latest is None else latest.name,
               "config_changed": saved.exists() and not same}
    with (run_dir / "attempts.jsonl").open("a") as f:
        f.write(json.dumps(attempt) + "\n")
    if finished:
        summary = json.loads(done.read_text())
    else:
        done.unlink(missing_ok=True)
        train(cfg, run_dir, resume=latest is not None, overwrite=True, progress=False)
        write_run_report(run_dir)
        summary = summarize(run_dir)
        pack_run(run_dir)  # a finished record is kept compressed (driftless pack); every reader reads it
        tmp = done.with_suffix(".tmp")
        tmp.write_text(json.dumps(summary))
        tmp.replace(done)
    if not keep_checkpoints:
        for bulky in ("checkpoints", "trace"):
            shutil.rmtree(run_dir / bulky, ignore_errors=True)
    if report is not None:
        report({**_numeric(summary), "done": 1})
    return summary


# settings that change where a run's outputs go, how they are shown or how its process allocates, never its numbers
_PRESENTATION = {"train": ("loggers", "progress", "run_dir", "malloc_mmap_threshold"), "warm_start": ("cache_dir",)}


def _computation(cfg: RunConfig) -> dict:
    """The config as far as it decides a run's numbers (a finished trial of it is kept)."""
    out = cfg.to_dict()
    for section, keys in _PRESENTATION.items():
        for key in keys:
            out[section].pop(key)
    return out


def _saved_computation(path: Path) -> dict | None:
    """The computation of a run directory's saved config; None if it no longer loads (an older schema)."""
    try:
        return _computation(load_config(path))
    except ValueError:
        return None


def _tune_trainable(spec: dict):
    def trainable(config):
        from ray import tune

        path = config["trial"]
        run_trial(spec["base"], spec["trials"][path], Path(path), threads=1, report=tune.report,
                  keep_checkpoints=spec["keep_checkpoints"])
    return trainable


# ---------------------------------------------------------------- the sweep (the driver)
def prepare_warm_starts(configs: list[RunConfig], progress: bool) -> None:
    """Each distinct warm start once, here, before any trial (the trials only read the cache)."""
    seen = set()
    for cfg in configs:
        if cfg.model.kind != "tiny" or not cfg.model.warm_start:
            continue
        key = json.dumps([asdict(cfg.model), asdict(cfg.task), asdict(cfg.warm_start), cfg.rollout.max_new_tokens],
                         sort_keys=True)
        if key not in seen:
            seen.add(key)
            build.initial_state(cfg, progress=progress)


def run_sweep(experiment_path, run_dir, *, max_concurrent: int | None = None, progress: bool = True,
              reuse: list[Path] = ()) -> dict:
    """Run (or continue) every trial of an experiment file on Ray Tune; ``{"trials", "failed", "run_dir",
    "reused"}``; ``reuse``: folders whose finished runs of the same computation stand in for trials."""
    return run_experiment(load_experiment(experiment_path), run_dir, max_concurrent=max_concurrent,
                          progress=progress, reuse=list(reuse))


# what a finished run needs for its reports (and what results/ commits): never checkpoints; metrics.jsonl
# plain or packed (metrics.jsonl.xz)
RUN_RECORD = ("config.yaml", METRICS_FILE, "initial_eval.json", "done.json")


def _key(computation: dict | None) -> str:
    return json.dumps(computation, sort_keys=True, default=str)


def recorded_start(run_dir: Path) -> str | None:
    """The digest of the weights a finished run started from (``initial_eval.json``): ``start_weights_sha256``,
    else its warm start's (records before the former); None when the record holds neither."""
    saved = Path(run_dir) / "initial_eval.json"
    if not saved.exists():
        return None
    info = json.loads(saved.read_text())
    return info.get("start_weights_sha256") or (info.get("warm_start") or {}).get("weights_sha256")


def start_digests():
    """``cfg -> digest`` of the weights a run of ``cfg`` would start from on this machine (its warm start, built
    or read from the cache, or its checkpoint), once per distinct start."""
    from driftless.train.warmstart import state_digest

    seen: dict[str, str] = {}

    def digest(cfg: RunConfig) -> str:
        key = json.dumps([asdict(cfg.model), asdict(cfg.task), asdict(cfg.warm_start), cfg.train.seed,
                          cfg.train.reproducible, cfg.rollout.max_new_tokens], sort_keys=True, default=str)
        if key not in seen:
            seen[key] = state_digest(build.initial_state(cfg, progress=False)[0])
        return seen[key]
    return digest


def reuse_finished(targets: dict[Path, RunConfig], search: list[Path], start=None) -> dict[Path, Path]:
    """Give each unfinished target the record of a finished run under ``search`` with the very same
    computation (``config.yaml`` equal but for presentation keys): ``{target: source}`` of those copied.

    A run with the same computation on this machine is the same run, bit for bit (one thread per trial);
    a record from another machine is that machine's run (fast execution, docs/alignment.md), which started from
    another warm start when the CPUs' kernels differ. ``start`` (``start_digests()``): a source is taken only
    when it started from the weights a target would start from here, so a sweep never pairs its own runs with
    another machine's reference."""
    wanted: dict[str, list[Path]] = {}  # two trials of one experiment may be the same computation: both take it
    starts: dict[str, str | None] = {}
    for p, cfg in targets.items():
        if not (Path(p) / "done.json").exists():
            key = _key(_computation(cfg))
            wanted.setdefault(key, []).append(Path(p))
            if start is not None and key not in starts:
                starts[key] = start(cfg)
    copied = {}
    for root in search:
        for done in sorted(Path(root).glob("**/done.json")) if Path(root).is_dir() else []:
            source = done.parent
            key = _key(_saved_computation(source / "config.yaml"))
            if key not in wanted:
                continue
            if start is not None and recorded_start(source) != starts[key]:
                continue  # the same computation from another starting model: another machine's run
            if not all((source / f).exists() for f in RUN_RECORD if f != METRICS_FILE) or not has_record(source):
                continue
            for target in wanted.pop(key):  # never the source itself: a source is finished, a target is not
                target.mkdir(parents=True, exist_ok=True)
                for name in PACKABLE:  # a trial killed midway: its partial lines must not outlive the copy
                    (target / name).unlink(missing_ok=True)
                    (target / (name + PACKED_SUFFIX)).unlink(missing_ok=True)
                for bulky in ("checkpoints", "trace"):
                    shutil.rmtree(target / bulky, ignore_errors=True)
                for f in RUN_RECORD[:-1]:
                    if f in PACKABLE:
                        shutil.copy2(record_path(source, f), target / record_path(source, f).name)
                    else:
                        shutil.copy2(source / f, target / f)
                shutil.copy2(source / "done.json", target / "done.json")  # last: the copy is whole before it counts
                copied[target] = source
    return copied


def run_experiment(exp: Experiment, run_dir, *, max_concurrent: int | None = None, progress: bool = True,
                   reuse: list[Path] = (), keep_checkpoints: bool = True) -> dict:
    """Every trial of ``exp`` (checked by ``load_experiment``, or call ``exp.check()`` first) on ``run_trials``;
    a trial whose computation a finished run under ``reuse`` already made takes that run's record."""
    root = Path(run_dir).resolve()
    trials = exp.trials()
    root.mkdir(parents=True, exist_ok=True)
    digest = start_digests()
    if reuse:
        reused = reuse_finished({root / t.name: exp.config(t) for t in trials}, list(reuse), start=digest)
        if reused and progress:
            print(f"{len(reused)} trial(s) of {root.name} reuse a finished identical run")
    finished = [t for t in trials if (root / t.name / "done.json").exists()]
    kept = [t.name for t in finished if (rec := recorded_start(root / t.name)) is not None
            and rec != digest(exp.config(t))] if len(finished) < len(trials) else []  # only when some trial trains here
    if kept:
        print(f"{root.name}: {len(kept)} finished trial(s) started from other weights than this machine's ({', '.join(kept[:3])}"
              f"{', …' if len(kept) > 3 else ''}): the trials trained here pair with them across two starting "
              "models (the report marks such pairs †)", file=sys.stderr)
    (root / "sweep.json").write_text(json.dumps({
        "experiment": str(exp.source), "base": str(exp.base) if exp.base else None, "set": exp.set,
        "variants": exp.variants, "grid": exp.grid, "reference": exp.reference,
        "trials": {t.name: {"values": t.values, "overrides": t.overrides} for t in trials}}, indent=2, default=str))
    failed = run_trials(exp.base, {root / t.name: t.overrides for t in trials}, max_concurrent=max_concurrent,
                        progress=progress, storage=root / ".tune", keep_checkpoints=keep_checkpoints)
    return {"trials": [t.name for t in trials], "failed": {Path(p).name: e for p, e in failed.items()},
            "reused": len(reused) if reuse else 0,
            "run_dir": str(root)}


def run_trials(base, trials: dict[Path, list[str]], *, max_concurrent: int | None = None, progress: bool = True,
               storage: Path | None = None, keep_checkpoints: bool = True) -> dict[str, str]:
    """Train every ``{run_dir: overrides}`` as a Ray Tune trial (one CPU, one thread each); ``{run_dir: error}``
    of the trials that failed. The engine behind ``sweep``, ``demo`` and ``calibrate``."""
    trials = {str(Path(p).resolve()): list(ov) for p, ov in trials.items()}
    configs = {p: load_config(base, ov) for p, ov in trials.items()}
    for p, cfg in configs.items():  # the warm-start cache is relative to here: absolute for the trials
        trials[p].append(f"warm_start.cache_dir={Path(cfg.warm_start.cache_dir).resolve()}")
    prepare_warm_starts(list(configs.values()), progress)
    storage = Path(storage) if storage else Path(os.path.commonpath(list(trials))) / ".tune"

    import ray
    from ray import tune

    os.environ.setdefault("RAY_CHDIR_TO_TRIAL_DIR", "0")
    started = not ray.is_initialized()
    if started:
        if os.environ.get("RAY_ADDRESS"):
            ray.init(log_to_driver=False)  # join the cluster, nothing else changed
        else:
            ray.init(num_cpus=os.cpu_count() or 1, include_dashboard=False, log_to_driver=False)
    try:
        cpus = int(ray.cluster_resources().get("CPU", 1))
        spec = {"base": str(base) if base else None, "trials": trials, "keep_checkpoints": keep_checkpoints}
        tuner = tune.Tuner(
            tune.with_resources(_tune_trainable(spec), {"cpu": 1}),
            param_space={"trial": tune.grid_search(list(trials))},
            # a worker process trains one trial after another: no process start and torch import per trial
            # (~5 s each); a trial's numbers do not depend on what the process ran before (run_trial sets
            # its threads; fast mode's bits follow threads and kernel set only)
            tune_config=tune.TuneConfig(max_concurrent_trials=max_concurrent or cpus, reuse_actors=True),
            run_config=tune.RunConfig(name="tune", storage_path=str(storage), verbose=1 if progress else 0),
        )
        if progress:
            results = tuner.fit()
        else:  # Tune prints its tables whatever its verbosity: keep the driver's stdout for the report
            with open(os.devnull, "w") as sink, contextlib.redirect_stdout(sink):
                results = tuner.fit()
    finally:
        if started:
            ray.shutdown()
    failed = {}
    for result in results:
        if result.error is not None:
            path = (result.config or {}).get("trial", "?")
            error = getattr(result.error, "cause", None) or result.error  # Ray wraps the trial's own exception
            failed[path] = f"{type(error).__name__}: {str(error).strip().splitlines()[-1][:500]}"
    return failed
