"""Mismatch metrics: KL estimators, ratio tails, effective sample size, masked statistics."""

from driftless.diagnostics.metrics import (
    LOG_RATIO_CLAMP,
    effective_sample_size,
    kl_k1,
    kl_k3,
    masked_mean,
    masked_stats,
)

__all__ = ["LOG_RATIO_CLAMP", "effective_sample_size", "kl_k1", "kl_k3", "masked_mean", "masked_stats"]
