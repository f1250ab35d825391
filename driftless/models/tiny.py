"""TinyLM: a small decoder-only transformer (RoPE, RMSNorm, SwiGLU, grouped-query attention).

One forward function serves a full sequence and incremental decode with a KV cache:

    logits = model(tokens, cache=None, start=None)      # tokens [B, T] -> logits [B, T, V]

``start [B]`` is the absolute position of ``tokens[:, 0]`` in each row (0 for a full sequence).
Two execution modes (``model.execution``):

- ``fast``: F.linear, F.rms_norm and SDPA: the quickest plain-PyTorch path.
- ``aligned``: trainer–inference invariance by construction (``driftless.ops.exact``). GEMMs sum
  each output in one fixed order (a chain of fused multiply-adds, ``ops.fixed_mm``); RMSNorm's sum
  of squares and softmax's sum are float64 sums of integer codes (exact, so their order cannot
  matter); exp is a fixed polynomial, every other op is a correctly rounded
  elementwise one, and attention writes K/V into the cache first and reads them from it. Same
  weights + same history => bitwise-equal logits for any batch size, composition, padding,
  prefill/decode split, thread count, BLAS and CPU generation. The aligned forward defines the
  values; each aligned piece is one autograd node whose gradient is written out with the same
  machine-independent operations (``ops.exact``, "gradients of the pieces"), validated against
  float64 in the tests; ``train.reproducible`` makes the rest of a training step so too.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import nn

from driftless.models.selftest import ensure_aligned
from driftless.ops.exact import (
    aligned_linear,
    aligned_rms_norm,
    aligned_silu_mul,
    exact_attention,
    exact_causal_attention_grad,
    exact_linear,
    exact_log_softmax,
    exact_log_softmax_values,
    exact_rms_norm,
    exact_silu_mul,
    exp32,
    hidden_slots,
    linear_weight,
    substitute,
)
from driftless.ops.fuse import fused
from driftless.ops.numerics import Numerics

EXECUTIONS = ("fast", "aligned")


@dataclass
class TinyLMConfig:
    vocab_size: int = 64
    d_model: int = 192
    n_layer: int = 4
    n_head: int = 3
    n_kv_head: int = 1
    d_ff: int = 512
    max_seq_len: int = 128
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    init_std: float = 0.02
    n_experts: int = 0  # 0: dense SwiGLU MLPs; else a mixture of this many SwiGLU experts (of d_ff each) per layer
    experts_per_token: int = 2  # top-k of the softmax router (float32), no capacity drop
    norm_topk_prob: bool = True  # the k gate weights renormalized to sum to 1 (Qwen3-MoE's default)

    def __post_init__(self):
        for name in ("vocab_size", "d_model", "n_layer", "n_head", "n_kv_head", "d_ff", "max_seq_len"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"TinyLMConfig.{name} must be a positive integer, got {value!r}")
        if self.d_model % self.n_head:
            raise ValueError(f"d_model ({self.d_model}) must be divisible by n_head ({self.n_head})")
        if self.n_head % self.n_kv_head:
            raise ValueError(f"n_head ({self.n_head}) must be divisible by n_kv_head ({self.n_kv_head})")
        if not isinstance(self.n_experts, int) or self.n_experts < 0:
            raise ValueError(f"TinyLMConfig.n_experts must be an integer >= 0, got {self.n_experts!r}")
        if self.n_experts and not 1 <= self.experts_per_token <= self.n_experts:
            raise ValueError(f"TinyLMConfig.experts_per_token must be in [1, n_experts={self.n_experts}], "
                             f"got {self.experts_per_token!r}")
        if (self.d_model // self.n_head) % 2:
            raise ValueError(f"head dimension d_model / n_head = {self.d_model // self.n_head} must be even (RoPE)")

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_head


class KVCache:
    """Per-layer K/V ``[B, n_kv_head, max_seq_len, head_dim]``, zero-initialised (inert slots).

    Fast and aligned execution keep the same thing: K (rotated) and V as written, one slot per position.
    """

    def __init__(self, config: TinyLMConfig, batch_size: int, dtype=torch.float32, device=None):
        self.shape = (batch_size, config.n_kv_head, config.max_seq_len, config.head_dim)
        self.k = [torch.zeros(self.shape, dtype=dtype, device=device) for _ in range(config.n_layer)]
        self.v = [torch.zeros(self.shape, dtype=dtype, device=device) for _ in range(config.n_layer)]
        self.batch_size = batch_size
        self.max_len = config.max_seq_len

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor) -> None:
        """k, v ``[B, n_kv, T, D]`` written at ``positions [B, T]``."""
        write_slots(self.k[layer], self.v[layer], k, v, positions)


def write_slots(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                positions: torch.Tensor) -> None:
    """One layer's cache ``[B, n_kv, S, D]`` takes k, v ``[B, n_kv, T, D]`` at ``positions [B, T]`` (in place)."""
    rows = torch.arange(k.shape[0], device=k.device)[:, None]
    k_cache[rows, :, positions] = k.transpose(1, 2).to(k_cache.dtype)
    v_cache[rows, :, positions] = v.transpose(1, 2).to(v_cache.dtype)



def rope_tables(config: TinyLMConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """``cos [T, D]`` = (cos θ, cos θ) and ``sin [T, D]`` = (−sin θ, sin θ) per position (rotate-half form)."""
    half = config.head_dim // 2
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(half, dtype=torch.float64) / half))
    angles = torch.arange(config.max_seq_len, dtype=torch.float64)[:, None] * inv_freq[None, :]
    cos, sin = angles.cos().float(), angles.sin().float()
    return torch.cat([cos, cos], -1), torch.cat([-sin, sin], -1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x ``[B, H, T, D]``; tables ``[B, 1, T, D]``. With halves (x1, x2) this is
    (x1 cos − x2 sin, x2 cos + x1 sin), elementwise only, on x with its halves swapped: ``roll``
    eager, a ``cat`` of the two halves when compiled (the same values; a compiled ``roll`` with a
    symbolic D costs two 64-bit divisions an element)."""
    half = x.shape[-1] // 2
    swapped = torch.cat([x[..., half:], x[..., :half]], -1) if torch.compiler.is_compiling() else x.roll(half, dims=-1)
    return x * cos + swapped * sin


# ------------------------------------------------------------------------------------------------
# An aligned decode step in one compiled graph per layer + 1: each is the composition of the aligned
# pieces (ops.exact), the K/V cache write and elementwise fp32 glue (RoPE, residual adds), so ops.fuse's
# argument carries over: every operation stays its own correctly rounded one. What changes is the number
# of dispatches (9 graphs per layer and the glue's ops otherwise), which is what a one-token step pays
# for. Longer inputs run the pieces one by one (a whole layer there measured no faster: docs/alignment.md,
# "Fused kernels"). The self-test compares the two paths bit for bit (decode against full forward).
def aligned_attention_in(x, norm_w, qkv_wt, cos, sin, eps: float, n_head: int, n_kv_head: int):
    """RMSNorm, the fused QKV GEMM and RoPE of one layer: (q scaled and rotated, k rotated, v, and the
    traced intermediates: the normed input and q|k|v)."""
    b, t, d = x.shape
    hd = d // n_head
    h = exact_rms_norm.eager(x, norm_w, eps)
    qkv = exact_linear(h, wt=qkv_wt)
    q, k, v = qkv.split([n_head * hd, n_kv_head * hd, n_kv_head * hd], -1)
    q = q.reshape(b, t, n_head, hd).transpose(1, 2)
    k = k.reshape(b, t, n_kv_head, hd).transpose(1, 2)
    v = v.reshape(b, t, n_kv_head, hd).transpose(1, 2)
    q = apply_rope(q, cos, sin) * (1.0 / math.sqrt(hd))
    k = apply_rope(k, cos, sin)
    return q.contiguous(), k, v, h, qkv


def aligned_attention_out_mlp(x, q, k, v, hidden, wo_wt, mlp_norm_w, gate_up_wt, down_wt,
                              eps: float, max_len: int):
    """The rest of one layer: attention over the cached slots, the output projection and residual,
    RMSNorm and the SwiGLU MLP and residual: (x out, and the traced intermediates)."""
    b, t, d = x.shape
    attn = exact_attention.eager(q, k, v, hidden, max_len).transpose(1, 2).reshape(b, t, d)
    out = exact_linear(attn, wt=wo_wt)
    x = x + out
    h = exact_rms_norm.eager(x, mlp_norm_w, eps)
    gate_up = exact_linear(h, wt=gate_up_wt)
    gate, up = gate_up.split(gate_up.shape[-1] // 2, -1)
    act = exact_silu_mul.eager(gate, up)
    down = exact_linear(act, wt=down_wt)
    return x + down, attn, out, h, gate_up, act, down


@fused
def aligned_decode_layer(x, k_cache, v_cache, positions, hidden, span: int, norm_w, qkv_wt, cos, sin, wo_wt,
                         mlp_norm_w, gate_up_wt, down_wt, eps: float, n_head: int, n_kv_head: int, max_len: int):
    """One layer of a decode step in one graph: ``aligned_attention_in``, the K/V write into the
    cache (in place, ``write_slots``), ``aligned_attention_out_mlp`` over the first ``span`` slots."""
    q, k, v, h, qkv = aligned_attention_in(x, norm_w, qkv_wt, cos, sin, eps, n_head, n_kv_head)
    write_slots(k_cache, v_cache, k, v, positions)
    x, attn, out, h2, gate_up, act, down = aligned_attention_out_mlp(
        x, q, k_cache[:, :, :span], v_cache[:, :, :span], hidden, wo_wt, mlp_norm_w, gate_up_wt, down_wt, eps, max_len)
    return x, h, qkv, attn, out, h2, gate_up, act, down


@fused
def aligned_head(x, norm_w, lm_wt, eps: float):
    """Final RMSNorm and the LM head: (logits, the normed input)."""
    h = exact_rms_norm.eager(x, norm_w, eps)
    return exact_linear(h, wt=lm_wt), h


class TinyLM(nn.Module):
    def __init__(self, config: TinyLMConfig | None = None, execution: str = "fast"):
        super().__init__()
        self.config = config or TinyLMConfig()
        c = self.config
        self.embed = nn.Embedding(c.vocab_size, c.d_model)
        self.layers = nn.ModuleList()
        for _ in range(c.n_layer):
            layer = nn.Module()
            layer.attn_norm = nn.Parameter(torch.ones(c.d_model))
            layer.wq = nn.Linear(c.d_model, c.n_head * c.head_dim, bias=False)
            layer.wk = nn.Linear(c.d_model, c.n_kv_head * c.head_dim, bias=False)
            layer.wv = nn.Linear(c.d_model, c.n_kv_head * c.head_dim, bias=False)
            layer.wo = nn.Linear(c.n_head * c.head_dim, c.d_model, bias=False)
            layer.mlp_norm = nn.Parameter(torch.ones(c.d_model))
            if c.n_experts:  # a mixture of experts: a router, then SwiGLU experts
                layer.router = nn.Linear(c.d_model, c.n_experts, bias=False)
                layer.experts = nn.ModuleList()
                for _ in range(c.n_experts):
                    expert = nn.Module()
                    expert.w_gate = nn.Linear(c.d_model, c.d_ff, bias=False)
                    expert.w_up = nn.Linear(c.d_model, c.d_ff, bias=False)
                    expert.w_down = nn.Linear(c.d_ff, c.d_model, bias=False)
                    layer.experts.append(expert)
            else:
                layer.w_gate = nn.Linear(c.d_model, c.d_ff, bias=False)
                layer.w_up = nn.Linear(c.d_model, c.d_ff, bias=False)
                layer.w_down = nn.Linear(c.d_ff, c.d_model, bias=False)
            self.layers.append(layer)
        self.final_norm = nn.Parameter(torch.ones(c.d_model))
        self.lm_head = nn.Linear(c.d_model, c.vocab_size, bias=False)
        cos, sin = rope_tables(c)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self.numerics: Numerics | None = None  # fake / native quantization of operands (ops.numerics)
        self.trace: list | None = None  # when a list, aligned forwards append (name, [B, T, ...] output)
        self.routes: list | None = None  # when a list, MoE forwards append each layer's own top-k ids [B, T, k]
        self.replay: torch.Tensor | None = None  # [B, T, layers, k] expert ids to use (R3; −1: the model's own)
        self._codes: dict = {}  # aligned GEMMs' weight layouts, keyed by the weights' identity and version
        self.aligned_gemm = None  # replaces the fixed-order GEMM (only the self-test's negative control does)
        self.execution = execution
        self.reset_parameters()

    # ------------------------------------------------------------------ set-up
    def reset_parameters(self, seed: int | None = None) -> None:
        g = torch.Generator().manual_seed(seed) if seed is not None else None
        std = self.config.init_std
        for name, p in self.named_parameters():
            if p.dim() == 1:
                nn.init.ones_(p)
            else:
                scale = std / math.sqrt(2 * self.config.n_layer) if name.endswith(("wo.weight", "w_down.weight")) else std
                with torch.no_grad():
                    p.copy_(torch.randn(p.shape, generator=g) * scale)

    @property
    def execution(self) -> str:
        return self._execution

    @execution.setter
    def execution(self, value: str) -> None:
        if value not in EXECUTIONS:
            raise ValueError(f"execution must be one of {EXECUTIONS}, got {value!r}")
        if value == "aligned" and getattr(self, "_execution", None) != "aligned":
            ensure_aligned(self.config, type(self))  # refuses aligned mode if the invariance fails here
        self._execution = value

    @property
    def vocab_size(self) -> int:
        return self.config.vocab_size

    @property
    def max_seq_len(self) -> int:
        return self.config.max_seq_len

    def new_cache(self, batch_size: int) -> KVCache:
        return KVCache(self.config, batch_size, dtype=self.lm_head.weight.dtype, device=self.lm_head.weight.device)

    # ------------------------------------------------------------------ forward
    def forward(self, tokens: torch.Tensor, cache: KVCache | None = None, start: torch.Tensor | None = None):
        tokens, start = self._check(tokens, cache, start)
        if self.execution == "aligned":
            if cache is not None and torch.is_grad_enabled():
                with torch.no_grad():  # aligned gradients are defined for full forwards (training), not decode
                    return self._forward(tokens, cache, start, aligned=True)
            return self._forward(tokens, cache, start, aligned=True)
        return self._forward(tokens, cache, start, aligned=False)

    def _check(self, tokens, cache, start):
        if tokens.dim() != 2:
            raise ValueError(f"tokens must be [B, T], got shape {tuple(tokens.shape)}")
        if tokens.dtype not in (torch.int64, torch.int32):
            raise ValueError(f"tokens must be integer ids, got dtype {tokens.dtype}")
        b, t = tokens.shape
        if t == 0:
            raise ValueError("tokens is empty (T = 0)")
        if tokens.numel() and (int(tokens.min()) < 0 or int(tokens.max()) >= self.config.vocab_size):
            raise ValueError(
                f"token ids must be in [0, {self.config.vocab_size}), got min {int(tokens.min())}, max {int(tokens.max())}"
            )
        if start is None:
            start = torch.zeros(b, dtype=torch.long, device=tokens.device)
        if start.shape != (b,):
            raise ValueError(f"start must have shape ({b},), got {tuple(start.shape)}")
        if int(start.max()) + t > self.config.max_seq_len:
            raise ValueError(
                f"positions up to {int(start.max()) + t - 1} exceed the context (max_seq_len={self.config.max_seq_len})"
            )
        if cache is None and bool((start != 0).any()):
            raise ValueError("start must be 0 without a cache (a full forward begins at position 0)")
        if cache is not None and cache.batch_size != b:
            raise ValueError(f"cache was made for batch size {cache.batch_size}, got {b} rows")
        return tokens.long(), start.long()

    def _linear(self, x, layer: nn.Linear, aligned: bool):
        if self.numerics is not None:
            return self.numerics.linear(x, layer.weight, aligned, self._codes)
        return self._exact_linears(x, layer)[0] if aligned else F.linear(x, layer.weight)

    def _exact_linears(self, x, *layers: nn.Linear) -> list[torch.Tensor]:
        """Aligned ``x @ W^T`` for several weights sharing the input: one fixed-order GEMM, layout cached."""
        weights = [layer.weight for layer in layers]
        if self.aligned_gemm is not None:  # the self-test's negative control
            return [self.aligned_gemm(x, w) for w in weights]
        wt = self._weight_t(*layers)
        if torch.is_grad_enabled() and (x.requires_grad or any(w.requires_grad for w in weights)):
            out = aligned_linear(x, torch.cat(weights) if len(weights) > 1 else weights[0], wt)
        else:
            out = exact_linear(x, wt=wt)
        return list(out.split([w.shape[0] for w in weights], dim=-1))

    def _weight_t(self, *layers: nn.Linear) -> torch.Tensor:
        """The aligned GEMM's ``[K, N]`` weight for these layers' weights stacked (cached per weights' version)."""
        weights = [layer.weight for layer in layers]
        key = tuple(id(w) for w in weights)
        stamp = tuple((w._version, w.data_ptr()) for w in weights)
        entry = self._codes.get(key)
        if entry is None or entry[0] != stamp:
            w = torch.cat([w.detach() for w in weights]) if len(weights) > 1 else weights[0].detach()
            entry = (stamp, linear_weight(w))
            self._codes[key] = entry
        return entry[1]

    def _linears(self, x, aligned: bool, *layers: nn.Linear) -> list[torch.Tensor]:
        if aligned and self.numerics is None:
            return self._exact_linears(x, *layers)
        return [self._linear(x, layer, aligned) for layer in layers]

    def _norm(self, x, weight, aligned: bool):
        if aligned:
            return aligned_rms_norm(x, weight, self.config.norm_eps) if torch.is_grad_enabled() else \
                exact_rms_norm(x, weight, self.config.norm_eps)
        return F.rms_norm(x, (x.shape[-1],), weight, self.config.norm_eps)

    def _record(self, name: str, value: torch.Tensor) -> None:
        if self.trace is not None:
            self.trace.append((name, value))

    def _forward(self, tokens, cache, start, aligned: bool):
        c = self.config
        b, t = tokens.shape
        positions = start[:, None] + torch.arange(t, device=tokens.device)[None, :]  # [B, T]
        if aligned and cache is None:
            cache = self.new_cache(b)  # aligned attention always reads K/V back from a cache
        cos = self.rope_cos[positions][:, None]  # [B, 1, T, D]
        sin = self.rope_sin[positions][:, None]
        x = self.embed(tokens)
        scale = 1.0 / math.sqrt(c.head_dim)
        groups = c.n_head // c.n_kv_head
        span = int(positions.max()) + 1  # keys beyond the furthest position are never visible
        if aligned:
            hidden = hidden_slots(positions, span, groups)
        elif cache is not None:
            visible = (torch.arange(span, device=tokens.device)[None, None, :] <= positions[:, :, None])[:, None]
        record = self._record if aligned and self.trace is not None else None
        grad = aligned and torch.is_grad_enabled()  # a training forward: each aligned piece an autograd node
        if aligned and t == 1 and not grad and self.numerics is None and self.aligned_gemm is None \
                and not c.n_experts:  # decode: the blocks
            for i, layer in enumerate(self.layers):
                x, h, qkv, attn, out, h2, gate_up, act, down = aligned_decode_layer(
                    x, cache.k[i], cache.v[i], positions, hidden, span, layer.attn_norm.detach(),
                    self._weight_t(layer.wq, layer.wk, layer.wv), cos, sin, self._weight_t(layer.wo), layer.mlp_norm.detach(),
                    self._weight_t(layer.w_gate, layer.w_up), self._weight_t(layer.w_down), c.norm_eps, c.n_head,
                    c.n_kv_head, c.max_seq_len)  # K/V written first, then read back (as below)
                if record:
                    for name, value in (("attn_norm", h), ("wq|wk|wv", qkv), ("attention", attn), ("wo", out),
                                        ("mlp_norm", h2), ("w_gate|w_up", gate_up), ("silu*up", act), ("w_down", down)):
                        record(f"layer {i} {name}", value)
            logits, h = aligned_head(x, self.final_norm.detach(), self._weight_t(self.lm_head), c.norm_eps)
            if record:
                record("final_norm", h)
                record("lm_head", logits)
            return logits
        for i, layer in enumerate(self.layers):
            h = self._norm(x, layer.attn_norm, aligned)
            q, k, v = self._linears(h, aligned, layer.wq, layer.wk, layer.wv)
            if record:
                record(f"layer {i} attn_norm", h)
                record(f"layer {i} wq|wk|wv", torch.cat([q, k, v], -1))
            q = q.reshape(b, t, c.n_head, c.head_dim).transpose(1, 2)
            k = k.reshape(b, t, c.n_kv_head, c.head_dim).transpose(1, 2)
            v = v.reshape(b, t, c.n_kv_head, c.head_dim).transpose(1, 2)
            q = apply_rope(q, cos, sin) * scale
            k = apply_rope(k, cos, sin)
            if self.numerics is not None and self.numerics.kv is not None:
                k, v = self.numerics.kv_write(k), self.numerics.kv_write(v)  # quantized once, when written
            if aligned:  # written first, then read back: a query sees the same slots in prefill and decode
                cache.write(i, k.detach(), v.detach(), positions)  # values only
                k_slots, v_slots = cache.k[i][:, :, :span], cache.v[i][:, :, :span]
                if grad:
                    attn = _AlignedAttention.apply(q, k, v, k_slots, v_slots, hidden, c.max_seq_len, groups)
                else:
                    attn = exact_attention(q, k_slots, v_slots, hidden, c.max_seq_len)
            elif cache is None:
                attn = _sdpa(q, k, v, groups, is_causal=True)
            else:
                cache.write(i, k, v, positions)
                attn = _sdpa(q, cache.k[i][:, :, :span], cache.v[i][:, :, :span], groups, attn_mask=visible)
            attn = attn.transpose(1, 2).reshape(b, t, c.d_model)
            out = self._linear(attn, layer.wo, aligned)
            x = x + out
            h = self._norm(x, layer.mlp_norm, aligned)
            if c.n_experts:
                down = self._moe(i, layer, h, aligned, grad)
                x = x + down
                if record:
                    record(f"layer {i} attention", attn)
                    record(f"layer {i} wo", out)
                    record(f"layer {i} mlp_norm", h)
                    record(f"layer {i} experts", down)
                continue
            gate, up, act, down = self._swiglu(h, layer, aligned, grad)
            x = x + down
            if record:
                record(f"layer {i} attention", attn)
                record(f"layer {i} wo", out)
                record(f"layer {i} mlp_norm", h)
                record(f"layer {i} w_gate|w_up", torch.cat([gate, up], -1))
                record(f"layer {i} silu*up", act)
                record(f"layer {i} w_down", down)
        x = self._norm(x, self.final_norm, aligned)
        logits = self._linear(x, self.lm_head, aligned)
        if record:
            record("final_norm", x)
            record("lm_head", logits)
        return logits

    def _swiglu(self, h, mlp, aligned: bool, grad: bool):
        """``mlp``'s SwiGLU (w_gate, w_up, w_down: a dense layer or one expert) on ``h``: (gate, up, act, down)."""
        gate, up = self._linears(h, aligned, mlp.w_gate, mlp.w_up)
        if aligned:
            act = aligned_silu_mul(gate, up) if grad else exact_silu_mul(gate, up)
        else:
            act = F.silu(gate) * up
        return gate, up, act, self._linear(act, mlp.w_down, aligned)

    def _moe(self, i: int, layer, h, aligned: bool, grad: bool):
        """Layer ``i``'s mixture of experts on ``h [B, T, D]``: router logits, log-softmax over all experts
        (float32), the top-k ids (or the replayed ones, ``self.replay``), gate weights gathered from the full
        softmax at those ids (renormalized with ``norm_topk_prob``), so a replayed expert keeps the router's
        gradient; each token's expert outputs added in expert-id order. Aligned: the fixed-order GEMM, the
        exact log-softmax and exp, ties by the lower id, so a token's output is the same bits in any batch."""
        c = self.config
        b, t, d = h.shape
        k = c.experts_per_token
        flat = h.reshape(b * t, d)
        logits = self._linear(flat, layer.router, aligned).float()  # [N, E]
        if aligned:
            logp = exact_log_softmax(logits) if grad else exact_log_softmax_values(logits)
            own = torch.sort(logp.detach(), dim=-1, descending=True, stable=True).indices[:, :k]
        else:
            logp = F.log_softmax(logits, -1)
            own = torch.topk(logp.detach(), k, dim=-1).indices
        if self.routes is not None:
            self.routes.append(own.view(b, t, k))
        ids = own
        if self.replay is not None:
            wanted = self.replay[:, :t, i].reshape(b * t, k).long()
            ids = torch.where((wanted >= 0).all(-1, keepdim=True), wanted, own)
        chosen = logp.gather(-1, ids)  # [N, k] log of the full softmax at the selected ids
        weight = substitute(exp32(chosen.detach()), chosen.exp()) if aligned else chosen.exp()
        if c.norm_topk_prob:
            total = weight[:, 0]
            for j in range(1, k):  # left to right: the same rounding for every token
                total = total + weight[:, j]
            weight = weight / total[:, None]
        out = torch.zeros_like(flat)
        for e, expert in enumerate(layer.experts):
            hit = ids == e  # [N, k]; ids are unique within a token
            rows = hit.any(-1).nonzero().squeeze(-1)
            if rows.numel() == 0:
                continue
            y = self._swiglu(flat[rows], expert, aligned, grad)[3]
            w_e = torch.where(hit[rows], weight[rows], 0.0).sum(-1)  # the one selected weight (+ zeros: exact)
            out = out.index_add(0, rows, y * w_e[:, None])  # each row once per expert: in expert-id order
        return out.view(b, t, d)

    @property
    def n_experts(self) -> int:
        return self.config.n_experts

    @property
    def route_shape(self) -> tuple[int, int] | None:
        """(MoE layers, experts per token) for a mixture of experts; None for a dense model."""
        c = self.config
        return (c.n_layer, c.experts_per_token) if c.n_experts else None

    # ------------------------------------------------------------------ the Policy interface
    def prefill(self, tokens: torch.Tensor, lengths: torch.Tensor, cache: KVCache) -> torch.Tensor:
        """Right-padded prompts ``[B, T]`` (real lengths ``lengths``) into ``cache``; logits ``[B, T, V]``."""
        return self(tokens, cache=cache)

    def decode(self, tokens: torch.Tensor, positions: torch.Tensor, cache: KVCache) -> torch.Tensor:
        """One token per row at ``positions [B]``; logits ``[B, V]`` for the next position."""
        return self(tokens[:, None], cache=cache, start=positions)[:, 0]

    # ------------------------------------------------------------------ persistence (models/io.py)
    def config_dict(self) -> dict:
        return asdict(self.config)


_SDPA_GQA = "enable_gqa" in (F.scaled_dot_product_attention.__doc__ or "")


def _sdpa(q, k, v, groups: int, **kwargs):
    """SDPA over grouped K/V heads: no copy where torch supports enable_gqa (2.5+)."""
    if groups > 1:
        if _SDPA_GQA:
            kwargs["enable_gqa"] = True
        else:
            k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    return F.scaled_dot_product_attention(q, k, v, scale=1.0, **kwargs)


class _AlignedAttention(torch.autograd.Function):
    """Aligned attention's values (over the cached slots) and its exact gradient at (q, k, v).

    Only full forwards from position 0 take gradients (``TinyLM.forward``): the slots then hold
    exactly k and v, so ``exact_causal_attention_grad`` differentiates the same attention.
    """

    @staticmethod
    def forward(ctx, q, k, v, k_slots, v_slots, hidden, max_len: int, groups: int):
        ctx.save_for_backward(q, k, v)
        ctx.max_len = max_len
        return exact_attention(q, k_slots, v_slots, hidden, max_len)

    @staticmethod
    def backward(ctx, grad):
        q, k, v = ctx.saved_tensors
        grads = exact_causal_attention_grad(q.detach(), k.detach(), v.detach(), grad, ctx.max_len)
        return (*grads, None, None, None, None, None)
