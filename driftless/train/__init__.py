"""The training loop, its rollout sources, the learner, warm start, config, checkpoints and metric sinks."""

from driftless.train.config import RunConfig, apply_overrides, dump_config, load_config
from driftless.train.learner import Learner
from driftless.train.loop import Run, train

__all__ = ["Learner", "Run", "RunConfig", "apply_overrides", "dump_config", "load_config", "train"]
