"""Fused aligned kernels: the aligned pieces compiled by inductor, the same bits as eager.

Aligned execution (``ops.exact``) spends most of its time outside the GEMMs, in chains of
elementwise operations (snap, round, the fixed polynomials of exp, the softmax pieces) that eager
PyTorch runs one kernel and one pass over memory at a time. ``fused`` compiles such a function
with ``torch.compile`` (inductor's C++ backend) into a few loops. The bits stay those of eager
execution, on any CPU, because of what is and is not in the generated code:

- every operation of the chain is still its own correctly rounded IEEE 754 operation: inductor
  emits one C++ expression per op, compiled with ``-ffp-contract=off`` (no FMA contraction,
  forced here whatever ``TORCHINDUCTOR_CPP_ENABLE_FLOATING_POINT_CONTRACT_FLAG`` says) and
  ``-fno-unsafe-math-optimizations`` (no reassociation or reciprocal tricks, also forced), and
  on the CPU it keeps ``x / c`` a division (it rewrites it as ``x · (1/c)`` only on GPUs);
- vector width (scalar, AVX2, AVX-512: inductor follows ``ATEN_CPU_CAPABILITY``) cannot change
  a correctly rounded elementwise result, and the only reductions are ``amax`` (exact) and sums
  of integer codes below 2^53 (exact in any order), so neither can blocking or threading;
- the thread count is read when a kernel runs, not compiled in (``cpp.dynamic_threads``): the only
  reductions are exact in any split, so one library serves every thread count, and a process at 2
  threads (the demo's warm start) compiles what processes at 1 thread (its runs) then load from
  inductor's cache (without it each thread count compiled every graph again: 19 graphs, about a
  minute a process on a 2-core EPYC);
- the GEMMs stay outside the generated code: the fixed-order GEMM (``ops.fixed_mm``) is one opaque
  custom op in the graph, the same C kernel as eager;
- the compiler's ``-fno-signed-zeros`` may change the sign of a zero, never a nonzero value: no
  aligned piece divides by, or takes the logarithm of, a quantity that can be zero.

``tests/test_fuse.py`` checks compiled against eager with ``torch.equal`` (and through the
cross-process check, across the kernel sets this CPU runs); at run time each piece's first compiled
call is compared with its eager definition, and a difference means eager from then on, warned once.
Switch: ``DRIFTLESS_FUSED_ALIGNED=0`` (or ``set_fused(False)``) runs the eager definitions. A compile that cannot build here (no C++
compiler, an unsupported platform, ``ATEN_CPU_CAPABILITY=default``, for which inductor's build
fails) falls back to eager with a one-line warning: the same bits, only slower.
"""

from __future__ import annotations

import contextlib
import functools
import os
import threading
import warnings

import torch

from driftless.ops.dispatch import active as reproducible_active
from driftless.ops.dispatch import suspended

ENV = "DRIFTLESS_FUSED_ALIGNED"
# forced whatever the environment asks of inductor: the first two are what the bits rest on; the third lets one
# compiled library serve every thread count; the fourth stores an elementwise chain of more than 30 operations (exp64,
# log64: an fp32 or fp64 buffer, the same values) instead of inlining it into each loop that reads it (torch 2.13's
# CPU default is 50): with the chain copied into every reduction loop the log-softmax piece's code generation took 9 s
# cold and takes 1 s, its kernel as fast (bench/compile_cost.py)
INDUCTOR_OPTIONS = {"cpp.enable_floating_point_contract_flag": "off", "cpp.enable_unsafe_math_opt_flag": False,
                    "cpp.dynamic_threads": True, "realize_opcount_threshold": 30}

RECOMPILE_LIMIT = 64  # dynamo's per-function limit is raised to this (never lowered) when fusing

_choice: bool | None = None  # set_fused(); None: the environment decides
_broken: str | None = None  # why compiling failed here, once it has
_local = threading.local()  # unfused(): this thread's override


def fused_enabled() -> bool:
    """Whether aligned pieces run compiled (``set_fused``, else ``DRIFTLESS_FUSED_ALIGNED``, default on)."""
    if _broken is not None or getattr(_local, "off", False):
        return False
    if _choice is not None:
        return _choice
    value = os.environ.get(ENV, "1")
    if value not in ("0", "1"):
        raise ValueError(f"{ENV} must be 0 or 1, got {value!r}")
    return value == "1"


def set_fused(enabled: bool | None) -> None:
    """Run aligned pieces compiled (True) or eager (False); None returns the choice to the environment."""
    global _choice
    if enabled is not None and not isinstance(enabled, bool):
        raise ValueError(f"set_fused takes True, False or None, got {enabled!r}")
    _choice = enabled


@contextlib.contextmanager
def unfused():
    """Run the eager definitions in this thread inside the block (the same bits: see the module docstring), whatever
    the choice; other threads keep theirs."""
    saved = getattr(_local, "off", False)
    _local.off = True
    try:
        yield
    finally:
        _local.off = saved


def fusion_failure() -> str | None:
    """Why compiled aligned pieces are unavailable on this machine (None if they build or were not tried)."""
    return _broken


def _trace_settings():
    """dynamo's settings for a compiled piece's call, where this torch has them (each a no-op elsewhere):
    ``specialize_float`` on (float constants baked in: below) and duck sizing off (two dimensions of equal size
    at the first call, e.g. a warm start's batch of 64 rows and a head of 64, are not assumed equal: otherwise a
    later call where they differ compiles the piece again)."""
    stack = contextlib.ExitStack()
    for config, setting in _trace_configs():
        stack.enter_context(config.patch(**setting))
    return stack


@functools.cache
def _trace_configs() -> tuple:
    """(config module, setting) pairs of ``_trace_settings`` that this torch has, looked up once."""
    pairs = [(torch._dynamo.config, {"specialize_float": True})]
    try:
        from torch.fx.experimental import _config as shape_config
    except ImportError:  # an older torch
        shape_config = None
    pairs.append((shape_config, {"use_duck_shape": False}))
    return tuple((config, setting) for config, setting in pairs if all(hasattr(config, k) for k in setting))


def _needs_grad(args, kwargs) -> bool:
    if not torch.is_grad_enabled():
        return False
    return any(isinstance(a, torch.Tensor) and a.requires_grad for a in (*args, *kwargs.values()))


def _cache_per_kernel_set() -> None:
    """Point inductor's on-disk cache at a folder of its own per kernel set.

    Its cache key does not tell kernel sets apart (torch 2.13): a library built for AVX-512 is
    loaded by a process running with ``ATEN_CPU_CAPABILITY=avx2`` and the other way round, which
    here gave wrong values and heap corruption. One folder per (ATen kernel set, the CPU's vector
    extensions) keeps them apart; the user's ``TORCHINDUCTOR_CACHE_DIR``, if any, is the parent.
    The folder is named before inductor picks its vector ISA: that choice builds and loads a probe
    library per extension (about 8 s cold on a 2-core EPYC), cached in the folder it is made in, so
    processes started from this one (inheriting the variable: the demo's workers) find them built.
    """
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    base = os.environ.get("TORCHINDUCTOR_CACHE_DIR") or default_cache_dir()
    tag = f"driftless-{torch.backends.cpu.get_cpu_capability()}-{_vector_extensions()}"
    tag = "".join(ch if ch.isalnum() or ch in "-_" else "_" for ch in tag).lower()
    if os.path.basename(os.path.normpath(base)) != tag:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(base, tag)


def _vector_extensions() -> str:
    """The CPU's vector extensions as inductor reads them from /proc/cpuinfo (x86), building nothing; elsewhere the
    ISA inductor picks (its probes then built in the parent folder)."""
    import platform

    if platform.machine() in ("x86_64", "AMD64"):
        try:
            from torch._inductor.cpu_vec_isa import x86_isa_checker

            return "_".join(x86_isa_checker()) or "scalar"
        except ImportError:  # another torch's layout
            pass
    from torch._inductor.cpu_vec_isa import pick_vec_isa

    isa = pick_vec_isa()
    return str(isa) if isa else "scalar"


def _give_up(reason: str) -> None:
    """Eager from now on in this process, said once."""
    global _broken
    _broken = reason
    warnings.warn(f"driftless: fused aligned kernels unavailable here ({reason}); running the eager aligned "
                  f"path (the same bits, slower)", RuntimeWarning, stacklevel=3)


def _same(a, b) -> bool:
    """``torch.equal`` through tuples and lists, NaNs in the same places counting as equal."""
    if isinstance(a, (tuple, list)):
        return isinstance(b, (tuple, list)) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, torch.Tensor):
        if not isinstance(b, torch.Tensor) or a.shape != b.shape or a.dtype != b.dtype:
            return False
        if a.is_floating_point():
            nan = a.isnan()
            return torch.equal(nan, b.isnan()) and torch.equal(a.masked_fill(nan, 0), b.masked_fill(nan, 0))
        return torch.equal(a, b)
    return a == b


def _values(items) -> tuple:
    """``items`` with every tensor that requires grad detached (the same storage and values)."""
    return tuple(a.detach() if isinstance(a, torch.Tensor) and a.requires_grad else a for a in items)


def fused(fn):
    """``fn`` compiled by inductor when fusion is on, ``fn`` itself otherwise (``.eager`` is always ``fn``).

    Calls that need a gradient run eager (the compiled graph is built for values only). The first
    compiled call is run eager too and compared (``torch.equal``): a difference gives up compiling here
    (warned once) and returns the definition's result. If the
    compiled call raises and the eager one does not, compiling is broken here: warn once, run eager
    from then on. If eager raises too, the inputs are at fault and its error propagates.
    """
    compiled = None
    checked = False

    @functools.wraps(fn)
    def call(*args, **kwargs):
        if reproducible_active():  # machine-independent by construction: without the mode's rules
            with suspended():
                return _call(*args, **kwargs)
        return _call(*args, **kwargs)

    def _call(*args, **kwargs):
        nonlocal compiled, checked
        if not fused_enabled() or torch.compiler.is_compiling() or _needs_grad(args, kwargs):
            return fn(*args, **kwargs)
        # values only: the inputs' requires_grad flags (set in a custom Function's forward, where grad is off) would
        # otherwise make dynamo guard on them and compile the piece again for evaluation's plain tensors
        args, kwargs = _values(args), dict(zip(kwargs, _values(kwargs.values())))
        if compiled is None and os.environ.get("ATEN_CPU_CAPABILITY") == "default":
            # inductor (torch 2.13) emits vector code without its vector headers when told to use no vector
            # ISA, and the build fails: do not try (scalar eager kernels are what was asked for anyway)
            _give_up("ATEN_CPU_CAPABILITY=default: inductor has no scalar-only build")
            return fn(*args, **kwargs)
        if compiled is None:
            _cache_per_kernel_set()
            # one graph per reduction length (the code widths are Python ints of it) and per size-1
            # dimension: more than dynamo's default 8 per function across model sizes and batch shapes
            cfg = torch._dynamo.config
            name = "recompile_limit" if hasattr(cfg, "recompile_limit") else "cache_size_limit"  # torch < 2.6
            setattr(cfg, name, max(getattr(cfg, name), RECOMPILE_LIMIT))
            compiled = torch.compile(fn, dynamic=True, options=INDUCTOR_OPTIONS)
        try:
            # float constants (the exp polynomials' coefficients, eps) are baked in when traced: left symbolic,
            # inductor could not keep them so and dynamo traced every such graph twice in each process (about
            # 7 s of a demo worker's first evaluation, cached or not). The same operations: every compiled piece is
            # still checked against its definition at its first call, and make demo-verify compares the demo's lines
            # (and grad off: no input needs a gradient here, and dynamo guards on the grad mode)
            with _trace_settings(), torch.no_grad():
                out = compiled(*args, **kwargs)
        except Exception as err:  # noqa: BLE001 - decided below by running the definition itself
            out = fn(*args, **kwargs)
            cause = getattr(err, "inner_exception", None) or err  # inductor wraps the compiler's error
            first = (str(cause).strip().splitlines() or [""])[0][:200]
            _give_up(f"{type(cause).__name__}: {first}")
            return out
        if not checked:  # the first compiled call is compared with the definition, here, with this compiler
            checked = True
            eager = fn(*args, **kwargs)  # the in-place cache writes repeat the same values: idempotent
            if not _same(out, eager):
                _give_up(f"{fn.__name__}: its compiled output differs from its eager definition on this machine")
                return eager
        return out

    call.eager = fn
    return call
