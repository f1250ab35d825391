"""Quantize–dequantize (QDQ) for the formats the papers use, and straight-through estimators.

Formats (all round half to even, all saturating):

| name | element | max | scale |
|---|---|---|---|
| ``int2`` … ``int8`` | symmetric ±(2^(b−1) − 1) | | amax / qmax per tensor / row / group |
| ``fp8_e4m3`` | 1-4-3 (OCP "fn", no inf) | 448 | amax / 448 per tensor / row / group, or unit |
| ``fp8_e5m2`` | 1-5-2 | 57344 | same |
| ``fp4_e2m1`` | 1-2-1 | 6 | same |
| ``mxfp8`` / ``mxfp4`` | e4m3 / e2m1 | 448 / 6 | blocks of 32 along the last dim, E8M0 power of two, OCP floor rule |
| ``nvfp4`` | e2m1 | 6 | blocks of 16, E4M3 block scale × fp32 tensor scale amax / (448 · 6) |
| ``bf16`` / ``fp16`` | a cast round trip (fp16 saturates at 65504) | | none |

Granularity (scaled formats): ``tensor`` (one amax), ``row`` (one per row of the last dim: a
weight's output channel, an activation's token; ``channel`` and ``token`` are aliases), ``group``
(``group_size`` consecutive elements of the last dim), ``unit`` (scale 1, e.g. fp8 KV at unit
scale). MX scale rule: X = 2^(floor(log2 amax) − emax_elem), emax_elem = 8 (e4m3) or 2 (e2m1),
elements saturate; named ``"ocp"`` in ``MX_SCALE_RULES`` so NVIDIA's round-up rule can be added.

``qdq`` is the value map; ``fake_quant`` adds a straight-through estimator:
``identity`` (x + sg(QDQ(x) − x), gradient 1) or ``clipped`` (gradient 1 inside the
representable range, 0 outside).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from driftless.ops.exact import pow2

MINIFLOATS = {  # name: (mantissa bits, minimum normal exponent, max finite value, emax)
    "e4m3": (3, -6, 448.0, 8),
    "e5m2": (2, -14, 57344.0, 15),
    "e2m1": (1, 0, 6.0, 2),
}
SCALED_FORMATS = {"fp8_e4m3": "e4m3", "fp8_e5m2": "e5m2", "fp4_e2m1": "e2m1"}
BLOCK_FORMATS = {"mxfp8": ("e4m3", 32), "mxfp4": ("e2m1", 32), "nvfp4": ("e2m1", 16)}
CAST_FORMATS = {"bf16": torch.bfloat16, "fp16": torch.float16}
GRANULARITIES = ("tensor", "row", "group", "unit")
MX_SCALE_RULES = ("ocp",)
_ALIASES = {"channel": "row", "token": "row"}


def format_names() -> list[str]:
    return [f"int{b}" for b in range(2, 9)] + list(SCALED_FORMATS) + list(BLOCK_FORMATS) + list(CAST_FORMATS)


def _int_bits(fmt: str) -> int | None:
    m = re.fullmatch(r"int(\d+)", fmt)
    if not m:
        return None
    bits = int(m.group(1))
    if not 2 <= bits <= 8:
        raise ValueError(f"integer bit width must be in 2–8, got {bits} ({fmt!r})")
    return bits


def check_format(fmt: str) -> None:
    if _int_bits(fmt) is None and fmt not in SCALED_FORMATS and fmt not in BLOCK_FORMATS and fmt not in CAST_FORMATS:
        raise ValueError(f"unknown quantization format {fmt!r}; known: {', '.join(format_names())}")


def minifloat_qdq(x: torch.Tensor, element: str) -> torch.Tensor:
    """Round onto a minifloat grid (subnormals included), half to even, saturating at its max."""
    mant, min_exp, max_val, _ = MINIFLOATS[element]
    x = x.float()
    _, e = torch.frexp(x)  # |x| = m · 2^e, m in [0.5, 1)
    exp = torch.clamp(e - 1, min=min_exp)  # floor(log2 |x|), subnormals share the minimum exponent
    quantum = pow2(exp - mant).float()  # built from bits: exact on every CPU
    q = torch.round(x / quantum) * quantum  # exact: division and product by powers of two
    return q.clamp(-max_val, max_val)


def _amax(x: torch.Tensor, granularity: str, group_size: int | None) -> torch.Tensor:
    """amax broadcastable to x (reductions along the last dim only: row-invariant)."""
    if granularity == "tensor":
        return x.abs().amax().reshape([1] * x.dim())
    if granularity == "row":
        return x.abs().amax(-1, keepdim=True)
    g = x.reshape(*x.shape[:-1], x.shape[-1] // group_size, group_size)
    return g.abs().amax(-1, keepdim=True)


def _grouped(x, granularity, group_size):
    if granularity == "group":
        return x.reshape(*x.shape[:-1], x.shape[-1] // group_size, group_size)
    return x


def _check_group(x, granularity, group_size, fmt):
    if granularity == "group":
        if group_size is None or group_size < 1:
            raise ValueError(f"granularity 'group' needs a positive group_size, got {group_size!r}")
        if x.shape[-1] % group_size:
            raise ValueError(
                f"group_size {group_size} does not divide the last dimension ({x.shape[-1]}) for {fmt!r}"
            )


def qdq(x: torch.Tensor, fmt: str, granularity: str = "tensor", group_size: int | None = None,
        mx_rule: str = "ocp") -> torch.Tensor:
    """Quantize then dequantize ``x`` (float32 result, no gradient semantics)."""
    check_format(fmt)
    granularity = _ALIASES.get(granularity, granularity)
    if granularity not in GRANULARITIES:
        raise ValueError(f"granularity must be one of {GRANULARITIES} (or channel / token), got {granularity!r}")
    x = x.detach().float()
    if fmt in CAST_FORMATS:
        dtype = CAST_FORMATS[fmt]
        if dtype == torch.float16:
            x = x.clamp(-65504.0, 65504.0)
        return x.to(dtype).float()
    if fmt in BLOCK_FORMATS:
        element, block = BLOCK_FORMATS[fmt]
        if x.shape[-1] % block:
            raise ValueError(f"{fmt} needs the last dimension ({x.shape[-1]}) to be a multiple of {block}")
        blocks = x.reshape(*x.shape[:-1], x.shape[-1] // block, block)
        amax = blocks.abs().amax(-1, keepdim=True)
        if fmt == "nvfp4":
            out = _nvfp4(blocks, amax, x.abs().amax())
        else:
            if mx_rule not in MX_SCALE_RULES:
                raise ValueError(f"mx_rule must be one of {MX_SCALE_RULES}, got {mx_rule!r}")
            emax = MINIFLOATS[element][3]
            _, e = torch.frexp(amax)
            scale_exp = torch.clamp(e - 1 - emax, -127, 127)  # E8M0 range
            scale = pow2(scale_exp).to(amax.dtype)
            out = minifloat_qdq(blocks / scale, element) * scale
            out = torch.where(amax > 0, out, torch.zeros_like(out))
        return out.reshape(x.shape)
    _check_group(x, granularity, group_size, fmt)
    bits = _int_bits(fmt)
    if granularity == "unit":
        if bits is not None:
            raise ValueError(f"granularity 'unit' (scale 1) is for float formats, not {fmt!r}")
        return minifloat_qdq(x, SCALED_FORMATS[fmt])
    amax = _amax(x, granularity, group_size)
    xg = _grouped(x, granularity, group_size)
    if bits is not None:
        qmax = 2 ** (bits - 1) - 1
        scale = torch.where(amax > 0, amax / qmax, torch.ones_like(amax))
        out = torch.clamp(torch.round(xg / scale), -qmax, qmax) * scale
    else:
        element = SCALED_FORMATS[fmt]
        fmax = MINIFLOATS[element][2]
        scale = torch.where(amax > 0, amax / fmax, torch.ones_like(amax))
        out = minifloat_qdq(xg / scale, element) * scale
    return out.reshape(x.shape)


def _nvfp4(blocks, amax_block, amax_tensor):
    tensor_scale = amax_tensor / (448.0 * 6.0)
    if float(tensor_scale) == 0.0:
        return torch.zeros_like(blocks)
    block_scale = minifloat_qdq(amax_block / 6.0 / tensor_scale, "e4m3")  # stored as E4M3
    eff = block_scale * tensor_scale
    safe = torch.where(eff > 0, eff, torch.ones_like(eff))
    out = minifloat_qdq(blocks / safe, "e2m1") * safe
    return torch.where(eff > 0, out, torch.zeros_like(out))


def representable_max(x: torch.Tensor, fmt: str, granularity: str = "tensor", group_size: int | None = None):
    """The largest magnitude the quantizer represents at each element (for the clipped STE)."""
    granularity = _ALIASES.get(granularity, granularity)
    if fmt in CAST_FORMATS:
        return torch.full_like(x, 65504.0 if fmt == "fp16" else float("inf"))
    if granularity == "unit" and fmt in SCALED_FORMATS:
        return torch.full_like(x, MINIFLOATS[SCALED_FORMATS[fmt]][2])
    # amax-scaled formats represent up to the amax of their scale group: nothing is clipped
    return torch.full_like(x, float("inf"))


STES = ("identity", "clipped")


def fake_quant(x: torch.Tensor, fmt: str, granularity: str = "tensor", group_size: int | None = None,
               ste: str = "identity") -> torch.Tensor:
    """Forward: QDQ(x). Backward: the chosen straight-through estimator."""
    if ste not in STES:
        raise ValueError(f"ste must be one of {STES}, got {ste!r}")
    q = qdq(x, fmt, granularity, group_size).to(x.dtype)
    if ste == "identity":
        return x + (q - x).detach()
    inside = (x.detach().abs() <= representable_max(x, fmt, granularity, group_size)).to(x.dtype)
    passthrough = x * inside
    return passthrough + (q - passthrough).detach()


@dataclass(frozen=True)
class QuantSpec:
    """A format with its granularity, parsed from ``"fmt[:granularity]"``: ``"int4:g32"``,
    ``"fp8_e4m3:row"``, ``"fp8_e4m3:unit"``, ``"mxfp4"``, ``"bf16"``."""

    fmt: str
    granularity: str = "tensor"
    group_size: int | None = None

    def __post_init__(self):
        check_format(self.fmt)
        g = _ALIASES.get(self.granularity, self.granularity)
        if g not in GRANULARITIES:
            raise ValueError(f"granularity must be one of {GRANULARITIES} (or channel / token), got {self.granularity!r}")
        if g == "group" and (self.group_size is None or self.group_size < 1):
            raise ValueError(f"granularity 'group' needs a positive group_size, got {self.group_size!r}")

    @classmethod
    def parse(cls, text: str, default_granularity: str = "tensor") -> QuantSpec:
        fmt, _, gran = text.partition(":")
        gran = gran or default_granularity
        m = re.fullmatch(r"g(?:roup)?(\d+)", gran)
        if m:
            return cls(fmt, "group", int(m.group(1)))
        return cls(fmt, gran)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return qdq(x, self.fmt, self.granularity, self.group_size).to(x.dtype)

    def fake(self, x: torch.Tensor, ste: str = "identity") -> torch.Tensor:
        return fake_quant(x, self.fmt, self.granularity, self.group_size, ste)

    def __str__(self) -> str:
        if self.granularity == "group":
            return f"{self.fmt}:g{self.group_size}"
        return self.fmt if self.granularity == "tensor" else f"{self.fmt}:{self.granularity}"
