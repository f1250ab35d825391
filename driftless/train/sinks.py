"""Metric sinks: where a run's numbers go. ``train.loggers`` picks them (``jsonl`` always first).

Every part logs through the same interface, ``log(step, metrics, source)``, with ``source``
naming the part (``rollout``, ``learner``, ``eval``, ``run``); ``end_step(step)`` closes a step.

- ``jsonl``: one flushed line per step in ``metrics.jsonl``, every source merged (the reports
  read it; resume truncates it to the checkpoint).
- ``tensorboard``: ``torch.utils.tensorboard`` scalars tagged ``source/key`` under ``tb/``
  (needs the ``tensorboard`` package: ``pip install driftless[tensorboard]``).
- ``wandb``: Weights & Biases, keys ``source/key`` (``pip install driftless[wandb]``; set
  ``WANDB_MODE=offline`` to log without an account or a network).
- ``tune``: inside a Ray Tune trial (``driftless sweep``), every step's scalars to ``tune.report``,
  so Tune's progress table shows reward while a grid runs.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

LOGGERS = ("jsonl", "tensorboard", "wandb", "tune")


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
