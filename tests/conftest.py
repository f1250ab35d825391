"""Shared helpers for the test suite."""

from __future__ import annotations

import pytest


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
