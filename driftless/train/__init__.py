"""The training loop, its rollout sources, the learner, warm start, config, checkpoints and metric sinks.

Exports resolve on first use, so that ``driftless.train.config`` (the schema) can be imported
without the training stack (torch) behind it.
"""

from __future__ import annotations

import importlib

_EXPORTS = {"RunConfig": "config", "apply_overrides": "config", "dump_config": "config", "load_config": "config",
            "Learner": "learner", "Run": "loop", "train": "loop"}
__all__ = ["Learner", "Run", "RunConfig", "apply_overrides", "dump_config", "load_config", "train"]


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(f"driftless.train.{_EXPORTS[name]}"), name)
    raise AttributeError(f"module 'driftless.train' has no attribute {name!r}")
