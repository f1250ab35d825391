"""Staleness: how often the sampler is refreshed with the trainer's weights.

``SyncPolicy(staleness=s)`` refreshes every s + 1 steps: s = 0 is on-policy (refresh every step),
a very large s never refreshes after the first load (offline). Ages are measured per token from
the recorded versions (``RolloutBatch.token_ages``), not assumed from s.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SyncPolicy:
    staleness: int = 0

    def __post_init__(self):
        if not isinstance(self.staleness, int) or self.staleness < 0:
            raise ValueError(f"staleness must be an integer >= 0, got {self.staleness!r}")

    def should_refresh(self, step: int) -> bool:
        return step % (self.staleness + 1) == 0
