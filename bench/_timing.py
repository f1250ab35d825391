"""The timing helper the bench scripts share (run as `python bench/NAME.py`: this folder is on sys.path)."""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path


def timed(fn, repeats: int) -> float:
    """Median wall time of ``repeats`` calls of ``fn`` after one warm-up call."""
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def emit(result: dict, out: str | None, indent: int = 2) -> None:
    """Print ``result`` as JSON, and write it to ``out`` too when given (its folder made)."""
    text = json.dumps(result, indent=indent)
    print(text)
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(text + "\n")
