"""Sampler views: transforms of the sampler's copy of the weights and of its execution.

A view is re-applied at every sampler sync (``Sampler.load``), after the published weights are
copied in. Views compose with ``+`` in a spec string (``parse_view``):

| spec | what the sampler becomes |
|---|---|
| ``none`` | an exact copy of the trainer |
| ``w8a8`` / ``w8a8-fp8`` | W8A8: int8 (or fp8 e4m3) weights per output channel, activations per token |
| ``w:FMT[:GRAN]`` | weight-only quantization, e.g. ``w:int4:g32``, ``w:fp8_e4m3:row``, ``w:nvfp4`` |
| ``a:FMT[:GRAN]`` | activation quantization (per token by default) |
| ``kv:int8`` / ``kv:int4`` | KV cache quantized once when written, per token and head |
| ``kv:fp8`` | fp8 e4m3 KV at unit scale |
| ``kv:fp4`` | fp4 MX-style KV (mxfp4 blocks of 32 along the head dimension) |
| ``dtype:bf16`` / ``dtype:fp16`` | lower-precision execution: weights and linear inputs rounded to bf16 / fp16 (fp32 accumulation) |
| ``native`` | with ``w…``/``a…``: integer / minifloat codes with exact accumulation (emulated native GEMMs) |
| ``noise:SCALE[@SEED]`` | fixed relative weight noise δ = SCALE · N(0,1) · w, z drawn once per run |
| ``router-noise:SCALE[@SEED]`` | the same noise on the MoE routers' weights only: the sampler picks other experts, every expert computes as the trainer's |

Quantized execution needs a policy with a ``numerics`` hook. TinyLM takes every format there; a
transformers model (``HFPolicy``, ``weights_on_state_dict``) takes activation and KV formats there and
its weight formats act on the state dict (every 2-D parameter, the embedding included, once per sync);
other policies take weight-only formats and noise only.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import torch

from driftless.models.protocols import SupportsNumerics
from driftless.ops.numerics import Numerics
from driftless.ops.quant import QuantSpec

KV_ALIASES = {"fp8": "fp8_e4m3:unit", "fp4": "mxfp4"}


@dataclass
class QuantView:
    """Quantized sampler execution (weights / activations / KV)."""

    weight: QuantSpec | None = None
    act: QuantSpec | None = None
    kv: QuantSpec | None = None
    native: bool = False  # codes with exact accumulation instead of QDQ values in fp32 GEMMs

    @property
    def numerics(self) -> Numerics:
        return Numerics(weight=self.weight, act=self.act, kv=self.kv, native=self.native)

    def merge(self, other: QuantView) -> QuantView:
        out = QuantView(self.weight, self.act, self.kv, self.native or other.native)
        for name in ("weight", "act", "kv"):
            value = getattr(other, name)
            if value is not None:
                if getattr(out, name) is not None:
                    raise ValueError(f"the view sets {name} quantization twice")
                setattr(out, name, value)
        return out

    def apply(self, policy) -> None:
        if isinstance(policy, SupportsNumerics) and not getattr(policy, "weights_on_state_dict", False):
            policy.numerics = self.numerics
            return
        if self.act is not None or self.kv is not None:
            if not isinstance(policy, SupportsNumerics):
                raise ValueError(f"{type(policy).__name__} has no numerics hook: only weight-only views and noise "
                                 "apply")
            if self.native:
                raise ValueError(f"{type(policy).__name__}: native views (codes with exact accumulation) need "
                                 "TinyLM's numerics hook")
            policy.numerics = Numerics(act=self.act, kv=self.kv)
        if self.weight is not None:
            with torch.no_grad():
                for p in policy.parameters():
                    if p.dim() == 2:
                        p.copy_(self.weight(p))

    def describe(self) -> str:
        parts = [f"{n}={getattr(self, n)}" for n in ("weight", "act", "kv") if getattr(self, n) is not None]
        return "quant(" + ", ".join(parts) + ")"


ROUTER_WEIGHTS = (".router.weight", "mlp.gate.weight")  # TinyLM's routers; transformers' MoE routers (mlp.gate)


@dataclass
class WeightNoise:
    """δ = scale · z · w with z ~ N(0, 1) drawn once per run (per parameter), added at every sync; with
    ``routers_only``, on the MoE routers' weights alone (parameters named ``*.router.weight`` or
    ``*mlp.gate.weight``): the one source of disagreement that routing replay removes."""

    scale: float
    seed: int = 0
    routers_only: bool = False
    _z: dict = field(default_factory=dict, repr=False)

    def __post_init__(self):
        if not self.scale >= 0:
            raise ValueError(f"noise scale must be >= 0, got {self.scale}")

    def apply(self, policy) -> None:
        params = [(n, p) for n, p in policy.named_parameters() if not self.routers_only or n.endswith(ROUTER_WEIGHTS)]
        if not params:
            raise ValueError(f"mismatch.view router-noise:{self.scale}: {type(policy).__name__} has no MoE router "
                             f"(no parameter named *{' or *'.join(ROUTER_WEIGHTS)}); use noise:SCALE on a dense model")
        with torch.no_grad():
            for name, p in params:
                if name not in self._z:
                    g = torch.Generator().manual_seed(self.seed * 1_000_003 + len(self._z))
                    self._z[name] = torch.randn(p.shape, generator=g)
                p.add_(self.scale * self._z[name].to(p.dtype) * p)

    def describe(self) -> str:
        return f"{'router-' if self.routers_only else ''}noise({self.scale})"


@dataclass
class Compose:
    views: list

    def apply(self, policy) -> None:
        for v in self.views:
            v.apply(policy)

    def describe(self) -> str:
        return " + ".join(v.describe() for v in self.views) or "none"

    @property
    def identity(self) -> bool:
        """No view at all (``mismatch.view=none``): the sampler holds the published weights unchanged."""
        return not self.views

    @property
    def quant(self) -> QuantView | None:
        for v in self.views:
            if isinstance(v, QuantView):
                return v
        return None


def parse_view(spec: str | None) -> Compose:
    """Parse a view spec such as ``"w8a8+kv:int8"`` or ``"noise:0.02"`` (see the module table)."""
    if spec is None or spec.strip() in ("", "none"):
        return Compose([])
    quant = QuantView()
    others = []
    for raw in spec.split("+"):
        part = raw.strip()
        if part in ("w8a8", "w8a8-int8"):
            quant = quant.merge(QuantView(QuantSpec("int8", "row"), QuantSpec("int8", "row")))
        elif part == "w8a8-fp8":
            quant = quant.merge(QuantView(QuantSpec("fp8_e4m3", "row"), QuantSpec("fp8_e4m3", "row")))
        elif part.startswith("w:"):
            quant = quant.merge(QuantView(weight=QuantSpec.parse(part[2:], "row")))
        elif part.startswith("a:"):
            quant = quant.merge(QuantView(act=QuantSpec.parse(part[2:], "row")))
        elif part.startswith("kv:"):
            fmt = KV_ALIASES.get(part[3:], part[3:])
            quant = quant.merge(QuantView(kv=QuantSpec.parse(fmt, "row")))
        elif part.startswith("dtype:"):
            dtype = part[6:]
            if dtype not in ("bf16", "fp16"):
                raise ValueError(f"dtype view must be bf16 or fp16, got {dtype!r}")
            quant = quant.merge(QuantView(QuantSpec(dtype), QuantSpec(dtype)))
        elif part == "native":
            quant = quant.merge(QuantView(native=True))
        elif part.startswith(("noise:", "router-noise:")):
            m = re.fullmatch(r"(router-)?noise:([^@]+)(?:@(\d+))?", part)
            try:
                scale = float(m.group(2))
            except (AttributeError, ValueError):
                raise ValueError(f"noise view needs a number: {part!r}") from None
            others.append(WeightNoise(scale, int(m.group(3) or 0), routers_only=m.group(1) is not None))
        else:
            raise ValueError(
                f"unknown mismatch view {part!r}; use w8a8, w8a8-fp8, w:FMT, a:FMT, kv:FMT, dtype:bf16|fp16, noise:S, "
                "router-noise:S"
            )
    if quant.native:
        Numerics(weight=quant.weight, act=quant.act, native=True)  # validates: native needs both formats
    views = ([quant] if any(getattr(quant, n) is not None for n in ("weight", "act", "kv")) else []) + others
    return Compose(views)
