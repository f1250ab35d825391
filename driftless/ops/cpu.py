"""Which CPU kernel sets this machine can run, and process profiles that differ in them.

torch dispatches its vectorised CPU kernels by capability (``ATEN_CPU_CAPABILITY``: ``default``
is the scalar build, then ``avx2``, then ``avx512`` on x86-64); a process forced to a set the CPU
lacks dies (illegal instruction). Cross-kernel checks therefore compare only sets taken from what
torch reports for this CPU (``torch.backends.cpu.get_cpu_capability()``): the reported set and
every set below it. Nothing here forces a capability the CPU does not have.
"""

from __future__ import annotations

from pathlib import Path

import torch

X86_KERNEL_SETS = ("default", "avx2", "avx512")  # each runs wherever the next one does
# MKL's conditional-numerical-reproducibility branch paired with each kernel set: the lower side of a
# pair pins a branch the CPU has, the upper side lets MKL choose (AUTO), so the BLAS code paths differ too.
_MKL_BRANCH = {"default": "COMPATIBLE", "avx2": "AVX2"}


def reported_kernel_set() -> str:
    """The kernel set torch runs in this process (lower case), e.g. ``avx2``."""
    return torch.backends.cpu.get_cpu_capability().lower()


def runnable_kernel_sets() -> tuple[str, ...]:
    """Kernel sets a subprocess may be forced to on this CPU, lowest first."""
    top = reported_kernel_set()
    if top in X86_KERNEL_SETS:
        return X86_KERNEL_SETS[: X86_KERNEL_SETS.index(top) + 1]
    return ("default",) if top == "default" else ("default", top)


def cpu_flags() -> frozenset[str]:
    """The instruction-set flags the kernel reports for this CPU (empty where /proc/cpuinfo is absent)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    for line in text.splitlines():
        if line.startswith("flags"):
            return frozenset(line.split(":", 1)[1].split())
    return frozenset()


def has_avx512_or_amx() -> bool:
    """Whether the CPU itself (not torch's dispatch choice) has AVX-512 foundation or AMX tiles."""
    flags = cpu_flags()
    return "avx512f" in flags or "amx_tile" in flags


def kernel_profile(kernel_set: str, *, threads: int, top: bool = False) -> dict[str, str]:
    """Environment for a subprocess running ``kernel_set`` (refused by name when this CPU cannot run it)."""
    runnable = runnable_kernel_sets()
    if kernel_set not in runnable:
        raise ValueError(f"ATEN_CPU_CAPABILITY={kernel_set!r} cannot run on this CPU (torch reports "
                         f"{reported_kernel_set()!r}; runnable: {', '.join(runnable)})")
    mkl = "AUTO" if top else _MKL_BRANCH.get(kernel_set, "AUTO")
    return {"ATEN_CPU_CAPABILITY": kernel_set, "MKL_CBWR": mkl, "OMP_NUM_THREADS": str(threads)}


def kernel_pairs() -> tuple[tuple[dict[str, str], dict[str, str]], ...]:
    """Pairs of (sampler, trainer) process profiles this CPU can run, as unlike as it allows.

    Always the scalar kernels (1 thread, MKL's compatible branch) against the reported set (2 threads,
    MKL's automatic branch); also AVX2 against AVX-512 where both run. Empty on a CPU with only scalar kernels.
    """
    sets = runnable_kernel_sets()
    if len(sets) < 2:
        return ()
    top = sets[-1]
    pairs = [(kernel_profile("default", threads=1), kernel_profile(top, threads=2, top=True))]
    if "avx2" in sets and "avx512" in sets:
        pairs.append((kernel_profile("avx2", threads=1), kernel_profile("avx512", threads=2, top=True)))
    return tuple(pairs)


def describe_profile(env: dict[str, str]) -> str:
    """``avx2 kernels, MKL AVX2, 1 thread``: a profile in words, for reports."""
    threads = env.get("OMP_NUM_THREADS", "?")
    return (f"{env.get('ATEN_CPU_CAPABILITY', 'reported')} kernels, MKL {env.get('MKL_CBWR', 'AUTO')}, "
            f"{threads} thread{'s' if threads != '1' else ''}")
