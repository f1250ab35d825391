"""Per-model forward numerics: which operands are fake-quantized, and how ([mismatch] §3).

A ``Numerics`` object on a model says what its linears and its KV cache do:

- ``weight``: QDQ of every linear weight (per output channel unless the spec says otherwise);
- ``act``: QDQ of every linear input (per token);
- ``kv``: QDQ of K and V when written (per token and head);
- ``backward``: (c) forward *and backward* fake quantization: the incoming gradient is QDQ'd
  before the gradient GEMMs (DGrad and WGrad see quantized operands);
- ``native``: (d) native-like: integer / minifloat codes multiplied with exact accumulation
  (float64, exact for these widths) and scaled afterwards, emulating low-precision GEMMs; the
  backward is the fake-quantized one (STE).

The sampler side uses it to *be* a quantized engine; the trainer side uses the same object to
choose (a) full precision (``None``), (b) forward fake quantization, (c) or (d).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F

from driftless.ops.exact import aligned_linear, exact_linear, linear_weight, substitute
from driftless.ops.quant import MINIFLOATS, SCALED_FORMATS, QuantSpec, _int_bits, minifloat_qdq

TRAINER_NUMERICS = ("fp", "fwd-fq", "fwd-bwd-fq", "native")


@dataclass(frozen=True)
class Numerics:
    weight: QuantSpec | None = None
    act: QuantSpec | None = None
    kv: QuantSpec | None = None
    backward: QuantSpec | None = None
    native: bool = False
    ste: str = "identity"

    def __post_init__(self):
        if self.native:
            for name in ("weight", "act"):
                spec = getattr(self, name)
                if spec is None:
                    raise ValueError(f"native numerics need a {name} format")
                if spec.granularity not in ("tensor", "row") or not (
                        _int_bits(spec.fmt) is not None or spec.fmt in SCALED_FORMATS):
                    raise ValueError(
                        f"native numerics support int2–int8, fp8_e4m3, fp8_e5m2, fp4_e2m1 with tensor or row "
                        f"scales; got {name}={spec}")

    def for_trainer(self, mode: str) -> Numerics | None:
        """The trainer's forward numerics matching this (sampler) numerics under ``mode``."""
        if mode not in TRAINER_NUMERICS:
            raise ValueError(f"trainer numerics must be one of {TRAINER_NUMERICS}, got {mode!r}")
        if mode == "fp":
            return None
        if mode == "fwd-fq":
            return replace(self, backward=None, native=False)
        if mode == "fwd-bwd-fq":
            grad = self.act or self.weight or QuantSpec("fp8_e4m3", "row")
            return replace(self, backward=QuantSpec(grad.fmt, "row"), native=False)
        return replace(self, backward=None, native=True)

    def linear(self, x: torch.Tensor, weight: torch.Tensor, aligned: bool, cache: dict | None = None) -> torch.Tensor:
        """``x W^T`` under these numerics. ``cache`` (aligned, no gradient) keeps the fake-quantized
        weight's layout per weight version, so decode steps do not re-quantize the weights."""
        a = self.act.fake(x, self.ste) if self.act is not None else x
        if aligned and cache is not None and not self.native and self.backward is None and not torch.is_grad_enabled():
            key = (id(weight), id(self))
            stamp = (weight._version, weight.data_ptr())
            entry = cache.get(key)
            if entry is None or entry[0] != stamp:
                w = self.weight.fake(weight, self.ste) if self.weight is not None else weight
                entry = (stamp, linear_weight(w))
                cache[key] = entry
            return exact_linear(a, wt=entry[1])
        w = self.weight.fake(weight, self.ste) if self.weight is not None else weight
        if self.native:  # values: exact codes (the same in both modes); gradient: STE through F.linear
            return substitute(native_matmul(x.detach(), weight.detach(), self.act, self.weight), F.linear(a, w))
        if self.backward is not None:
            return _QuantGradLinear.apply(a, w, self.backward, aligned)
        return aligned_linear(a, w) if aligned else F.linear(a, w)

    def kv_write(self, t: torch.Tensor) -> torch.Tensor:
        return self.kv.fake(t, self.ste) if self.kv is not None else t


def _codes(x: torch.Tensor, spec: QuantSpec) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes, scale) with x ≈ codes · scale; codes exact in float64."""
    x = x.float()
    amax = x.abs().amax() if spec.granularity == "tensor" else x.abs().amax(-1, keepdim=True)
    bits = _int_bits(spec.fmt)
    if bits is not None:
        qmax = 2 ** (bits - 1) - 1
        scale = torch.where(amax > 0, amax / qmax, torch.ones_like(amax))
        return torch.clamp(torch.round(x / scale), -qmax, qmax), scale
    element = SCALED_FORMATS[spec.fmt]
    scale = torch.where(amax > 0, amax / MINIFLOATS[element][2], torch.ones_like(amax))
    return minifloat_qdq(x / scale, element), scale


def native_matmul(x, weight, act_spec: QuantSpec, weight_spec: QuantSpec) -> torch.Tensor:
    """x [..., K] @ weight[N, K]^T on codes with exact (float64) accumulation, then scaled."""
    cx, sx = _codes(x, act_spec)  # sx [..., 1] or scalar
    cw, sw = _codes(weight, weight_spec)  # sw [N, 1] or scalar
    acc = torch.matmul(cx.double(), cw.double().t())  # exact sums of exact products
    sw_row = sw.reshape(-1) if sw.dim() else sw
    return (acc * sx.double() * sw_row.double()).float()


class _QuantGradLinear(torch.autograd.Function):
    """y = x W^T; backward quantizes the incoming gradient before DGrad and WGrad."""

    @staticmethod
    def forward(ctx, x, w, grad_spec, aligned):
        ctx.save_for_backward(x, w)
        ctx.grad_spec = grad_spec
        return exact_linear(x, w) if aligned else F.linear(x, w)

    @staticmethod
    def backward(ctx, grad_out):
        x, w = ctx.saved_tensors
        g = ctx.grad_spec(grad_out)
        grad_x = g @ w
        grad_w = g.reshape(-1, g.shape[-1]).t() @ x.reshape(-1, x.shape[-1])
        return grad_x, grad_w, None, None
