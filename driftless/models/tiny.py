"""TinyLM: a small decoder-only transformer (RoPE, RMSNorm, SwiGLU, grouped-query attention).

One forward function serves a full sequence and incremental decode with a KV cache:

    logits = model(tokens, cache=None, start=None)      # tokens [B, T] -> logits [B, T, V]

``start [B]`` is the absolute position of ``tokens[:, 0]`` in each row (0 for a full sequence).
Two execution modes (``model.execution``):

- ``fast``: F.linear, F.rms_norm and SDPA: the quickest plain-PyTorch path.
- ``aligned``: trainer–inference invariance. Every GEMM is a chunked-row batched matmul
  (``driftless.ops.batch_invariant``), RMSNorm uses only IEEE-exact sqrt and division, and
  attention always writes K/V into a fixed-length cache first and reads every query's keys from
  it over the full context length. Same weights + same history => bitwise-equal logits for any
  batch size, composition, padding, prefill/decode split and thread count. The aligned forward
  defines the values; gradients come from a recomputed fast forward (custom autograd), so the
  backward is the fast path's, validated against float64 in the tests.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import nn

from driftless.ops.batch_invariant import DEFAULT_CHUNK, bi_linear, cached_attention
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

    def __post_init__(self):
        for name in ("vocab_size", "d_model", "n_layer", "n_head", "n_kv_head", "d_ff", "max_seq_len"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"TinyLMConfig.{name} must be a positive integer, got {value!r}")
        if self.d_model % self.n_head:
            raise ValueError(f"d_model ({self.d_model}) must be divisible by n_head ({self.n_head})")
        if self.n_head % self.n_kv_head:
            raise ValueError(f"n_head ({self.n_head}) must be divisible by n_kv_head ({self.n_kv_head})")
        if (self.d_model // self.n_head) % 2:
            raise ValueError(f"head dimension d_model / n_head = {self.d_model // self.n_head} must be even (RoPE)")

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_head


class KVCache:
    """Per-layer K/V ``[B, n_kv_head, max_seq_len, head_dim]``, zero-initialised (inert slots)."""

    def __init__(self, config: TinyLMConfig, batch_size: int, dtype=torch.float32, device=None):
        shape = (batch_size, config.n_kv_head, config.max_seq_len, config.head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(config.n_layer)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(config.n_layer)]
        self.batch_size = batch_size

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor) -> None:
        """k, v ``[B, n_kv, T, D]`` written at ``positions [B, T]``."""
        rows = torch.arange(k.shape[0], device=k.device)[:, None]
        self.k[layer][rows, :, positions] = k.transpose(1, 2).to(self.k[layer].dtype)
        self.v[layer][rows, :, positions] = v.transpose(1, 2).to(self.v[layer].dtype)


def rope_tables(config: TinyLMConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """``cos [T, D]`` = (cos θ, cos θ) and ``sin [T, D]`` = (−sin θ, sin θ) per position (rotate-half form)."""
    half = config.head_dim // 2
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(half, dtype=torch.float64) / half))
    angles = torch.arange(config.max_seq_len, dtype=torch.float64)[:, None] * inv_freq[None, :]
    cos, sin = angles.cos().float(), angles.sin().float()
    return torch.cat([cos, cos], -1), torch.cat([-sin, sin], -1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x ``[B, H, T, D]``; tables ``[B, 1, T, D]``. With halves (x1, x2) this is
    (x1 cos − x2 sin, x2 cos + x1 sin), elementwise only: ``roll`` swaps the halves."""
    return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * sin


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
            layer.w_gate = nn.Linear(c.d_model, c.d_ff, bias=False)
            layer.w_up = nn.Linear(c.d_model, c.d_ff, bias=False)
            layer.w_down = nn.Linear(c.d_ff, c.d_model, bias=False)
            self.layers.append(layer)
        self.final_norm = nn.Parameter(torch.ones(c.d_model))
        self.lm_head = nn.Linear(c.d_model, c.vocab_size, bias=False)
        cos, sin = rope_tables(c)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self.chunk = DEFAULT_CHUNK
        self.numerics: Numerics | None = None  # fake / native quantization of operands (ops.numerics)
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
            from driftless.models.selftest import ensure_aligned

            ensure_aligned(self.config)  # refuses aligned mode if the invariance fails here
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
            if torch.is_grad_enabled() and cache is None and any(p.requires_grad for p in self.parameters()):
                params = tuple(self.parameters())
                return _AlignedForward.apply(self, tokens, start, *params)
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
            return self.numerics.linear(x, layer.weight, aligned, self.chunk)
        return bi_linear(x, layer.weight, self.chunk) if aligned else F.linear(x, layer.weight)

    def _norm(self, x, weight, aligned: bool):
        if aligned:  # sqrt and division are correctly rounded: no vector/scalar-tail differences
            return x / torch.sqrt((x * x).mean(-1, keepdim=True) + self.config.norm_eps) * weight
        return F.rms_norm(x, (x.shape[-1],), weight, self.config.norm_eps)

    def _forward(self, tokens, cache, start, aligned: bool):
        c = self.config
        b, t = tokens.shape
        positions = start[:, None] + torch.arange(t, device=tokens.device)[None, :]  # [B, T]
        if aligned and cache is None:
            cache = self.new_cache(b)  # aligned attention always reads from a fixed-length cache
        cos = self.rope_cos[positions][:, None]  # [B, 1, T, D]
        sin = self.rope_sin[positions][:, None]
        x = self.embed(tokens)
        scale = 1.0 / math.sqrt(c.head_dim)
        groups = c.n_head // c.n_kv_head
        if not aligned and cache is not None:
            span = int(positions.max()) + 1  # keys beyond the furthest position are never visible
            visible = (torch.arange(span, device=tokens.device)[None, None, :] <= positions[:, :, None])[:, None]
        for i, layer in enumerate(self.layers):
            h = self._norm(x, layer.attn_norm, aligned)
            q, k, v = (self._linear(h, w, aligned) for w in (layer.wq, layer.wk, layer.wv))
            q = q.reshape(b, t, c.n_head, c.head_dim).transpose(1, 2)
            k = k.reshape(b, t, c.n_kv_head, c.head_dim).transpose(1, 2)
            v = v.reshape(b, t, c.n_kv_head, c.head_dim).transpose(1, 2)
            q = apply_rope(q, cos, sin) * scale
            k = apply_rope(k, cos, sin)
            if self.numerics is not None and self.numerics.kv is not None:
                k, v = self.numerics.kv_write(k), self.numerics.kv_write(v)  # quantized once, when written
            if cache is not None:
                cache.write(i, k, v, positions)
            if aligned:
                attn = cached_attention(q, cache.k[i], cache.v[i], positions, self.chunk)
            elif cache is None:
                attn = _sdpa(q, k, v, groups, is_causal=True)
            else:
                attn = _sdpa(q, cache.k[i][:, :, :span], cache.v[i][:, :, :span], groups, attn_mask=visible)
            x = x + self._linear(attn.transpose(1, 2).reshape(b, t, c.d_model), layer.wo, aligned)
            h = self._norm(x, layer.mlp_norm, aligned)
            gate, up = self._linear(h, layer.w_gate, aligned), self._linear(h, layer.w_up, aligned)
            x = x + self._linear(F.silu(gate) * up, layer.w_down, aligned)
        x = self._norm(x, self.final_norm, aligned)
        return self._linear(x, self.lm_head, aligned)

    # ------------------------------------------------------------------ the Policy interface
    def prefill(self, tokens: torch.Tensor, lengths: torch.Tensor, cache: KVCache) -> torch.Tensor:
        """Right-padded prompts ``[B, T]`` (real lengths ``lengths``) into ``cache``; logits ``[B, T, V]``."""
        return self(tokens, cache=cache)

    def decode(self, tokens: torch.Tensor, positions: torch.Tensor, cache: KVCache) -> torch.Tensor:
        """One token per row at ``positions [B]``; logits ``[B, V]`` for the next position."""
        return self(tokens[:, None], cache=cache, start=positions)[:, 0]

    # ------------------------------------------------------------------ persistence
    def save(self, path) -> None:
        from driftless.models.io import save_model

        save_model(self, path)

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


class _AlignedForward(torch.autograd.Function):
    """Values from the aligned forward; gradients from a recomputed fast forward."""

    @staticmethod
    def forward(ctx, model, tokens, start, *params):
        with torch.no_grad():
            logits = model._forward(tokens, None, start, aligned=True)
        ctx.model = model
        ctx.save_for_backward(tokens, start)
        return logits

    @staticmethod
    def backward(ctx, grad_logits):
        tokens, start = ctx.saved_tensors
        model = ctx.model
        params = tuple(model.parameters())
        with torch.enable_grad():
            logits = model._forward(tokens, None, start, aligned=False)
            grads = torch.autograd.grad(logits, params, grad_logits, allow_unused=True)
        return (None, None, None, *grads)
