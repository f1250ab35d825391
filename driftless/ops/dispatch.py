"""Whether a reproducible dispatch mode is on, and a way around it for code that is exact by construction.

``ops.reproducible.Reproducible`` counts itself here when entered; ``ops.fuse`` (below it) asks
``active()`` and runs the aligned pieces ``suspended()``: their integer-code sums are already exact
and must not be summed again by the mode's rules.
"""

from __future__ import annotations

import contextlib

from torch.utils._python_dispatch import _disable_current_modes

entered = 0  # Reproducible modes entered in this process (``Reproducible.__enter__`` / ``__exit__``)


def active() -> bool:
    return entered > 0


@contextlib.contextmanager
def suspended():
    """Run code without any dispatch mode (back on the stack in order on exit); a no-op when none is on."""
    if not entered:
        yield
        return
    with _disable_current_modes():
        yield
