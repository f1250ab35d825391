"""Masked statistics and the sampler–trainer divergence estimators users know.

All functions take per-token tensors ``[B, L]`` and a mask of the same shape (1 on action
tokens) and return Python floats, so they can go straight into a metrics line.
"""

from __future__ import annotations

import math

import torch

LOG_RATIO_CLAMP = 20.0  # log-ratios are clamped to ±20 before exp (verl's convention)


def masked_mean(x: torch.Tensor, mask: torch.Tensor) -> float:
    n = float(mask.sum())
    if n == 0:
        return 0.0
    return float((x.detach().double() * mask).sum() / n)


def masked_stats(x: torch.Tensor, mask: torch.Tensor, prefix: str) -> dict[str, float]:
    """``{prefix}_mean/std/min/max`` over the masked entries (zeros when nothing is masked in)."""
    sel = x.detach()[mask.bool()].double()
    if sel.numel() == 0:
        return {f"{prefix}_mean": 0.0, f"{prefix}_std": 0.0, f"{prefix}_min": 0.0, f"{prefix}_max": 0.0}
    std = float(sel.std(unbiased=False)) if sel.numel() > 1 else 0.0
    return {
        f"{prefix}_mean": float(sel.mean()),
        f"{prefix}_std": std,
        f"{prefix}_min": float(sel.min()),
        f"{prefix}_max": float(sel.max()),
    }


def kl_k1(trainer_logp: torch.Tensor, sampler_logp: torch.Tensor, mask: torch.Tensor) -> float:
    """k1 estimate of KL(q‖p) from tokens sampled by q: mean(log q − log p). Can be negative."""
    return masked_mean((sampler_logp - trainer_logp).detach(), mask)


def kl_k3(trainer_logp: torch.Tensor, sampler_logp: torch.Tensor, mask: torch.Tensor) -> float:
    """k3 estimate of KL(q‖p) from tokens sampled by q: mean(r − 1 − log r), r = p/q. Never negative."""
    log_r = (trainer_logp - sampler_logp).detach().double().clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    return masked_mean(torch.expm1(log_r) - log_r, mask)


def effective_sample_size(weight: torch.Tensor, mask: torch.Tensor) -> float:
    """Normalised ESS (Σw)² / (N Σw²) in (0, 1]; 1 when all weights are equal, 0 when all are zero."""
    w = weight.detach().double()[mask.bool()]
    if w.numel() == 0:
        return 0.0
    denom = float((w * w).sum()) * w.numel()
    if denom == 0.0:
        return 0.0
    val = float(w.sum()) ** 2 / denom
    return val if math.isfinite(val) else 0.0
