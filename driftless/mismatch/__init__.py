"""Mismatch on purpose: sampler views (quantization, noise, lower precision) and staleness."""

from driftless.mismatch.staleness import SyncPolicy
from driftless.mismatch.views import Compose, QuantView, WeightNoise, parse_view

__all__ = ["Compose", "QuantView", "SyncPolicy", "WeightNoise", "parse_view"]
