"""The timing helper the bench scripts share (run as `python bench/NAME.py`: this folder is on sys.path)."""

from __future__ import annotations

import statistics
import time


def timed(fn, repeats: int) -> float:
    """Median wall time of ``repeats`` calls of ``fn`` after one warm-up call."""
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)
