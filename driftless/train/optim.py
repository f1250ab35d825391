"""Optimizers whose step has the same bits on every CPU (``train.reproducible``).

torch's AdamW and SGD kernels may fuse a multiply and an add on one kernel set and round twice on
another (``addcmul``, ``lerp``, ``add(alpha=)``), and compute the bias corrections with the C
library's ``pow``. These write each update as single correctly rounded elementwise operations in
one fixed order, and the scalars (bias corrections, step sizes) with Python's IEEE arithmetic and
``math.sqrt`` (correctly rounded) only. The state has torch's AdamW layout (``step``, ``exp_avg``,
``exp_avg_sq``), so checkpoints read either way. The arithmetic is the AdamW of Loshchilov and
Hutter (decoupled weight decay) as torch writes it:

    p ← p · (1 − lr · λ);  m ← β1 · m + (1 − β1) · g;  v ← β2 · v + (1 − β2) · g²
    p ← p − (lr / (1 − β1^t)) · m / (√v / √(1 − β2^t) + ε)
"""

from __future__ import annotations

import math

import torch


def power(base: float, exponent: int) -> float:
    """``base ** exponent`` for an integer exponent >= 0 by repeated IEEE multiplication (no libm ``pow``)."""
    out = 1.0
    for _ in range(exponent):
        out *= base
    return out


class ExactAdamW(torch.optim.Optimizer):
    def __init__(self, params, lr: float, betas=(0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0.0):
        super().__init__(params, {"lr": lr, "betas": tuple(betas), "eps": eps, "weight_decay": weight_decay})

    @torch.no_grad()
    def step(self, closure=None):
        if closure is not None:
            raise ValueError("ExactAdamW.step takes no closure")
        for group in self.param_groups:
            lr, (beta1, beta2), eps, decay = group["lr"], group["betas"], group["eps"], group["weight_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["step"] = torch.tensor(0.0)
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["step"] += 1
                t = int(state["step"].item())
                g, m, v = p.grad, state["exp_avg"], state["exp_avg_sq"]
                if decay:
                    p.mul_(1.0 - lr * decay)
                m.mul_(beta1).add_(g * (1.0 - beta1))
                v.mul_(beta2).add_((g * g) * (1.0 - beta2))
                correction1 = 1.0 - power(beta1, t)
                correction2_sqrt = math.sqrt(1.0 - power(beta2, t))
                denom = (v.sqrt() / correction2_sqrt).add_(eps)
                p.add_((m / denom) * (-lr / correction1))


class ExactSGD(torch.optim.Optimizer):
    """Plain SGD (no momentum): p ← p − lr · (g + λ · p)."""

    def __init__(self, params, lr: float, weight_decay: float = 0.0):
        super().__init__(params, {"lr": lr, "weight_decay": weight_decay})

    @torch.no_grad()
    def step(self, closure=None):
        if closure is not None:
            raise ValueError("ExactSGD.step takes no closure")
        for group in self.param_groups:
            lr, decay = group["lr"], group["weight_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                g = p.grad if not decay else p.grad + p * decay
                p.add_(g * -lr)


def cos(x: float) -> float:
    """cos x for 0 <= x <= π by its Taylor series in IEEE double arithmetic (no libm; the same bits anywhere)."""
    if not 0.0 <= x <= 3.2:
        raise ValueError(f"cos takes 0 <= x <= pi here, got {x!r}")
    x2, term, total = x * x, 1.0, 1.0
    for n in range(1, 30):
        term = -term * x2 / ((2 * n - 1) * (2 * n))
        total += term
    return total


def one_cycle(step: int, total: int, pct_start: float = 0.05, div_factor: float = 25.0,
              final_div_factor: float = 1e4) -> float:
    """The learning-rate factor of torch's ``OneCycleLR`` (cosine warm-up then cosine decay, no momentum cycling) at ``step``."""
    up = float(pct_start * total) - 1.0
    down = float(total) - 1.0
    start, end = 1.0 / div_factor, 1.0 / (div_factor * final_div_factor)
    if step <= up:
        frac, lo, hi = (step / up if up > 0 else 1.0), start, 1.0
    else:
        frac, lo, hi = (step - up) / (down - up), 1.0, end
    return hi + (lo - hi) / 2.0 * (cos(math.pi * min(frac, 1.0)) + 1.0)
