"""Start-up self-test for aligned execution: does the invariance hold here, now?

Aligned execution is invariant by construction (``driftless.ops.exact``): exact integer sums in
float64, fixed polynomials for exp and log, and correctly rounded elementwise operations. The
self-test still checks it with ``torch.equal`` before a model runs aligned, because the
construction rests on IEEE arithmetic that a process could break (flush-to-zero, a patched
kernel): one sequence alone vs inside a mixed, differently padded batch, and prefill +
token-by-token decode vs one full forward. A failure names the first operation (layer, op,
shape) whose output differed and refuses aligned mode. Results are cached per (configuration,
thread count).

The checks run the eager definitions of the aligned pieces (``ops.fuse.unfused``, this thread only):
compiling the self-test's own shapes (four lengths alone, a padded batch, ten decode positions) cost
71 s on a cold inductor cache and 18 s on a warm one in every process that turned aligned, against
0.1 s eager (a 2-core EPYC, one thread): most of the demo's start-up. The compiled pieces equal the
eager ones by construction; ``ops.fuse`` compares each one's first compiled call with its definition
where it runs, and ``tests/test_fuse.py`` compares the two on many shapes, across kernel sets too.
"""

from __future__ import annotations

import dataclasses

import torch

from driftless.ops.fuse import unfused


class AlignmentError(RuntimeError):
    """Aligned execution is not bitwise invariant on this machine."""


_CACHE: dict = {}


def _first_difference(trace_a, trace_b, row_b: int, n: int, t_a=None) -> str | None:
    """First op whose output for one sequence differs between two traced forwards.

    ``trace_a`` is the reference (the sequence alone, batch of 1; positions ``t_a`` or ``:n``),
    ``trace_b`` the other forward (row ``row_b``, its first ``n`` positions).
    """
    for (name, a), (_, b) in zip(trace_a, trace_b):
        ref = a[0, t_a] if t_a is not None else a[0, :n]
        got = b[row_b, 0] if t_a is not None else b[row_b, :n]
        if not torch.equal(ref, got):
            return f"{name} (output shape {tuple(b.shape)})"
    return None


def invariance_failures(config, model_cls, gemm=None) -> list[str]:
    """Run the checks on a random ``model_cls(config)``; return what failed (empty = invariant).

    ``gemm(x, weight)`` replaces the aligned GEMM (a negative control: plain fp32 ``F.linear``
    is not batch invariant, and the self-test must say so).
    """
    model = model_cls(config, execution="fast")
    model._execution = "aligned"  # set directly: the setter would call this self-test again
    model.aligned_gemm = gemm
    model.reset_parameters(seed=1234)
    model.requires_grad_(False)
    g = torch.Generator().manual_seed(0)
    v, ctx = config.vocab_size, config.max_seq_len
    lengths = [min(n, ctx) for n in (3, 11, 1, 7)]
    seqs = [torch.randint(0, v, (n,), generator=g) for n in lengths]
    width = max(lengths) + 2
    batch = torch.zeros(len(seqs), min(width, ctx), dtype=torch.long)
    for i, s in enumerate(seqs):
        batch[i, : len(s)] = s
    failures = []

    def traced(*args, **kwargs):
        model.trace = []
        try:
            return model(*args, **kwargs), model.trace
        finally:
            model.trace = None

    with torch.no_grad():
        alone = [traced(s[None]) for s in seqs]
        together, trace = traced(batch)
        for i, s in enumerate(seqs):
            if not torch.equal(together[i, : len(s)], alone[i][0][0]):
                where = _first_difference(alone[i][1], trace, i, len(s))
                failures.append(f"sequence {i}: batched full forward differs from the forward of it alone, "
                                f"first at {where}")
        cache = model.new_cache(len(seqs))
        prompt = torch.tensor([1] * len(seqs))
        model.prefill(batch[:, :1], prompt, cache)
        for t in range(1, max(lengths)):
            step, step_trace = traced(batch[:, t, None], cache=cache, start=torch.full((len(seqs),), t))
            for i, s in enumerate(seqs):
                if t < len(s) and not torch.equal(step[i, 0], alone[i][0][0, t]):
                    where = _first_difference(alone[i][1], step_trace, i, 1, t_a=t)
                    failures.append(f"sequence {i}, position {t}: decode differs from the full forward, "
                                    f"first at {where}")
    return failures


def ensure_aligned(config, model_cls) -> None:
    """Raise AlignmentError if aligned execution of ``model_cls(config)`` is not invariant here."""
    key = (model_cls.__name__, tuple(sorted(dataclasses.asdict(config).items())), torch.get_num_threads())
    if key not in _CACHE:
        with unfused():
            _CACHE[key] = invariance_failures(config, model_cls)
    failures = _CACHE[key]
    if failures:
        raise AlignmentError(
            "aligned execution is not bitwise invariant on this machine "
            f"({torch.get_num_threads()} threads, torch {torch.__version__}, "
            f"CPU capability {torch.backends.cpu.get_cpu_capability()}): {failures[0]} "
            f"(and {len(failures) - 1} more). Aligned mode relies on IEEE arithmetic only: check that "
            "flush-to-zero is off (torch.set_flush_denormal(False)) and report this message with the CPU model. "
            "Use execution='fast' meanwhile."
        )
