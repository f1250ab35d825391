"""``driftless audit`` (docs/audit.md): where a sampler-trainer disagreement comes from. The checks are in
``checks.py`` (exported here on first use, so that ``driftless --help`` reads ``commands.py`` without torch)."""

from __future__ import annotations

import importlib


def __getattr__(name: str):
    if name.startswith("__") or name in ("checks", "commands"):  # the submodules: imported as such, not from checks
        raise AttributeError(f"module 'driftless.audit' has no attribute {name!r}")
    return getattr(importlib.import_module("driftless.audit.checks"), name)
