"""Start-up self-test for aligned execution: is the invariance true on this machine, now?

Batch invariance of the chunked GEMMs is an observed property of the CPU BLAS, not a contract,
so before a model runs in aligned mode we check it with ``torch.equal`` on a model of the same
configuration: one sequence alone vs inside a mixed, differently padded batch, and prefill +
token-by-token decode vs one full forward. A failure refuses aligned mode with a clear error.
Results are cached per (configuration, thread count).
"""

from __future__ import annotations

import dataclasses

import torch


class AlignmentError(RuntimeError):
    """Aligned execution is not bitwise invariant on this machine."""


_CACHE: dict = {}


def invariance_failures(config, chunk: int | None = None) -> list[str]:
    """Run the checks on a random model of ``config``; return what failed (empty = invariant)."""
    from driftless.models.tiny import TinyLM

    model = TinyLM(config, execution="fast")
    model._execution = "aligned"  # set directly: the setter would call this self-test again
    if chunk is not None:
        model.chunk = chunk
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
    with torch.no_grad():
        alone = [model(s[None])[0] for s in seqs]
        together = model(batch)
        for i, s in enumerate(seqs):
            if not torch.equal(together[i, : len(s)], alone[i]):
                failures.append(f"sequence {i}: batched full forward differs from the forward of it alone")
        cache = model.new_cache(len(seqs))
        prompt = torch.tensor([1] * len(seqs))
        model.prefill(batch[:, :1], prompt, cache)
        for t in range(1, max(lengths)):
            step = model.decode(batch[:, t], torch.full((len(seqs),), t), cache)
            for i, s in enumerate(seqs):
                if t < len(s) and not torch.equal(step[i], alone[i][t]):
                    failures.append(f"sequence {i}, position {t}: decode differs from the full forward")
    return failures


def ensure_aligned(config) -> None:
    """Raise AlignmentError if aligned execution is not invariant for ``config`` here."""
    key = (tuple(sorted(dataclasses.asdict(config).items())), torch.get_num_threads())
    if key not in _CACHE:
        _CACHE[key] = invariance_failures(config)
    failures = _CACHE[key]
    if failures:
        raise AlignmentError(
            "aligned execution is not bitwise invariant on this machine "
            f"({torch.get_num_threads()} threads, torch {torch.__version__}): {failures[0]} "
            f"(and {len(failures) - 1} more). Use execution='fast', or report this machine."
        )
