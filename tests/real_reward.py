"""A user reward for tests/test_real.py: the arithmetic reward plus a small length term, so that every group of
responses has spread and every update moves the weights, whatever the sampler drew on this CPU."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))

from arithmetic_reward import final_number


def with_length(prompts, completions, answer, **columns) -> list[float]:
    return [r + len(c) / 1000 for r, c in zip(final_number(prompts, completions, answer), completions)]
