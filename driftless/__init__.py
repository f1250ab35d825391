"""driftless: RL for language models that stays stable when the rollout engine and the trainer disagree."""

__version__ = "0.1.0"
