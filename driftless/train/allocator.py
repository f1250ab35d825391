"""The learner process's C allocator: glibc's mmap threshold (``train.malloc_mmap_threshold``).

glibc serves an allocation of at least ``M_MMAP_THRESHOLD`` bytes with its own ``mmap`` and unmaps it when it is
freed. By default the threshold is dynamic: it starts at 128 KiB and rises to the size of each large block freed
(up to 32 MiB), so after the first few steps a training process's tensors come from the heap, whose freed pages
stay resident (glibc's "heap slack": 0.5-0.8 GB of SmolLM2's peak RSS here, docs/real-model.md). Fixing the
threshold (``mallopt``, what the ``MALLOC_MMAP_THRESHOLD_`` environment variable does for a whole process) hands
freed tensors back to the system, at the cost of fresh page faults when the next one is made. The setting is the
whole process's: with the thread runtime the sampler beside the learner gets it too.
"""

from __future__ import annotations

import ctypes
import platform

M_MMAP_THRESHOLD = -3  # <malloc.h>
MAX_MMAP_THRESHOLD = 32 * 2**20  # HEAP_MAX_SIZE / 2 on 64-bit: mallopt refuses more


def _glibc():
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return None
    try:
        return ctypes.CDLL("libc.so.6")
    except OSError:
        return None


def mmap_threshold_refusal(nbytes: int | None) -> str | None:
    """Why ``train.malloc_mmap_threshold=nbytes`` cannot be honoured in this process (None: it can, or it is unset)."""
    if nbytes is None:
        return None
    if not 0 <= nbytes <= MAX_MMAP_THRESHOLD:
        return f"train.malloc_mmap_threshold={nbytes}: glibc takes 0 to {MAX_MMAP_THRESHOLD} bytes"
    if _glibc() is None:
        return (f"train.malloc_mmap_threshold={nbytes} sets glibc's allocator (mallopt), and this process has none "
                f"({platform.system()}, {platform.libc_ver()[0] or 'another C library'}); leave it unset")
    return None


def set_mmap_threshold(nbytes: int) -> None:
    """Serve every allocation of at least ``nbytes`` by mmap, returned to the system when freed (this process)."""
    why = mmap_threshold_refusal(nbytes)
    if why:
        raise ValueError(why)
    if _glibc().mallopt(ctypes.c_int(M_MMAP_THRESHOLD), ctypes.c_int(nbytes)) != 1:
        raise ValueError(f"train.malloc_mmap_threshold={nbytes}: glibc's mallopt refused it")
