"""Reproducible execution: every operation of a training process with the same bits on any CPU.

Aligned execution (``ops.exact``) makes a model's *forward* machine-independent. Training also
runs a backward, a loss and its reductions, a gradient norm, an optimizer step, random draws
and the metrics; with torch's own kernels each of those may round differently under another
kernel set (scalar, AVX2, AVX-512), thread count or BLAS path. ``Reproducible`` closes that at the
one place every operation passes: it is a ``TorchDispatchMode``, so it sees each ATen operation
of the forward, of autograd's backward and of the optimizer, and for each one it does one of
three things:

1. **Runs it as it is** when its result cannot depend on the machine: IEEE 754 elementwise
   + − × ÷ (each correctly rounded, one kernel per operation, so never fused into an FMA),
   comparisons, selections, casts, copies, views and indexing, exact reductions (max, min, any,
   integer sums), uniform and integer random draws (the same bits under every kernel set).
2. **Replaces it** with a construction whose bits are fixed by definition (the rules below):
   - sums and means of floating values (and norms, variances, softmax sums): exact sums of
     fixed-point integer codes in float64, two slices of ``53 − ⌈log2 K⌉`` bits per value (exact in
     any order; ``exact_sum_rows``);
   - matrix products: the fixed-order float32 GEMM (``ops.fixed_mm``: one fma chain per output);
   - exp, log, sin, cos, sigmoid, powers: fixed polynomials from (1) (``ops.exact``'s exp32 / exp64
     / log64, and ``sincos64`` here); √: the processor's correctly rounded instruction (``exact_sqrt``:
     torch's ``sqrt`` goes through MKL's vector math, whose roots differ by MKL code branch);
   - fused multiply-adds in disguise (``add(alpha=)``, ``addcmul``, ``addcdiv``, ``lerp``,
     ``addmm``): their parts as separate correctly rounded operations;
   - the embedding's gradient (a scatter-add over repeated tokens): exact integer codes added;
   - normal draws: the inverse normal CDF of uniforms (``ndtri``); a categorical draw: an exact
     integer cumulative sum searched with one uniform per row; ``topk``: a stable sort;
   - attention's backward: written out with the pieces above.
3. **Refuses it** by name (``NotReproducible``) otherwise: an operation nobody has shown to be
   machine-independent never runs silently.

Code that is machine-independent by its own construction runs with the mode suspended
(``suspended()``): the aligned model pieces (``ops.fuse.fused``, compiled or eager), whose
integer-code sums must not be summed again as floats.

The price is Python on every operation (microseconds each) and the exact kernels' own cost:
``bench/reproducible.py`` measures a training step against a fast one.
"""

from __future__ import annotations

import contextlib
import math

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from driftless.ops import dispatch
from driftless.ops.dispatch import active, suspended  # noqa: F401 - re-exported
from driftless.ops.exact import (
    as_rows,
    exact_mean,
    exact_sqrt,
    exact_sum,
    exact_sum_rows,
    exp32,
    exp64,
    exponent_bound,
    keep_dims,
    log64,
    pow2,
    reduce_dims,
    reduction_bits,
)
from driftless.ops.fixed_mm import fixed_order_bmm, fixed_order_mm

aten = torch.ops.aten

class NotReproducible(RuntimeError):
    """An operation without a machine-independent definition was asked for under ``Reproducible``."""


# ------------------------------------------------------------------------------------------ elementwise functions
def exact_exp(x: torch.Tensor) -> torch.Tensor:
    """e^x with fixed polynomials: exp32 for float32 (and narrower, widened), exp64 for float64; overflow → inf."""
    if x.dtype == torch.float64:
        return exp64(x).masked_fill_(x > 709.782712893384, float("inf"))  # NaN stays NaN through every step
    x32 = x.float()
    return exp32(x32).masked_fill_(x32 > 88.72283935546875, float("inf")).to(x.dtype)


_TINY64 = 2.2250738585072014e-308  # the smallest normal float64


def log_f64(x: torch.Tensor) -> torch.Tensor:
    """ln x in float64 for any float64 ``x``: log64 on normal positives, IEEE's special values elsewhere."""
    sub = (x > 0) & (x < _TINY64)
    safe = torch.where((x > 0) & torch.isfinite(x), torch.where(sub, x * float(2 ** 54), x), torch.ones_like(x))
    out = log64(safe) - torch.where(sub, torch.full_like(x, 54 * 0.6931471805599453), torch.zeros_like(x))
    out = torch.where(x == 0, torch.full_like(x, float("-inf")), out)
    out = torch.where(x < 0, torch.full_like(x, float("nan")), out)
    out = torch.where(torch.isposinf(x), x, out)
    return torch.where(torch.isnan(x), x, out)


def exact_log(x: torch.Tensor) -> torch.Tensor:
    return log_f64(x.double()).to(x.dtype)


def exact_log1p(x: torch.Tensor) -> torch.Tensor:
    """ln(1 + x) = ln(u) · x / (u − 1) with u = 1 + x rounded (Goldberg's construction), in float64."""
    x64 = x.double()
    u = 1.0 + x64
    d = u - 1.0
    out = torch.where(d == 0, x64, log_f64(u) * (x64 / torch.where(d == 0, torch.ones_like(d), d)))
    out = torch.where(torch.isposinf(x64), x64, out)
    return out.to(x.dtype)


def exact_expm1(x: torch.Tensor) -> torch.Tensor:
    """e^x − 1 in float64: a Taylor polynomial for |x| < 1/2 (no cancellation), exp64 − 1 elsewhere."""
    x64 = x.double()
    p = torch.full_like(x64, 1.0 / math.factorial(18))
    for n in range(17, 0, -1):
        p = p * x64 + 1.0 / math.factorial(n)
    small = p * x64
    out = torch.where(x64.abs() < 0.5, small, exact_exp(x64) - 1.0)
    return out.to(x.dtype)


def exact_sigmoid(x: torch.Tensor) -> torch.Tensor:
    """1 / (1 + e^−x) in x's precision (float32 for float32: exp32 is within 2 ulp)."""
    return 1.0 / (1.0 + exact_exp(-x))


# sin / cos: Cody–Waite reduction by π/2 in three parts (fdlibm's split), Taylor polynomials on |r| ≤ π/4
_PIO2 = (1.57079632673412561417e+00, 6.07710050630396597660e-11, 2.02226624871116645580e-21)
_PIO2_TAIL = 8.47842766036889956997e-32
_TWO_OVER_PI = 6.36619772367581382433e-01


def sincos64(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(sin x, cos x) in float64, bitwise the same on any CPU; |x| < 2^20 · π/2 (else refused)."""
    x = x.double()
    if x.numel() and bool((x.abs() >= 1.6e6).any()):
        raise NotReproducible("sin / cos of |x| >= 1.6e6: outside the exact range reduction")
    n = torch.round(x * _TWO_OVER_PI)
    r = x - n * _PIO2[0]  # n · PIO2[0] is exact (33 + 21 bits)
    r = r - n * _PIO2[1]
    r = r - n * _PIO2[2]
    r = r - n * _PIO2_TAIL
    r2 = r * r
    s = torch.full_like(r, (-1) ** 9 / math.factorial(19))
    for j in range(8, -1, -1):
        s = s * r2 + (-1) ** j / math.factorial(2 * j + 1)
    s = s * r
    c = torch.full_like(r, (-1) ** 9 / math.factorial(18))
    for j in range(8, -1, -1):
        c = c * r2 + (-1) ** j / math.factorial(2 * j)
    q = torch.remainder(n, 4.0)
    sin = torch.where(q == 0, s, torch.where(q == 1, c, torch.where(q == 2, -s, -c)))
    cos = torch.where(q == 0, c, torch.where(q == 1, -s, torch.where(q == 2, -c, s)))
    return sin, cos


def exact_pow_scalar(x: torch.Tensor, e) -> torch.Tensor:
    """``x ** e`` for a Python number ``e``: products for small integers, √ for halves, exp(e · ln x) otherwise."""
    e = float(e)
    if e == 0:
        return torch.ones_like(x)
    if e == int(e) and abs(e) <= 8:
        n, out, base = abs(int(e)), None, x
        while n:  # binary powering: a fixed sequence of products
            if n & 1:
                out = base if out is None else out * base
            n >>= 1
            if n:
                base = base * base
        return 1.0 / out if e < 0 else out.clone()
    if e == 0.5:
        return exact_sqrt(x)
    if e == -0.5:
        return 1.0 / exact_sqrt(x)
    x64 = x.double()
    out = exact_exp(e * log_f64(x64))
    return out.to(x.dtype)


# ------------------------------------------------------------------------------------------ random draws
# Acklam's rational approximation of the inverse normal CDF (relative error < 1.2e-9): + − × ÷ √ and ln only
_A = (-3.969683028665376e+01, 2.209460984245205e+02, -2.759285104469687e+02, 1.383577518672690e+02,
      -3.066479806614716e+01, 2.506628277459239e+00)
_B = (-5.447609879822406e+01, 1.615858368580409e+02, -1.556989798598866e+02, 6.680131188771972e+01,
      -1.328068155288572e+01)
_C = (-7.784894002430293e-03, -3.223964580411365e-01, -2.400758277161838e+00, -2.549732539343734e+00,
      4.374664141464968e+00, 2.938163982698783e+00)
_D = (7.784695709041462e-03, 3.224671290700398e-01, 2.445134137142996e+00, 3.754408661907416e+00)
_P_LOW = 0.02425


def _horner(coefs, x: torch.Tensor) -> torch.Tensor:
    out = torch.full_like(x, coefs[0])
    for c in coefs[1:]:
        out = out * x + c
    return out


def ndtri(p: torch.Tensor) -> torch.Tensor:
    """The standard normal quantile of ``p`` in (0, 1), float64, bitwise the same on any CPU."""
    p = p.double()
    q = p - 0.5
    r = q * q
    central = _horner(_A, r) * q / _horner((*_B, 1.0), r)
    tail_p = torch.where(p < 0.5, p, 1.0 - p).clamp_min(1e-300)
    t = exact_sqrt(-2.0 * log_f64(tail_p))
    tail = _horner(_C, t) / _horner((*_D, 1.0), t)
    tail = torch.where(p < 0.5, tail, -tail)
    return torch.where(torch.abs(q) <= 0.5 - _P_LOW, central, tail)


def standard_normal(shape, generator=None) -> torch.Tensor:
    """Standard normal draws (float64) from torch's uniform draws: ``ndtri((u + 2^−54))``, u in [0, 1) on 2^−53's grid."""
    u = torch.rand(shape, dtype=torch.float64, generator=generator)
    return ndtri(u + 2.0 ** -54)  # in (0, 1), symmetric about 1/2


def categorical(probs: torch.Tensor, generator=None) -> torch.Tensor:
    """One draw per row of ``probs [..., V]`` (unnormalised, >= 0): exact integer cumulative sums, one uniform a row."""
    rows = probs.reshape(-1, probs.shape[-1]).double()
    v = rows.shape[-1]
    bits = reduction_bits(v) - 1
    e = exponent_bound(rows.amax(-1, keepdim=True))
    codes = torch.round(rows * pow2(bits - e))  # integers <= 2^bits
    cdf = torch.cumsum(codes, -1)  # integers below 2^53: exact in any order
    total = cdf[:, -1:]
    if bool((total <= 0).any()):
        raise NotReproducible("multinomial: a row without positive probability")
    u = torch.rand(rows.shape[0], 1, dtype=torch.float64, generator=generator)
    target = torch.minimum(torch.floor(u * total), total - 1.0)
    out = torch.searchsorted(cdf, target, right=True)  # the first index whose cdf exceeds the target: a positive code
    return out.reshape(*probs.shape[:-1], 1)


# ------------------------------------------------------------------------------------------ products
def exact_mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    if a.dtype != torch.float32 or b.dtype != torch.float32:
        raise NotReproducible(f"mm of {a.dtype} x {b.dtype}: the fixed-order GEMM is float32")
    return fixed_order_mm(a, b)


def exact_bmm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    if a.dtype != torch.float32 or b.dtype != torch.float32:
        raise NotReproducible(f"bmm of {a.dtype} x {b.dtype}: the fixed-order GEMM is float32")
    return fixed_order_bmm(a, b)


def _scaled(out: torch.Tensor, alpha) -> torch.Tensor:
    return out if alpha == 1 else out * alpha


def _plus(base: torch.Tensor, beta, out: torch.Tensor) -> torch.Tensor:
    if beta == 0:
        return out
    return (base if beta == 1 else base * beta) + out


# ------------------------------------------------------------------------------------------ softmax pieces
def _softmax64(x: torch.Tensor, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(log-softmax, softmax) of ``x`` along ``dim`` in float64, exact sums."""
    x = x.double().movedim(dim, -1)
    m = x.amax(-1, keepdim=True)
    z = x - torch.where(torch.isinf(m), torch.zeros_like(m), m)
    e = exp64(z)
    total = exact_sum_rows(e)[..., None]
    return (z - log_f64(total)).movedim(-1, dim), (e / total).movedim(-1, dim)


def exact_logsumexp(x: torch.Tensor, dim, keepdim: bool = False) -> torch.Tensor:
    dims = reduce_dims(x, dim)
    rows = as_rows(x.double(), dims)
    m = rows.amax(-1, keepdim=True)
    m = torch.where(torch.isinf(m), torch.zeros_like(m), m)
    out = m[..., 0] + log_f64(exact_sum_rows(exp64(rows - m)))
    return keep_dims(out, x, dims, keepdim).to(x.dtype)


def attention_backward(grad_out, q, k, v, scale: float, is_causal: bool, attn_mask):
    """Gradients of softmax(scale · q kᵀ + mask) v for q ``[B, H, T, D]``, k, v ``[B, Hkv, S, D]`` (grouped heads)."""
    b, h, t, d = q.shape
    h_kv, s = k.shape[1], k.shape[2]
    g = h // h_kv
    qr = q.reshape(b * h_kv, g * t, d)  # rows (group, position), as exact_attention lays them out
    kr, vr = k.reshape(b * h_kv, s, d), v.reshape(b * h_kv, s, d)
    go = grad_out.reshape(b * h_kv, g * t, d)
    scores = exact_bmm(qr, kr.transpose(1, 2).contiguous()) * scale
    hidden = torch.zeros(t, s, dtype=torch.bool)
    if is_causal:
        hidden = torch.ones(t, s, dtype=torch.bool).triu(1)
    hidden = hidden.repeat(g, 1)  # [(g, t), s]
    if attn_mask is not None:
        if attn_mask.dtype != torch.bool:
            raise NotReproducible("attention backward with an additive mask")
        hidden = hidden | ~attn_mask.expand(b, h, t, s).reshape(b * h_kv, g * t, s)
    scores = scores.masked_fill(hidden, float("-inf"))
    _, p = _softmax64(scores, -1)
    p32 = p.float()
    grad_v = exact_bmm(p32.transpose(1, 2).contiguous(), go)
    dp = exact_bmm(go, vr.transpose(1, 2).contiguous()).double()
    ds = (p * (dp - exact_sum_rows(dp * p)[..., None])).float() * scale
    grad_q = exact_bmm(ds, kr)
    grad_k = exact_bmm(ds.transpose(1, 2).contiguous(), qr)
    return grad_q.reshape(q.shape), grad_k.reshape(k.shape), grad_v.reshape(v.shape)


# ------------------------------------------------------------------------------------------ the op table
_PASS = {
    # shapes, views, copies, creation, indexing
    "view", "_unsafe_view", "reshape", "t", "transpose", "transpose_", "permute", "expand", "squeeze", "squeeze_",
    "unsqueeze", "unsqueeze_", "slice", "select", "split", "split_with_sizes", "unbind", "narrow", "as_strided",
    "alias", "detach", "clone", "contiguous", "_to_copy", "copy_", "cat", "stack", "index", "index_select",
    "gather", "masked_fill", "masked_fill_", "where", "fill_", "zero_", "zeros", "ones", "full", "empty",
    "empty_like", "empty_strided", "zeros_like", "ones_like", "full_like", "new_empty", "new_zeros", "new_ones",
    "new_full", "new_empty_strided", "arange", "lift_fresh", "lift_fresh_copy", "scalar_tensor", "_local_scalar_dense",
    "roll", "flip", "repeat", "repeat_interleave", "constant_pad_nd", "tril", "triu", "set_", "scatter", "scatter_", "masked_select", "nonzero", "expand_copy", "view_copy", "split_copy",
    "_unique2", "unique_dim", "unique_consecutive", "isin", "equal", "is_nonzero", "resize_", "diagonal",
    "movedim", "unfold", "_reshape_alias", "clamp", "clamp_", "clamp_min", "clamp_min_", "clamp_max", "clamp_max_",
    "searchsorted", "bucketize", "one_hot", "record_stream", "_has_compatible_shallow_copy_type",
    "select_backward", "slice_backward", "diagonal_backward", "unfold_backward", "index_fill", "index_fill_",
    "masked_scatter", "masked_scatter_", "fill",
    # correctly rounded elementwise arithmetic (alpha / value handled by rules), comparisons, bit operations
    "mul", "mul_", "div", "div_", "neg", "neg_", "abs", "abs_", "reciprocal", "reciprocal_",
    "minimum", "maximum", "fmax", "fmin", "sign", "sgn", "signbit", "round", "round_", "floor", "floor_", "ceil",
    "ceil_", "trunc", "trunc_", "frac", "remainder", "fmod", "frexp", "ldexp", "nextafter", "copysign",
    "eq", "ne", "lt", "le", "gt", "ge", "logical_and", "logical_or", "logical_not", "logical_xor",
    "bitwise_and", "bitwise_and_", "bitwise_or", "bitwise_or_", "bitwise_xor", "bitwise_not", "__lshift__",
    "__rshift__", "bitwise_left_shift", "bitwise_right_shift", "isnan", "isinf", "isfinite", "isposinf",
    "isneginf", "nan_to_num", "square", "relu", "threshold_backward", "heaviside",
    # exact reductions and selections
    "amax", "amin", "aminmax", "max", "min", "argmax", "argmin", "any", "all", "count_nonzero", "kthvalue",
    "median", "cummax", "cummin",
    # random draws whose bits every kernel set shares (uniform and integer draws from the CPU generator)
    "uniform_", "random_", "randint", "randperm", "rand",
    # profiler markers
    "_record_function_enter_new", "_record_function_exit",
}

_INTEGER_REDUCTIONS = {"sum", "mean", "cumsum", "prod", "cumprod"}  # exact on integers and booleans


def _alpha(kwargs) -> float:
    return kwargs.get("alpha", 1)


def _inplace(target: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    return target.copy_(value)


def _rule_add(func, args, kwargs):
    self, other = args[0], args[1]
    alpha = _alpha(kwargs)
    if alpha == 1:
        return func(self, other)
    scaled = other * alpha
    return func(self, scaled)


def _rule_rsub(func, args, kwargs):
    self, other = args[0], args[1]
    alpha = _alpha(kwargs)
    return other - (self if alpha == 1 else self * alpha)


def _rule_addcmul(func, args, kwargs):
    self, t1, t2 = args[:3]
    value = kwargs.get("value", args[3] if len(args) > 3 else 1)
    prod = _scaled(t1 * t2, value)
    return self.add_(prod) if func._overloadpacket.__name__.endswith("_") else self + prod


def _rule_addcdiv(func, args, kwargs):
    self, t1, t2 = args[:3]
    value = kwargs.get("value", args[3] if len(args) > 3 else 1)
    quot = _scaled(t1 / t2, value)
    return self.add_(quot) if func._overloadpacket.__name__.endswith("_") else self + quot


def _rule_lerp(func, args, kwargs):
    start, end, weight = args[:3]
    step = (end - start) * weight
    return start.add_(step) if func._overloadpacket.__name__.endswith("_") else start + step


def _rule_sum(func, args, kwargs):
    x = args[0]
    dtype = kwargs.get("dtype")
    if not x.is_floating_point() and not (dtype is not None and dtype.is_floating_point):
        return func(*args, **kwargs)
    dim = args[1] if len(args) > 1 else kwargs.get("dim")
    keepdim = args[2] if len(args) > 2 else kwargs.get("keepdim", False)
    return exact_sum(x, dim, keepdim, dtype)


def _rule_mean(func, args, kwargs):
    x = args[0]
    dim = args[1] if len(args) > 1 else kwargs.get("dim")
    keepdim = args[2] if len(args) > 2 else kwargs.get("keepdim", False)
    return exact_mean(x, dim, keepdim, kwargs.get("dtype"))


def _named(func, args, kwargs) -> dict:
    """An operation's arguments by their schema names, defaults filled in."""
    out = {}
    for i, arg in enumerate(func._schema.arguments):
        if i < len(args):
            out[arg.name] = args[i]
        elif arg.name in kwargs:
            out[arg.name] = kwargs[arg.name]
        elif arg.has_default_value():
            out[arg.name] = arg.default_value
    return out


def _rule_var(func, args, kwargs, root: bool = False):
    a = _named(func, args, kwargs)
    x = a["self"]
    correction = a.get("correction")
    if correction is None:
        correction = 1 if a.get("unbiased", True) else 0
    dims = reduce_dims(x, a.get("dim"))
    rows = as_rows(x.double(), dims)
    n = rows.shape[-1]
    mean = exact_sum_rows(rows)[..., None] / n
    dev = rows - mean
    var = exact_sum_rows(dev * dev) / max(n - correction, 0)
    out = exact_sqrt(var) if root else var
    return keep_dims(out, x, dims, a.get("keepdim", False)).to(x.dtype)


def _rule_norm(func, args, kwargs):
    x = args[0]
    ord_ = args[1] if len(args) > 1 else kwargs.get("ord", 2)
    dim = args[2] if len(args) > 2 else kwargs.get("dim")
    keepdim = args[3] if len(args) > 3 else kwargs.get("keepdim", False)
    dtype = kwargs.get("dtype") or x.dtype
    dims = reduce_dims(x, dim)
    rows = as_rows(x.double(), dims)
    if ord_ == 2:
        out = exact_sqrt(exact_sum_rows(rows * rows))  # a float32 value's square is exact in float64
    elif ord_ == 1:
        out = exact_sum_rows(rows.abs())
    elif ord_ == float("inf"):
        out = rows.abs().amax(-1)
    else:
        raise NotReproducible(f"vector norm of order {ord_}")
    return keep_dims(out, x, dims, keepdim).to(dtype)


def _rule_mm(func, args, kwargs):
    return exact_mm(args[0], args[1])


def _rule_bmm(func, args, kwargs):
    return exact_bmm(args[0], args[1])


def _rule_addmm(func, args, kwargs):
    base, a, b = args[:3]
    return _plus(base, kwargs.get("beta", 1), _scaled(exact_mm(a, b), kwargs.get("alpha", 1)))


def _rule_baddbmm(func, args, kwargs):
    base, a, b = args[:3]
    return _plus(base, kwargs.get("beta", 1), _scaled(exact_bmm(a, b), kwargs.get("alpha", 1)))


def _rule_mv(func, args, kwargs):
    return exact_mm(args[0], args[1][:, None])[:, 0]


def _rule_dot(func, args, kwargs):
    return exact_mm(args[0][None], args[1][:, None])[0, 0]


def _rule_exp(func, args, kwargs):
    out = exact_exp(args[0])
    return args[0].copy_(out) if func._overloadpacket.__name__.endswith("_") else out


def _unary(fn):
    def rule(func, args, kwargs):
        out = fn(args[0])
        return args[0].copy_(out) if func._overloadpacket.__name__.endswith("_") else out
    return rule


def _rule_rsqrt(x):
    return 1.0 / exact_sqrt(x)


def _rule_tanh(x):
    return (2.0 * exact_sigmoid(2.0 * x.double()) - 1.0).to(x.dtype)


def _rule_sin(x):
    return sincos64(x)[0].to(x.dtype)


def _rule_cos(x):
    return sincos64(x)[1].to(x.dtype)


def _rule_pow(func, args, kwargs):
    name = func.__name__
    base, exponent = args[0], args[1]
    if name.startswith("pow.Tensor_Scalar") or (func._overloadpacket.__name__ == "pow_" and not isinstance(exponent, torch.Tensor)):
        out = exact_pow_scalar(base, exponent)
    elif name.startswith("pow.Scalar"):
        out = exact_exp(exponent.double() * log_f64(torch.tensor(float(base), dtype=torch.float64))).to(exponent.dtype)
    else:
        out = exact_exp(exponent.double() * log_f64(base.double())).to(torch.promote_types(base.dtype, exponent.dtype))
    return base.copy_(out) if func._overloadpacket.__name__.endswith("_") else out


def _rule_log_softmax(func, args, kwargs):
    x, dim = args[0], args[1]
    return _softmax64(x, dim)[0].to(torch.float32 if len(args) > 2 and args[2] else x.dtype)


def _rule_softmax(func, args, kwargs):
    x, dim = args[0], args[1]
    return _softmax64(x, dim)[1].to(torch.float32 if len(args) > 2 and args[2] else x.dtype)


def _rule_log_softmax_backward(func, args, kwargs):
    grad, out, dim, dtype = args[:4]
    g = grad.double().movedim(dim, -1)
    o = out.double().movedim(dim, -1)
    result = g - exp64(o) * exact_sum_rows(g)[..., None]
    return result.movedim(-1, dim).to(dtype)


def _rule_softmax_backward(func, args, kwargs):
    grad, out, dim, dtype = args[:4]
    g = grad.double().movedim(dim, -1)
    o = out.double().movedim(dim, -1)
    result = o * (g - exact_sum_rows(g * o)[..., None])
    return result.movedim(-1, dim).to(dtype)


def _rule_logsumexp(func, args, kwargs):
    return exact_logsumexp(args[0], args[1], args[2] if len(args) > 2 else kwargs.get("keepdim", False))


def exact_index_sum(index: torch.Tensor, source: torch.Tensor, size: int) -> torch.Tensor:
    """``out[i] = Σ_{j: index[j] = i} source[j]`` (``source [N, ...]``, float64 result ``[size, ...]``), exact in any order.

    Each column of ``source`` is written in two slices of integer codes on one grid (its largest
    magnitude's), added with ``index_add_`` (sums of integers below 2^53: no rounding, so neither the
    order of repeated indices nor threads matter), and joined by one rounding.
    """
    rows = source.double().reshape(source.shape[0], -1)
    if not bool(torch.isfinite(rows).all()):
        raise NotReproducible("an indexed sum of non-finite values")
    b = reduction_bits(max(rows.shape[0], 1)) - 1
    e = exponent_bound(rows.abs().amax(0, keepdim=True)) if rows.shape[0] else torch.zeros(1, rows.shape[1], dtype=torch.int64)
    scaled = rows * pow2(b - e)
    hi = torch.round(scaled)
    lo = torch.round((scaled - hi) * float(2 ** b))
    sum_hi = rows.new_zeros(size, rows.shape[1]).index_add_(0, index, hi)
    sum_lo = rows.new_zeros(size, rows.shape[1]).index_add_(0, index, lo)
    out = (sum_hi + sum_lo * float(2.0 ** -b)) * pow2(e - b)
    return out.reshape(size, *source.shape[1:])


def _rule_embedding_backward(func, args, kwargs):
    grad, indices, num_weights, padding_idx, scale_by_freq = args[:5]
    if scale_by_freq:
        raise NotReproducible("embedding backward with scale_grad_by_freq")
    out = exact_index_sum(indices.reshape(-1), grad.reshape(-1, grad.shape[-1]), num_weights)
    if padding_idx >= 0:
        out[padding_idx] = 0
    return out.to(grad.dtype)


def _rule_index_add(func, args, kwargs):
    target, dim, index, source = args[:4]
    if not target.is_floating_point():
        return func(*args, **kwargs)
    alpha = kwargs.get("alpha", 1)
    src = source.movedim(dim, 0) if source.dim() else source.reshape(1)
    added = exact_index_sum(index, src if alpha == 1 else src * alpha, target.shape[dim] if target.dim() else 1)
    added = added.movedim(0, dim) if target.dim() else added.reshape(())
    result = (target.double() + added).to(target.dtype)  # one rounding of the target's value plus the exact sum
    return target.copy_(result) if func._overloadpacket.__name__.endswith("_") else result


def _rule_scatter_add(func, args, kwargs):
    return func(*args, **kwargs)  # CPU scatter-add adds along the dim in index order, one slice per thread


def _rule_index_put(func, args, kwargs):
    accumulate = args[3] if len(args) > 3 else kwargs.get("accumulate", False)
    if accumulate and args[0].is_floating_point():
        raise NotReproducible("index_put with accumulate=True of floating values")
    return func(*args, **kwargs)


def _rule_sdpa_backward(func, args, kwargs):
    grad_out, q, k, v, _out, _lse, dropout_p, is_causal = args[:8]
    if dropout_p:
        raise NotReproducible("attention with dropout")
    scale = kwargs.get("scale")
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    return attention_backward(grad_out, q, k, v, scale, is_causal, kwargs.get("attn_mask"))


def _rule_sdpa_forward(func, args, kwargs):
    return func(*args, **kwargs)  # runs only to rebuild a graph whose backward is the rule above; values unused


def _rule_normal_(func, args, kwargs):
    self = args[0]
    mean = args[1] if len(args) > 1 else kwargs.get("mean", 0.0)
    std = args[2] if len(args) > 2 else kwargs.get("std", 1.0)
    z = standard_normal(self.shape, kwargs.get("generator"))
    return self.copy_(z * std + mean)


def _rule_randn(func, args, kwargs):
    dtype = kwargs.get("dtype") or torch.get_default_dtype()
    return standard_normal(tuple(args[0]), kwargs.get("generator")).to(dtype)


def _rule_multinomial(func, args, kwargs):
    probs, n = args[0], args[1]
    replacement = args[2] if len(args) > 2 else kwargs.get("replacement", False)
    if n != 1 and not replacement:
        raise NotReproducible("multinomial of several draws without replacement")
    draws = [categorical(probs, kwargs.get("generator")) for _ in range(n)]
    return torch.cat(draws, -1)


def _rule_topk(func, args, kwargs):
    x, k = args[0], args[1]
    dim = args[2] if len(args) > 2 else kwargs.get("dim", -1)
    largest = args[3] if len(args) > 3 else kwargs.get("largest", True)
    values, order = torch.sort(x, dim=dim, descending=largest, stable=True)  # ties in index order, on any machine
    return values.narrow(dim, 0, k), order.narrow(dim, 0, k)


def _rule_sort(func, args, kwargs):
    x = args[0]
    if func._overloadpacket.__name__ == "sort" and func.__name__.startswith("sort.stable"):
        return func(*args, **kwargs)
    dim = args[1] if len(args) > 1 else kwargs.get("dim", -1)
    descending = args[2] if len(args) > 2 else kwargs.get("descending", False)
    return torch.sort(x, dim=dim, descending=descending, stable=True)


def _rule_nll_forward(func, args, kwargs):
    x, target, weight, reduction, ignore_index = args[:5]
    if weight is not None:
        raise NotReproducible("nll_loss with class weights")
    keep = target != ignore_index
    picked = -x.gather(-1, torch.where(keep, target, 0)[..., None])[..., 0]
    picked = torch.where(keep, picked, torch.zeros_like(picked))
    count = keep.sum().to(x.dtype)
    if reduction == 0:
        return picked, count
    total = exact_sum(picked)
    return (total / count if reduction == 1 else total), count


def _rule_nll_backward(func, args, kwargs):
    grad, x, target, _weight, reduction, ignore_index, total_weight = args[:7]
    keep = target != ignore_index
    g = grad if reduction == 0 else (grad / total_weight if reduction == 1 else grad).expand(target.shape)
    g = torch.where(keep, -g, torch.zeros_like(g))
    out = torch.zeros_like(x)
    return out.scatter_(-1, torch.where(keep, target, 0)[..., None], g[..., None])


_RULES = {
    "add": _rule_add, "add_": _rule_add, "sub": _rule_add, "sub_": _rule_add, "rsub": _rule_rsub,
    "addcmul": _rule_addcmul, "addcmul_": _rule_addcmul, "addcdiv": _rule_addcdiv, "addcdiv_": _rule_addcdiv,
    "lerp": _rule_lerp, "lerp_": _rule_lerp,
    "sum": _rule_sum, "mean": _rule_mean, "var": _rule_var, "std": lambda f, a, k: _rule_var(f, a, k, root=True),
    "linalg_vector_norm": _rule_norm, "norm": _rule_norm,
    "mm": _rule_mm, "bmm": _rule_bmm, "addmm": _rule_addmm, "baddbmm": _rule_baddbmm, "mv": _rule_mv,
    "dot": _rule_dot,
    "exp": _rule_exp, "exp_": _rule_exp, "log": _unary(exact_log), "log_": _unary(exact_log),
    "log1p": _unary(exact_log1p), "expm1": _unary(exact_expm1), "sigmoid": _unary(exact_sigmoid),
    "sigmoid_": _unary(exact_sigmoid), "rsqrt": _unary(_rule_rsqrt), "rsqrt_": _unary(_rule_rsqrt),
    "sqrt": _unary(exact_sqrt), "sqrt_": _unary(exact_sqrt),
    "tanh": _unary(_rule_tanh), "sin": _unary(_rule_sin), "cos": _unary(_rule_cos),
    "pow": _rule_pow, "pow_": _rule_pow,
    "_log_softmax": _rule_log_softmax, "_softmax": _rule_softmax,
    "_log_softmax_backward_data": _rule_log_softmax_backward, "_softmax_backward_data": _rule_softmax_backward,
    "logsumexp": _rule_logsumexp,
    "embedding_dense_backward": _rule_embedding_backward, "embedding": lambda f, a, k: f(*a, **k),
    "index_add": _rule_index_add, "index_add_": _rule_index_add, "scatter_add": _rule_scatter_add,
    "scatter_add_": _rule_scatter_add, "index_put_": _rule_index_put, "index_put": _rule_index_put,
    "_scaled_dot_product_flash_attention_for_cpu_backward": _rule_sdpa_backward,
    "_scaled_dot_product_flash_attention_for_cpu": _rule_sdpa_forward,
    "normal_": _rule_normal_, "randn": _rule_randn, "multinomial": _rule_multinomial,
    "topk": _rule_topk, "sort": _rule_sort,
    "nll_loss_forward": _rule_nll_forward, "nll_loss_backward": _rule_nll_backward,
}


def within(enabled: bool = True):
    """A ``Reproducible`` mode to enter (``enabled`` and none on yet), else a context that does nothing."""
    return Reproducible() if enabled and not active() else contextlib.nullcontext()


class Reproducible(TorchDispatchMode):
    """While entered, every ATen operation runs as it is, by a rule, or is refused (the module docstring).

    ``with Reproducible(): ...`` around a whole process's work (the model's construction, the warm
    start, every step); nests; applies to CPU tensors (a CUDA operand is refused).
    """

    def __enter__(self):
        dispatch.entered += 1
        try:
            return super().__enter__()
        except BaseException:
            dispatch.entered -= 1
            raise

    def __exit__(self, *exc):
        try:
            return super().__exit__(*exc)
        finally:
            dispatch.entered -= 1

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func._overloadpacket.__name__
        if name in _PASS:
            return func(*args, **kwargs)
        rule = _RULES.get(name)
        if rule is not None:
            for a in args:
                if isinstance(a, torch.Tensor) and a.device.type != "cpu":
                    raise NotReproducible(f"{func} on {a.device}: reproducible execution is CPU-only")
            return rule(func, args, kwargs)
        if name in _INTEGER_REDUCTIONS and not any(isinstance(a, torch.Tensor) and a.is_floating_point() for a in args):
            return func(*args, **kwargs)
        raise NotReproducible(
            f"{func} has no machine-independent definition in driftless.ops.reproducible (train.reproducible=true "
            "runs only operations whose bits are the same on every CPU): add a rule for it, or train without it")
