"""driftless's sampled-token objectives as verl policy losses (``pip install 'driftless[verl]'``; tested with verl 0.9.1).

After installation verl finds them through its ``verl.plugins`` entry point, so a verl run selects one
by name, in bypass mode (the trainer's ``old_log_prob`` is the rollout engine's log q):

    actor_rollout_ref.actor.policy_loss.loss_mode=driftless/tis

Registered: ``driftless/<preset>`` for each preset in ``PRESETS`` below, the objectives that need only
the sampled token's log q (no head). Each receives verl's ``(old_log_prob, log_prob, advantages,
response_mask, loss_agg_mode, config)``: ``old_log_prob`` is taken as log q (bypass mode: verl sets it
to the rollout's log-probabilities) and as the anchor π0, ``log_prob`` as the trainer's log p. The
objective's reduction is verl's ``loss_agg_mode`` (verl and driftless share the names), normalized
by verl's ``config.global_batch_info`` (global tokens / sequences across its micro-batches and data-
parallel ranks, times ``dp_size`` as verl's ``agg_loss`` does), so the aggregation is exact across its
micro-batches. Metrics are returned under ``driftless/``.

Score centering needs the trainer's log p at the sampler's head ids, which a registered policy loss
does not receive: for centering in verl use verl's own (PR #8010: ``rollout.topk_log_probs`` with
bypass-mode REINFORCE), which corresponds to driftless's ``sc`` (plain) and ``sc+tis`` (with
``rollout_is: token``).
"""

from __future__ import annotations

import torch

from driftless.objectives import make
from driftless.objectives.reductions import Totals

TESTED_VERL = ("0.9.",)
# presets whose parts read only the sampled token's log q (no head): what a verl policy loss can compute
PRESETS = ("pg", "tis", "mis", "icepop", "dppo-tv", "dppo-kl", "reinforce-zero", "cispo", "gspo", "ppo+tis")


def _verl():
    try:
        import verl
        from verl.trainer.ppo import core_algos
    except ImportError as err:  # pragma: no cover - exercised only without the extra
        raise ImportError("the verl integration needs the 'verl' extra: pip install 'driftless[verl]'") from err
    version = getattr(verl, "__version__", "")
    if not version.startswith(TESTED_VERL):
        raise ImportError(f"driftless.integrations.verl is tested with verl {', '.join(v + '*' for v in TESTED_VERL)}; "
                          f"found {version!r}")
    return core_algos


def _totals(config, mask: torch.Tensor, mode: str) -> tuple[Totals, int]:
    """verl's global batch info as driftless's denominators, each rank's share (verl's agg_loss multiplies by
    dp_size because data parallelism averages gradients); and dp_size."""
    info = dict(getattr(config, "global_batch_info", None) or {}) if config is not None else {}
    dp = int(info.get("dp_size", 1) or 1)
    tokens, sequences = info.get("batch_num_tokens"), info.get("global_batch_size")
    if dp > 1 and (mode == "token-mean" and tokens is None or mode.startswith("seq-mean") and sequences is None):
        raise ValueError(f"loss_agg_mode={mode!r} with dp_size={dp} needs config.global_batch_info "
                         "(batch_num_tokens / global_batch_size)")
    counts = mask.sum(-1)
    tokens = float(tokens) if tokens is not None else float(counts.sum())
    sequences = float(sequences) if sequences is not None else float((counts > 0).sum())  # verl: non-empty ones
    horizon = int(info.get("loss_scale_factor") or mask.shape[-1])
    return Totals(tokens / dp, sequences / dp, sequences / dp, horizon), dp


def policy_loss(preset: str, **params):
    """A verl policy-loss function computing driftless's ``preset`` (``params``: its parameters)."""
    made = {}

    def loss_fn(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode: str = "token-mean", config=None,
                rollout_is_weights=None):
        if rollout_is_weights is not None:
            raise ValueError(f"driftless/{preset} applies its own correction: turn verl's rollout_is weights off "
                             "(algorithm.rollout_correction.rollout_is=null)")
        objective = made.get(loss_agg_mode)
        if objective is None:
            objective = made[loss_agg_mode] = make(preset, **{**params, "reduction": loss_agg_mode})
        mask = response_mask.bool()
        batch = {"sampler_logp": torch.where(mask, old_log_prob, 0.0), "anchor_logp": torch.where(mask, old_log_prob, 0.0),
                 "action_mask": mask, "advantage": advantages}
        totals, dp = _totals(config, mask, loss_agg_mode)
        loss, metrics = objective({"logp": log_prob}, batch, totals=totals)
        if loss_agg_mode == "token-sum":
            loss = loss * dp  # as verl's agg_loss: the averaged gradient is then the sum over every rank's tokens
        return loss, {f"driftless/{k}": v for k, v in metrics.items() if isinstance(v, (int, float))}

    loss_fn.__name__ = f"driftless_{preset.replace('-', '_').replace('+', '_')}"
    return loss_fn


def register() -> list[str]:
    """Register every preset of ``PRESETS`` as ``driftless/<preset>``; the names registered."""
    core_algos = _verl()
    names = []
    for preset in PRESETS:
        name = f"driftless/{preset}"
        core_algos.register_policy_loss(name)(policy_loss(preset))
        names.append(name)
    return names


REGISTERED = register()
