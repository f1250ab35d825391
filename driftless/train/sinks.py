"""Metric sinks: where a run's numbers go. ``train.loggers`` picks them (``jsonl`` always first).

Every part logs through the same interface, ``log(step, metrics, source)``, with ``source``
naming the part (``rollout``, ``learner``, ``eval``, ``run``); ``end_step(step)`` closes a step.

- ``jsonl``: one flushed line per step in ``metrics.jsonl``, every source merged (the reports
  read it; resume truncates it to the checkpoint). A finished run's record may be packed
  (``metrics.jsonl.xz``, ``pack_run``): every reader goes through ``read_lines`` / ``read_metrics``,
  which read either form.
- ``tensorboard``: ``torch.utils.tensorboard`` scalars tagged ``source/key`` under ``tb/``
  (needs the ``tensorboard`` package: ``pip install driftless[tensorboard]``).
- ``wandb``: Weights & Biases, keys ``source/key`` (``pip install driftless[wandb]``; set
  ``WANDB_MODE=offline`` to log without an account or a network).
- ``tune``: inside a Ray Tune trial (``driftless sweep``), every step's scalars to ``tune.report``,
  so Tune's progress table shows reward while a grid runs.
"""

from __future__ import annotations

import json
import lzma
import math
from pathlib import Path

LOGGERS = ("jsonl", "tensorboard", "wandb", "tune")

# ---------------------------------------------------------------- run records, plain or packed
METRICS_FILE = "metrics.jsonl"
PACKED_SUFFIX = ".xz"  # xz: 5.8x on a study record against gzip's 4.5x, in the standard library, byte-exact
PACKABLE = ("metrics.jsonl", "samples.jsonl")  # the line records a finished run keeps


def record_path(run_dir, name: str = METRICS_FILE) -> Path | None:
    """The plain file if it is there (a run still writing, or never packed), else the packed one, else None."""
    plain = Path(run_dir) / name
    packed = plain.with_name(name + PACKED_SUFFIX)
    return plain if plain.exists() else packed if packed.exists() else None


def has_record(run_dir, name: str = METRICS_FILE) -> bool:
    return record_path(run_dir, name) is not None


def read_text(run_dir, name: str = METRICS_FILE) -> str:
    path = record_path(run_dir, name)
    if path is None:
        raise ValueError(f"{run_dir} has no {name} (nor {name}{PACKED_SUFFIX})")
    if path.suffix == PACKED_SUFFIX:
        return lzma.decompress(path.read_bytes()).decode()
    return path.read_text()


def read_lines(run_dir, name: str = METRICS_FILE) -> list[dict]:
    """A record's rows, from the plain or the packed file; a bad line is named by file and line."""
    path = record_path(run_dir, name)
    rows = []
    for number, line in enumerate(read_text(run_dir, name).splitlines(), start=1):
        if line.strip():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as err:
                raise ValueError(f"{path}, line {number}: not JSON ({err.msg})") from None
    return rows


def read_metrics(run_dir) -> list[dict]:
    return read_lines(run_dir, METRICS_FILE)


def unpack_run(run_dir) -> None:
    """Make each packed record plain again (a packed run that is trained further appends to plain files)."""
    for name in PACKABLE:
        plain = Path(run_dir) / name
        packed = plain.with_name(name + PACKED_SUFFIX)
        if packed.exists() and not plain.exists():
            tmp = plain.with_name(name + ".tmp")
            tmp.write_bytes(lzma.decompress(packed.read_bytes()))
            tmp.replace(plain)
            packed.unlink()


def pack_run(run_dir) -> tuple[int, int]:
    """Compress a run's line records in place (``metrics.jsonl`` -> ``metrics.jsonl.xz``), checking that the
    packed file decompresses to the very bytes before the plain one is removed; (bytes before, bytes after)."""
    before = after = 0
    for name in PACKABLE:
        plain = Path(run_dir) / name
        packed = plain.with_name(name + PACKED_SUFFIX)
        if not plain.exists():
            if packed.exists():
                after += packed.stat().st_size
                before += len(lzma.decompress(packed.read_bytes()))
            continue
        data = plain.read_bytes()
        blob = lzma.compress(data, preset=9 | lzma.PRESET_EXTREME)  # no timestamp: the same bytes every time
        if lzma.decompress(blob) != data:
            raise RuntimeError(f"{plain}: the packed copy does not decompress to the original; left unpacked")
        tmp = packed.with_name(packed.name + ".tmp")
        tmp.write_bytes(blob)
        tmp.replace(packed)
        plain.unlink()
        before, after = before + len(data), after + len(blob)
    return before, after


def slim_run(run_dir, keep) -> tuple[int, int]:
    """Keep only the ``keep`` columns of a finished run's metrics, packed (what a record committed to git needs to
    regenerate its reports; the lines keep their order and the kept values their bytes); (bytes before, after),
    the packed sizes. Slimming again changes nothing."""
    keep = set(keep)
    if "step" not in keep:
        raise ValueError("slim_run: the kept columns must include 'step'")
    path = record_path(run_dir)
    if path is None:
        raise ValueError(f"{run_dir} has no {METRICS_FILE} (nor {METRICS_FILE}{PACKED_SUFFIX})")
    pack_run(run_dir)
    packed = Path(run_dir) / (METRICS_FILE + PACKED_SUFFIX)
    before = packed.stat().st_size
    rows = read_metrics(run_dir)
    data = "".join(json.dumps({k: v for k, v in r.items() if k in keep}) + "\n" for r in rows).encode()
    blob = lzma.compress(data, preset=9 | lzma.PRESET_EXTREME)
    if blob != packed.read_bytes():
        tmp = packed.with_name(packed.name + ".tmp")
        tmp.write_bytes(blob)
        tmp.replace(packed)
    return before, len(blob)


class JSONLSink:
    def __init__(self, path: Path):
        self.path = Path(path)
        self._file = self.path.open("a")
        self._pending: dict = {}

    def log(self, step: int, metrics: dict, source: str) -> None:
        self._pending.update(metrics)

    def end_step(self, step: int) -> None:
        self._file.write(json.dumps(self._pending) + "\n")
        self._file.flush()
        self._pending = {}

    def close(self) -> None:
        self._file.close()


def _scalars(metrics: dict):
    for key, value in metrics.items():
        if isinstance(value, bool):
            value = float(value)
        if isinstance(value, (int, float)) and math.isfinite(value):
            yield key, float(value)


class TensorBoardSink:
    def __init__(self, log_dir: Path):
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as err:  # torch imports tensorboard lazily
            raise ValueError("train.loggers has 'tensorboard' but the tensorboard package is not installed: "
                             "pip install 'driftless[tensorboard]'") from err
        self.writer = SummaryWriter(log_dir=str(log_dir))

    def log(self, step: int, metrics: dict, source: str) -> None:
        for key, value in _scalars(metrics):
            self.writer.add_scalar(f"{source}/{key}", value, step)

    def end_step(self, step: int) -> None:
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class WandbSink:
    def __init__(self, run_dir: Path, config: dict, name: str):
        try:
            import wandb
        except ImportError as err:
            raise ValueError("train.loggers has 'wandb' but the wandb package is not installed: "
                             "pip install 'driftless[wandb]'") from err
        self.wandb = wandb
        self.run = wandb.init(dir=str(run_dir), config=config, name=name, project="driftless", reinit=True)
        self._pending: dict = {}

    def log(self, step: int, metrics: dict, source: str) -> None:
        self._pending.update({f"{source}/{k}": v for k, v in _scalars(metrics)})

    def end_step(self, step: int) -> None:
        self.run.log(self._pending, step=step)
        self._pending = {}

    def close(self) -> None:
        self.run.finish()


class TuneSink:
    def __init__(self):
        import warnings

        try:
            from ray import tune
        except ImportError as err:
            raise ValueError("train.loggers has 'tune' but Ray Tune is not installed: pip install 'driftless[tune]'") \
                from err
        with warnings.catch_warnings():  # outside a trial Ray warns and answers None
            warnings.simplefilter("ignore")
            trial = tune.get_context().get_trial_id()
        if trial is None:
            raise ValueError("train.loggers has 'tune', but this run is not a Ray Tune trial (driftless sweep adds "
                             "it to its trials); drop it from train.loggers to run this config on its own")
        self.report = tune.report
        self._pending: dict = {}

    def log(self, step: int, metrics: dict, source: str) -> None:
        self._pending.update(dict(_scalars(metrics)))

    def end_step(self, step: int) -> None:
        self.report({**self._pending, "step": step})
        self._pending = {}

    def close(self) -> None:
        pass


class Sinks:
    """Fan-out to every configured sink."""

    def __init__(self, sinks: list):
        self.sinks = sinks

    def log(self, step: int, metrics: dict, source: str) -> None:
        for s in self.sinks:
            s.log(step, metrics, source)

    def end_step(self, step: int) -> None:
        for s in self.sinks:
            s.end_step(step)

    def close(self) -> None:
        for s in self.sinks:
            s.close()


def open_sinks(loggers, run_dir: Path, config: dict) -> Sinks:
    unknown = [name for name in loggers if name not in LOGGERS]
    if unknown:
        raise ValueError(f"train.loggers: unknown logger(s) {unknown}; choose from {', '.join(LOGGERS)}")
    run_dir = Path(run_dir)
    sinks: list = [JSONLSink(run_dir / "metrics.jsonl")]
    if "tensorboard" in loggers:
        sinks.append(TensorBoardSink(run_dir / "tb"))
    if "wandb" in loggers:
        sinks.append(WandbSink(run_dir, config, run_dir.name))
    if "tune" in loggers:
        sinks.append(TuneSink())
    return Sinks(sinks)
