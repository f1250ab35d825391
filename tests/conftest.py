"""Shared helpers for the test suite."""

from __future__ import annotations

import os

import pytest

# The suite runs aligned execution eager (the definitions) and checks the fused, compiled pieces against
# it in test_fuse.py, including across processes and kernel sets: compiling in every test and subprocess
# would cost minutes. Subprocesses inherit this. A test that wants fusion sets the variable itself.
os.environ.setdefault("DRIFTLESS_FUSED_ALIGNED", "0")


def run_until_killed(run, at_step: int) -> None:
    """Run ``run`` and crash it just before step ``at_step`` (after the checkpoints before it)."""
    real = run.step

    def step():
        if run.step_index == at_step:
            raise RuntimeError("killed")
        return real()
    run.step = step
    with pytest.raises(RuntimeError, match="killed"):
        run.run()
