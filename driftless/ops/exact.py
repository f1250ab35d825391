"""Kernels whose bits do not depend on the machine: the arithmetic of aligned execution.

Aligned execution promises the same bits for a sequence whatever the batch, padding,
prefill/decode split, thread count, BLAS code path or CPU generation. Floating-point reductions
cannot promise that (their order changes with all of these), and neither can vectorised
transcendental functions (their polynomials change with the SIMD width). So aligned mode uses
only four kinds of operation, each exact or correctly rounded by IEEE 754 on every machine:

1. **Elementwise + − × ÷ √, comparisons, max, round, casts** (each result correctly rounded,
   one kernel per operation, so nothing can be fused into an FMA), and powers of two built from
   their bits (``pow2``). √ is ``exact_sqrt``: torch's own ``sqrt`` on x86 builds calls MKL's vector
   math, whose results are within an ulp but not correctly rounded and differ by MKL code branch.
2. **Fixed-order float32 GEMMs** for the linear layers and attention (``exact_linear``,
   ``exact_attention``): every output is one chain of fused multiply-adds in ``k`` order
   (``ops.fixed_mm``), vectorised only across independent outputs and threaded only across whole
   outputs, so no machine can reorder a sum.
3. **Integer arithmetic in float64** for the sums (``code_sum``, ``exact_sum_slices``: RMSNorm, softmax). An operand
   is written as fixed-point codes along its reduction dimension, ``x ≈ c · 2^(e − b)`` with
   integers ``|c| ≤ 2^b`` and ``e`` the exponent of the row's largest magnitude
   (``fixed_point``). A sum of ``K`` codes (or of products of two operands' codes) stays below
   ``2^53`` when ``b + ⌈log2 K⌉ ≤ 53`` (``b_x + b_y + ⌈log2 K⌉ ≤ 53``): every partial sum is then
   an exactly representable integer, so **any** summation order (any blocking, threading, SIMD
   width or BLAS) gives the same result.
4. **exp and log from (1)**: ``exp64`` / ``log64`` evaluate fixed polynomials in float64 with
   separate multiply and add kernels, so they give the same bits on any CPU (unlike
   ``torch.exp``, whose AVX2 and AVX-512 kernels may differ in the last place).

Precision: the GEMMs are float32 GEMMs with sequential accumulation (an ordinary fp32 GEMM's
error); the exact codes carry ``b ≈ 21–23`` bits per value relative to the row maximum and sum
without error. (3) is the Ozaki-style exact-accumulation idea (Ozaki et al., 2012) with one
slice; the GEMMs used it too (float64 GEMMs of codes) until the fixed-order GEMM, which is twice
as fast on CPUs where float64 runs at half the float32 rate.

The model-level pieces (``@fused``) run compiled by inductor when fusion is on (``ops.fuse``:
why the compiled code gives these functions' bits on any CPU); their definitions are the eager code here.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from driftless.ops.fixed_mm import fixed_order_bmm, fixed_order_mm, gemm_layout
from driftless.ops.fuse import fused


def exact_sqrt(x: torch.Tensor) -> torch.Tensor:
    """√x correctly rounded (IEEE 754), the same bits on every CPU.

    ``torch.sqrt`` on an x86 build calls MKL's vector math library (VML, "high accuracy": within an ulp, not
    correctly rounded), and its result follows the code branch MKL picks for the CPU: on an Intel Xeon with
    AVX-512, 15 % of a million float32 roots differ from the correctly rounded one under MKL's compatible
    branch, 0.7 % under AVX-512 and none under AVX2 (``tests/test_reproducible.py``). numpy's ``sqrt`` is the
    processor's square-root instruction, which IEEE 754 requires to round correctly. Compiled code
    (inductor) already emits that instruction, so a traced call keeps ``torch.sqrt``. Half and bfloat16 go
    through float32 (correctly rounded twice is still correct: 24 ≥ 2 · 11 + 2)."""
    if torch.compiler.is_compiling():
        return torch.sqrt(x)
    if x.dtype in (torch.float32, torch.float64):
        out = torch.empty_like(x, memory_format=torch.contiguous_format)
        np.sqrt(x.detach().contiguous().numpy(), out=out.numpy())
        return out
    if x.dtype in (torch.float16, torch.bfloat16):
        return exact_sqrt(x.float()).to(x.dtype)
    return torch.sqrt(x)  # integers promote to float32 in torch.sqrt: its result is the float32 root's

MANTISSA = 53  # float64 significand bits: integers up to 2^53 are exact
_EXP_LO, _EXP_HI = -900, 1000  # clamp for row exponents (keeps every pow2 argument in range)


def pow2(e: torch.Tensor) -> torch.Tensor:
    """``2.0 ** e`` in float64, exactly, for integer ``e`` in [-1022, 1023] (assembled from bits)."""
    return ((e.to(torch.int64) + 1023) << 52).view(torch.float64)


def _pow2_f32(e: torch.Tensor) -> torch.Tensor:
    """``2.0 ** e`` in float32, exactly, for integer (int32) ``e`` in [-126, 127]."""
    return ((e + 127) << 23).view(torch.float32)


def exponent_bound(a: torch.Tensor) -> torch.Tensor:
    """Integer ``e`` with ``a < 2^e`` for finite ``a >= 0``, read from the float64 bits (clamped to a safe range)."""
    biased = (a.double().view(torch.int64) >> 52) & 0x7FF
    return (biased - 1022).clamp(_EXP_LO, _EXP_HI)


def reduction_bits(k: int) -> int:
    """Total code bits for two operands of a length-``k`` dot product: sums of ``k`` products stay exact."""
    if k < 1:
        raise ValueError(f"reduction length must be >= 1, got {k}")
    log2_k = 0  # ⌈log2 k⌉ by comparisons: under torch.compile these are guards on k, not a symbolic log2 in
    while (1 << log2_k) < k:  # the graph (which keeps inductor's AOT cache from storing it)
        log2_k += 1
    return MANTISSA - log2_k


def fixed_point(x: torch.Tensor, bits: int, dim: int = -1) -> tuple[torch.Tensor, torch.Tensor]:
    """``x ≈ codes · 2^(e − bits)`` with integer codes ``|codes| ≤ 2^bits`` and ``e`` per slice along ``dim``.

    ``e`` is read from the slice's largest magnitude only, so a row's codes never depend on the
    other rows of the tensor. Returns (codes float64, e int64 with ``dim`` kept as size 1).
    """
    x = x.double()
    e = exponent_bound(x.abs().amax(dim, keepdim=True))
    return torch.round(x * pow2(bits - e)), e


def snap(x: torch.Tensor, bits: int) -> torch.Tensor:
    """``x`` rounded onto the grid of its row (last dim): multiples of 2^(e − bits), ``|x| < 2^e``; float64.

    Two snapped operands multiply and add exactly in float64 when their ``bits`` and the
    reduction length satisfy ``reduction_bits``: the products of a dot product share one quantum.
    float32 input is snapped in float32 (exact: power-of-two scalings and round), then widened.
    """
    amax = x.abs().amax(-1, keepdim=True)
    if x.dtype == torch.float32:
        e = torch.frexp(amax)[1].clamp_(bits - 126, 127 + bits)  # amax < 2^e; both scales stay normal floats
        up_bits = (bits + 127 - e) << 23  # the bits of 2^(bits − e)
        up, down = up_bits.view(torch.float32), ((254 << 23) - up_bits).view(torch.float32)  # and of 2^(e − bits)
        return (torch.round(x * up) * down).double()
    e = exponent_bound(amax.double())
    return torch.round(x.double() * pow2(bits - e)) * pow2(e - bits)


def code_sum(x: torch.Tensor, bits: int, dim: int = -1) -> torch.Tensor:
    """Order-independent sum along ``dim`` (float64, keepdim) of one slice of ``bits``-bit fixed-point codes;
    ``bits`` ≤ 53 − ⌈log2 n⌉ for n terms."""
    codes, e = fixed_point(x, bits, dim)
    return codes.sum(dim, keepdim=True) * pow2(e - bits)


# ---------------------------------------------------------------- GEMMs
def linear_weight(weight: torch.Tensor) -> torch.Tensor:
    """A ``[N, K]`` weight laid out for ``exact_linear``: ``[K, N]`` float32 in the GEMM's padded rows (cache it per version)."""
    return gemm_layout(weight.detach().float().t())


def exact_linear(x: torch.Tensor, weight: torch.Tensor | None = None, *, wt: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ weight^T`` (no bias), fp32, the same bits on any machine for each row: ``fixed_order_mm``.

    ``wt`` may pass a precomputed ``linear_weight(weight)`` (cached per weight version). Not a
    compiled piece: eager, it calls the kernel directly (a graph of one op would only add dynamo's
    call overhead); inside a compiled block, the GEMM is one opaque op.
    """
    if wt is None:
        wt = linear_weight(weight)
    rows = x.reshape(-1, x.shape[-1])
    return fixed_order_mm(rows, wt).reshape(*x.shape[:-1], wt.shape[1])


# ---------------------------------------------------------------- exp and log
_INV_LN2 = 1.4426950408889634
_LN2_HI = 6.93147180369123816490e-01  # ln 2 split so that n · LN2_HI is exact (fdlibm)
_LN2_LO = 1.90821492927058770002e-10
_EXP_COEF = [1.0 / math.factorial(i) for i in range(10)]  # Taylor series, |r| <= ln2/2: rel. error < 1e-11
_SQRT2 = math.sqrt(2.0)


def exp64(z: torch.Tensor) -> torch.Tensor:
    """``e^z`` in float64 (|relative error| < 1e-11), bitwise the same on any CPU; ``-inf`` → 0.

    z = n·ln2 + r with |r| ≤ ln2/2; e^r by Horner's rule; 2^n from its bits.
    """
    z = z.double()
    zc = z.clamp(-708.0, 709.0)
    n = torch.round(zc * _INV_LN2)
    r = (zc - n * _LN2_HI) - n * _LN2_LO
    p = torch.full_like(r, _EXP_COEF[-1])
    for c in reversed(_EXP_COEF[:-1]):
        p = p * r + c
    out = p * pow2(n)
    return torch.where(z < -708.0, torch.zeros_like(out), out)


_EXPF_POLY = (1.9875691500e-4, 1.3981999507e-3, 8.3334519073e-3, 4.1665795894e-2, 1.6666665459e-1,
              5.0000001201e-1)  # Cephes expf: e^r ≈ 1 + r + r² P(r) on |r| ≤ ln2/2
_LN2_HI32, _LN2_LO32 = 0.693359375, -2.12194440e-4


def exp32(z: torch.Tensor, underflow_to_zero: bool = True) -> torch.Tensor:
    """``e^z`` in float32 (within 2 ulp), bitwise the same on any CPU; ``-inf`` → 0.

    The float32 counterpart of ``exp64`` (half the memory traffic), for values that are rounded
    to float32 anyway (SiLU) or only weight an exact sum (softmax). Without
    ``underflow_to_zero``, z < −87 gives e^−87 instead of 0 (one operation less; SiLU cannot tell).
    """
    z = z.float()
    zc = z.clamp(-87.0, 88.0)
    n = torch.round(zc * 1.44269504088896341)
    r = (zc - n * _LN2_HI32) - n * _LN2_LO32
    p = torch.full_like(r, _EXPF_POLY[0])
    for c in _EXPF_POLY[1:]:
        p = p * r + c
    out = ((p * r) * r + r + 1.0) * _pow2_f32(n.int())
    return out.masked_fill(z < -87.0, 0.0) if underflow_to_zero else out


def log64(s: torch.Tensor) -> torch.Tensor:
    """``ln s`` in float64 for finite normal ``s > 0``, bitwise the same on any CPU.

    s = m · 2^E with m in [√½, √2); ln m = 2 atanh(u), u = (m − 1)/(m + 1), |u| ≤ 0.172.
    """
    s = s.double()
    e = ((s.view(torch.int64) >> 52) & 0x7FF) - 1023
    m = s * pow2(-e)  # [1, 2)
    big = m > _SQRT2
    m = torch.where(big, m * 0.5, m)
    e = e + big.long()
    u = (m - 1.0) / (m + 1.0)
    u2 = u * u
    p = torch.full_like(u, 1.0 / 21)
    for k in range(19, 0, -2):
        p = p * u2 + 1.0 / k
    ef = e.double()
    return ef * _LN2_HI + (ef * _LN2_LO + 2.0 * u * p)


# ---------------------------------------------------------------- model pieces
@fused
def exact_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm with an exact sum of squares (of x snapped to its row grid); fp32 result."""
    d = x.shape[-1]
    xs = snap(x, reduction_bits(d) // 2)
    rms = exact_sqrt((xs * xs).sum(-1, keepdim=True) / d + eps).float()  # the sum is exact
    return x / rms * weight


@fused
def exact_silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) · up`` = gate / (1 + e^(−gate)) · up, each step one correctly rounded fp32 operation."""
    g = gate.float()
    return g / (1.0 + exp32(-g, underflow_to_zero=False)) * up


def hidden_slots(q_pos: torch.Tensor, span: int, groups: int) -> torch.Tensor:
    """``[B, 1, groups·Tq, span]`` True where slot j is not visible to the query (j > its position)."""
    b, tq = q_pos.shape
    hidden = torch.arange(span, device=q_pos.device)[None, None, :] > q_pos[:, :, None]  # [B, Tq, S]
    return hidden[:, None].expand(b, groups, tq, span).reshape(b, 1, groups * tq, span)


@fused
def exact_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, hidden: torch.Tensor, max_len: int) -> torch.Tensor:
    """Causal attention over cached slots, grouped-query heads without copying K/V; fp32 ``[B, H, Tq, D]``.

    q ``[B, H, Tq, D]`` (scaled, rotated); ``k, v [B, Hkv, S, D]`` (fp32, as the cache keeps them)
    for at least every visible slot; ``hidden`` from ``hidden_slots`` (slot j is visible iff j ≤ the
    query's position). ``max_len`` (the context) fixes the softmax's code width, so a query's result
    depends neither on how many slots are passed nor on the other queries or rows.

    Scores: one fixed-order GEMM (an fma chain over D per score). Softmax with ``exp32`` and an
    exact sum. P·V: one fixed-order GEMM, an fma chain over the slots in order; a hidden or absent
    slot has p = 0 exactly and leaves the chain's value as it was, so the number of slots passed
    does not matter.
    """
    b, h, tq, d = q.shape
    h_kv, s = k.shape[1], k.shape[2]
    rows = q.reshape(b * h_kv, h // h_kv * tq, d)  # rows ordered (group, position)
    scores = fixed_order_bmm(rows, k.reshape(b * h_kv, s, d).transpose(-1, -2)).reshape(b, h_kv, -1, s)
    scores = scores.masked_fill(hidden, float("-inf"))
    e = exp32(scores - scores.amax(-1, keepdim=True)).double()  # max e = e^0 = 1 exactly
    unit = float(2 ** (reduction_bits(max_len) - 1))
    total = torch.round(e * unit).sum(-1, keepdim=True) / unit  # integer codes: an exact sum
    p = (e / total).float()
    return fixed_order_bmm(p.reshape(b * h_kv, -1, s), v.reshape(b * h_kv, s, d)).reshape(b, h, tq, d)


# ---------------------------------------------------------------- gradients of the pieces
# Each aligned piece is one autograd node whose forward is the aligned definition and whose backward
# is the derivative written out with the same four kinds of operation: fixed-order GEMMs for the
# products, exact integer-code sums for the reductions (``exact_sum_slices``), exp32 for the
# sigmoid. So the gradient, like the value, has the same bits on any CPU, thread count and batch
# composition of the same rows (tests/test_exact.py compares it with float64 autograd).
GRAD_TERMS_LOG2 = 24  # sums over tokens (weight gradients) hold up to 2^24 terms: one code width, no recompiles


def exact_sum_slices(x: torch.Tensor, dim: int = -1, log2_terms: int | None = None) -> torch.Tensor:
    """Σ along ``dim`` (float64, keepdim) exact in any order: two slices of fixed-point codes per value.

    ``x ≈ (hi + lo · 2^−b) · 2^(e−b)`` with integers ``|hi|, |lo| ≤ 2^b``, ``b = 52 − log2_terms``
    (``log2_terms`` ≥ ⌈log2 n⌉ for n terms; by default from n) and ``e`` the exponent of the slice's
    largest magnitude: both code sums are integers below 2^53 and join with one rounding. A value
    smaller than ``2^(e − 2b)`` is rounded onto that grid. Finite values only.
    """
    n = x.shape[dim]
    if log2_terms is None:
        log2_terms = MANTISSA - reduction_bits(max(n, 1))
    b = MANTISSA - 1 - log2_terms
    x = x.double()
    e = exponent_bound(x.abs().amax(dim, keepdim=True))
    scaled = x * pow2(b - e)  # exact: a power of two
    hi = torch.round(scaled)
    lo = torch.round((scaled - hi) * float(2 ** b))  # scaled − hi is exact (|·| ≤ 1/2)
    return (hi.sum(dim, keepdim=True) + lo.sum(dim, keepdim=True) * float(2.0 ** -b)) * pow2(e - b)


def _rows_of(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1, t.shape[-1])


class _AlignedLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, wt):
        ctx.save_for_backward(x, weight)
        return exact_linear(x, wt=wt) if wt is not None else exact_linear(x, weight)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        g = _rows_of(grad.float())
        grad_x = fixed_order_mm(g, weight.detach()).reshape(*grad.shape[:-1], weight.shape[1]) \
            if ctx.needs_input_grad[0] else None
        grad_w = fixed_order_mm(g.t(), _rows_of(x.detach())) if ctx.needs_input_grad[1] else None  # (rows_of in C)
        return grad_x, grad_w, None


def aligned_linear(x: torch.Tensor, weight: torch.Tensor, wt: torch.Tensor | None = None) -> torch.Tensor:
    """``exact_linear``'s values with ``F.linear``'s gradient, by fixed-order GEMMs (``wt``: the cached ``linear_weight``)."""
    return _AlignedLinear.apply(x, weight, wt)


@fused
def exact_rms_norm_grad(x: torch.Tensor, weight: torch.Tensor, grad: torch.Tensor, eps: float):
    """(∂/∂x, ∂/∂weight) of ``exact_rms_norm``: y = x · r · w, r = 1 / rms as the forward computes it."""
    d = x.shape[-1]
    xs = snap(x, reduction_bits(d) // 2)
    rms = exact_sqrt((xs * xs).sum(-1, keepdim=True) / d + eps).float()
    r = 1.0 / rms
    gw = grad * weight
    mean_gwx = (exact_sum_slices(gw * x, -1) / d).float()
    grad_x = r * (gw - x * (r * r * mean_gwx))
    grad_w = exact_sum_slices(_rows_of(grad * (x * r)), 0, GRAD_TERMS_LOG2)[0].float()
    return grad_x, grad_w


class _AlignedRMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, eps):
        ctx.save_for_backward(x, weight)
        ctx.eps = eps
        return exact_rms_norm(x, weight, eps)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        grad_x, grad_w = exact_rms_norm_grad(x.detach(), weight.detach(), grad.float(), ctx.eps)
        return (grad_x if ctx.needs_input_grad[0] else None), (grad_w if ctx.needs_input_grad[1] else None), None


def aligned_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``exact_rms_norm``'s values with its gradient (``exact_rms_norm_grad``)."""
    return _AlignedRMSNorm.apply(x, weight, eps)


@fused
def exact_silu_mul_grad(gate: torch.Tensor, up: torch.Tensor, grad: torch.Tensor):
    """(∂/∂gate, ∂/∂up) of silu(gate) · up: σ = 1 / (1 + exp32(−gate)), silu' = σ · (1 + gate · (1 − σ))."""
    g = gate.float()
    sig = 1.0 / (1.0 + exp32(-g))
    return grad * up * sig * (1.0 + g * (1.0 - sig)), grad * (g * sig)


class _AlignedSiluMul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate, up):
        ctx.save_for_backward(gate, up)
        return exact_silu_mul(gate, up)

    @staticmethod
    def backward(ctx, grad):
        gate, up = ctx.saved_tensors
        grad_gate, grad_up = exact_silu_mul_grad(gate.detach(), up.detach(), grad.float())
        return (grad_gate if ctx.needs_input_grad[0] else None), (grad_up if ctx.needs_input_grad[1] else None)


def aligned_silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``exact_silu_mul``'s values with its gradient (``exact_silu_mul_grad``)."""
    return _AlignedSiluMul.apply(gate, up)


def exact_causal_attention_grad(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, grad: torch.Tensor, max_len: int):
    """(∂q, ∂k, ∂v) of causal attention from position 0 (``exact_attention`` over the same slots).

    q ``[B, H, T, D]`` (scaled, rotated), k, v ``[B, Hkv, T, D]``, grad ``[B, H, T, D]``. P is
    recomputed as the forward computes it; dV = Pᵀ dO, dP = dO Vᵀ, dS = P ⊙ (dP − Σ_j dP ⊙ P),
    dQ = dS K, dK = dSᵀ Q: fixed-order GEMMs (grouped heads summed inside the chain, rows ordered
    (group, position) as the forward lays them out) and exact row sums.
    """
    b, h, t, d = q.shape
    h_kv = k.shape[1]
    rows = q.reshape(b * h_kv, h // h_kv * t, d)
    kr, vr = k.reshape(b * h_kv, t, d), v.reshape(b * h_kv, t, d)
    go = grad.float().reshape(b * h_kv, -1, d)
    positions = torch.arange(t, device=q.device)
    hidden = hidden_slots(positions.expand(b, t), t, h // h_kv)  # [B, 1, g·T, T]
    p = _attention_probs(rows, kr, hidden, max_len, b, h_kv)  # [B·Hkv, g·T, T] float32
    grad_v = fixed_order_bmm(p.transpose(1, 2).contiguous(), go)
    dp = fixed_order_bmm(go, vr.transpose(1, 2).contiguous())
    ds = _attention_score_grad(p, dp, max_len)
    grad_q = fixed_order_bmm(ds, kr)
    grad_k = fixed_order_bmm(ds.transpose(1, 2).contiguous(), rows)
    return grad_q.reshape(q.shape), grad_k.reshape(k.shape), grad_v.reshape(v.shape)


def _attention_probs(rows, kr, hidden, max_len: int, b: int, h_kv: int) -> torch.Tensor:
    s = kr.shape[1]
    scores = fixed_order_bmm(rows, kr.transpose(-1, -2)).reshape(b, h_kv, -1, s)
    return _attention_softmax(scores, hidden, max_len).reshape(b * h_kv, -1, s)


@fused
def _attention_softmax(scores: torch.Tensor, hidden: torch.Tensor, max_len: int) -> torch.Tensor:
    """``exact_attention``'s probabilities from its scores (the same expressions)."""
    scores = scores.masked_fill(hidden, float("-inf"))
    e = exp32(scores - scores.amax(-1, keepdim=True)).double()
    unit = float(2 ** (reduction_bits(max_len) - 1))
    total = torch.round(e * unit).sum(-1, keepdim=True) / unit
    return (e / total).float()


@fused
def _attention_score_grad(p: torch.Tensor, dp: torch.Tensor, max_len: int) -> torch.Tensor:
    """dS = P ⊙ (dP − Σ_j dP_j P_j), the row sum exact."""
    inner = exact_sum_slices(dp * p, -1, MANTISSA - reduction_bits(max_len)).float()
    return p * (dp - inner)


# ---------------------------------------------------------------- log-softmax with a gradient
class _ExactLogSoftmax(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        out = exact_log_softmax_values(x)
        ctx.save_for_backward(out)
        return out

    @staticmethod
    def backward(ctx, grad):
        (out,) = ctx.saved_tensors
        return exact_log_softmax_grad(out, grad.float())


@fused
def exact_log_softmax_grad(out: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    """∂/∂x of log-softmax: grad − e^out · Σ grad (exp32, an exact row sum)."""
    return grad - exp32(out) * exact_sum_slices(grad, -1).float()


@fused
def _log_softmax_rows(x: torch.Tensor) -> torch.Tensor:
    x = x.double()
    z = x - x.amax(-1, keepdim=True)
    total = code_sum(exp64(z), reduction_bits(x.shape[-1]))  # order-free: a sum of integer codes
    return (z - log64(total)).float()


def exact_log_softmax_values(x: torch.Tensor) -> torch.Tensor:
    """log-softmax over the last dim (−inf entries stay −inf), fp32, bitwise the same on any CPU.

    Row by row, so it runs on the rows as one 2-D matrix of their own (a copy): one compiled graph serves the
    sampler's [rows, V] and the scorer's [B, L, V], where a view (reshaped, or a decode step's last position) made
    dynamo guard on its base's shape and compile a graph per caller, each a cold compile of about 11 s a process on
    a 2-core EPYC, in every demo worker."""
    return _log_softmax_rows(x.reshape(-1, x.shape[-1]).clone()).reshape(x.shape)


def exact_log_softmax(x: torch.Tensor) -> torch.Tensor:
    """Differentiable: values from ``exact_log_softmax_values``, gradient of log-softmax."""
    return _ExactLogSoftmax.apply(x)


class _Substitute(torch.autograd.Function):
    """Value of ``value``, gradient routed to ``surrogate`` (a straight-through substitution)."""

    @staticmethod
    def forward(ctx, value, surrogate):
        return value.clone()

    @staticmethod
    def backward(ctx, grad):
        return None, grad


def substitute(value: torch.Tensor, surrogate: torch.Tensor) -> torch.Tensor:
    """Returns exactly ``value``'s bits; gradients flow into ``surrogate`` as if it had been returned."""
    return _Substitute.apply(value.detach(), surrogate)


# ------------------------------------------------------------------------------------------ torch's sums, exact
# ``Reproducible``'s sums and means (ops.reproducible): ``torch.sum`` / ``torch.mean`` with exact accumulation
def exact_sum_rows(x: torch.Tensor) -> torch.Tensor:
    """Σ over the last dim of float64 ``x [..., K]``, the same bits in any order (``exact_sum_slices``: two
    fixed-point slices of ``52 − ⌈log2 K⌉`` bits, one rounding); an empty row sums to 0, and rows holding inf or NaN
    sum plainly (inf and NaN propagate the same way in any order)."""
    if x.shape[-1] == 0:
        return x.new_zeros(x.shape[:-1])
    total = exact_sum_slices(x, -1)[..., 0]
    finite = torch.isfinite(x).all(-1)
    return total if bool(finite.all()) else torch.where(finite, total, x.sum(-1))


def reduce_dims(x: torch.Tensor, dim) -> list[int]:
    if dim is None or (isinstance(dim, (list, tuple)) and len(dim) == 0):
        return list(range(x.dim()))
    dims = [dim] if isinstance(dim, int) else list(dim)
    return sorted({d % max(x.dim(), 1) for d in dims})


def as_rows(x: torch.Tensor, dims: list[int]) -> torch.Tensor:
    """``x`` with ``dims`` moved last and flattened into one: ``[..., K]``."""
    if x.dim() == 0:
        return x.reshape(1)
    kept = [d for d in range(x.dim()) if d not in dims]
    moved = x.permute(*kept, *dims)
    return moved.reshape(*[x.shape[d] for d in kept], -1)


def keep_dims(out: torch.Tensor, x: torch.Tensor, dims: list[int], keepdim: bool) -> torch.Tensor:
    if keepdim and x.dim():
        shape = [1 if d in dims else x.shape[d] for d in range(x.dim())]
        return out.reshape(shape)
    return out


def exact_sum(x: torch.Tensor, dim=None, keepdim: bool = False, dtype=None) -> torch.Tensor:
    """``x.sum(dim, keepdim, dtype)`` with exact float64 accumulation and one rounding (floating ``x``)."""
    dims = reduce_dims(x, dim)
    out = exact_sum_rows(as_rows(x.double(), dims))
    return keep_dims(out, x, dims, keepdim).to(dtype or x.dtype)


def exact_mean(x: torch.Tensor, dim=None, keepdim: bool = False, dtype=None) -> torch.Tensor:
    dims = reduce_dims(x, dim)
    rows = as_rows(x.double(), dims)
    out = exact_sum_rows(rows) / rows.shape[-1] if rows.shape[-1] else rows.new_full(rows.shape[:-1], float("nan"))
    return keep_dims(out, x, dims, keepdim).to(dtype or x.dtype)
