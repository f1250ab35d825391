"""The rollout engines, the sampling transform and the RolloutBatch record."""

from driftless.rollout.batch import RolloutBatch
from driftless.rollout.engine import RolloutEngine
from driftless.rollout.sampler import Sampler
from driftless.rollout.sampling import SamplingParams, entropy_from_logprobs, sampling_logprobs
from driftless.rollout.scoring import score_batch
from driftless.rollout.snapshot import Snapshot

__all__ = ["RolloutBatch", "RolloutEngine", "Sampler", "SamplingParams", "Snapshot", "entropy_from_logprobs",
           "sampling_logprobs", "score_batch"]
