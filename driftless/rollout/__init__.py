"""The rollout engine, the sampling transform and the RolloutBatch record."""

from driftless.rollout.batch import RolloutBatch
from driftless.rollout.sampler import Sampler, Snapshot
from driftless.rollout.sampling import SamplingParams, entropy_from_logprobs, sampling_logprobs
from driftless.rollout.scoring import score_batch

__all__ = ["RolloutBatch", "Sampler", "SamplingParams", "Snapshot", "entropy_from_logprobs",
           "sampling_logprobs", "score_batch"]
