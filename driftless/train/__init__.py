"""The learner, the synchronous loop, warm start, config and checkpoints."""

from driftless.train.config import RunConfig, apply_overrides, dump_config, load_config
from driftless.train.loop import Run, train

__all__ = ["Run", "RunConfig", "apply_overrides", "dump_config", "load_config", "train"]
