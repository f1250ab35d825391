"""The objective library: composable corrections for rollout–trainer mismatch.

    from driftless.objectives import make
    objective = make("sc+tis", top_k=32)
    loss, metrics = objective(trainer_view, batch)

See docs/objectives.md for every preset, its formula and the peers' names for it.
"""

from driftless.objectives.advantages import ESTIMATORS, REWARD_MODES, group_advantages, shape_rewards
from driftless.objectives.centering import ScoreCentering, build_head
from driftless.objectives.objective import Inputs, Objective, gather_inputs
from driftless.objectives.penalties import ReferenceKL, SamplerKL
from driftless.objectives.presets import PRESET_NAMES, PRESETS, make
from driftless.objectives.reductions import REDUCTIONS, reduce_loss
from driftless.objectives.surrogates import CISPO, GSPOClip, PPOClip, Reinforce, UnclippedRatio
from driftless.objectives.weights import Weight, importance_weights

__all__ = [
    "CISPO",
    "ESTIMATORS",
    "PRESETS",
    "PRESET_NAMES",
    "REDUCTIONS",
    "REWARD_MODES",
    "GSPOClip",
    "Inputs",
    "Objective",
    "PPOClip",
    "ReferenceKL",
    "Reinforce",
    "SamplerKL",
    "ScoreCentering",
    "UnclippedRatio",
    "Weight",
    "build_head",
    "gather_inputs",
    "group_advantages",
    "importance_weights",
    "make",
    "reduce_loss",
    "shape_rewards",
]
