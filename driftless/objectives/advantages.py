"""Rewards to advantages: reward modes and group baselines.

Reward modes turn a 0/1 success into the scalar the estimator sees:
``+1/0`` keeps it, ``±1`` maps it to 2r − 1, ``±1-centered`` maps to ±1 and subtracts the group
mean (the score-centering paper's default; combine with estimator ``none``).
Estimators: ``group-mean`` (A = R − mean_G R, REINFORCE Zero), ``grpo`` ((R − mean) / (std + eps)),
``leave-one-out`` (R − mean of the other members, RLOO), ``none`` (A = R).
"""

from __future__ import annotations

import torch

REWARD_MODES = ("+1/0", "±1", "±1-centered")
ESTIMATORS = ("group-mean", "grpo", "leave-one-out", "none")


def shape_rewards(success: torch.Tensor, group: torch.Tensor, mode: str) -> torch.Tensor:
    if mode not in REWARD_MODES:
        raise ValueError(f"reward_mode must be one of {REWARD_MODES}, got {mode!r}")
    r = success.double()
    if mode == "+1/0":
        return r
    r = 2 * r - 1
    if mode == "±1":
        return r
    return group_advantages(r, group, "group-mean")


def _group_index(group: torch.Tensor, n: int) -> tuple[torch.Tensor, int]:
    if group.shape != (n,):
        raise ValueError(f"group must have shape ({n},), got {tuple(group.shape)}")
    _, index = torch.unique(group, return_inverse=True)
    return index, int(index.max()) + 1 if n else 0


def group_advantages(reward: torch.Tensor, group: torch.Tensor, estimator: str = "group-mean", eps: float = 1e-6):
    """Per-response advantages ``[B]`` from rewards ``[B]`` and group ids ``[B]``."""
    if estimator not in ESTIMATORS:
        raise ValueError(f"advantage estimator must be one of {ESTIMATORS}, got {estimator!r}")
    if reward.dim() != 1:
        raise ValueError(f"reward must be 1-D [B], got shape {tuple(reward.shape)}")
    if not torch.isfinite(reward).all():
        raise ValueError("reward holds NaN or inf")
    r = reward.double()
    if estimator == "none":
        return r
    index, n_groups = _group_index(group, r.numel())
    count = torch.zeros(n_groups, dtype=r.dtype).index_add_(0, index, torch.ones_like(r))
    total = torch.zeros(n_groups, dtype=r.dtype).index_add_(0, index, r)
    mean = (total / count)[index]
    if estimator == "group-mean":
        return r - mean
    if estimator == "leave-one-out":
        others = (count[index] - 1).clamp(min=1)
        loo_mean = (total[index] - r) / others
        return torch.where(count[index] > 1, r - loo_mean, torch.zeros_like(r))
    sq = torch.zeros(n_groups, dtype=r.dtype).index_add_(0, index, (r - mean) ** 2)
    std = (sq / count).sqrt()[index]
    return (r - mean) / (std + eps)
