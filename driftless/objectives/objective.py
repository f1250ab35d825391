"""The Objective: a weight, a surrogate, optional score centering, penalties and a reduction.

    loss, metrics = objective(trainer_view, batch)

``trainer_view`` has ``logp [B, L]`` (log p of each recorded token, differentiable) and, when
centering or the sampler KL is used, ``head_logp [B, L, k]`` (log p at the sampler's head ids);
``driftless.ops.extract_logprobs`` returns exactly that. ``batch`` is a RolloutBatch or any object
with ``sampler_logp [B, L]``, ``action_mask [B, L]``, ``advantage [B] or [B, L]`` and, as needed,
``sampler_topk_logp [B, L, k]``, ``anchor_logp [B, L]`` (π0; defaults to the detached trainer
log p, i.e. the anchor is the trainer at the start of the update) and ``ref_logp [B, L]``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from driftless.diagnostics.evidence import ratio_diagnostics
from driftless.diagnostics.metrics import (
    LOG_RATIO_CLAMP,
    effective_sample_size,
    kl_k1,
    kl_k3,
    masked_mean,
    masked_stats,
)
from driftless.objectives.centering import ScoreCentering, build_head
from driftless.objectives.penalties import ReferenceKL, SamplerKL
from driftless.objectives.protocols import Penalty, Surrogate
from driftless.objectives.reductions import REDUCTIONS, Totals, reduce_loss
from driftless.objectives.surrogates import Reinforce
from driftless.objectives.weights import Weight


@dataclass
class Inputs:
    """Validated per-token tensors the parts work on (all ``[B, L]``)."""

    trainer_logp: torch.Tensor
    sampler_logp: torch.Tensor
    anchor_logp: torch.Tensor
    ref_logp: torch.Tensor | None
    advantage: torch.Tensor
    mask: torch.Tensor  # float, 1 on action tokens


def _get(obj, name):
    if isinstance(obj, dict):
        return obj.get(name)
    return getattr(obj, name, None)


def _where_mask(x: torch.Tensor, on: torch.Tensor) -> torch.Tensor:
    return torch.where(on, x, torch.zeros_like(x))


def gather_inputs(trainer_view, batch) -> Inputs:
    """Collect and validate the objective's inputs; bad input raises ValueError naming the field."""
    trainer_logp = _get(trainer_view, "logp")
    if trainer_logp is None:
        raise ValueError("trainer_view.logp (log p of each recorded token) is required")
    fields = {name: _get(batch, name) for name in ("sampler_logp", "action_mask", "advantage")}
    for name, value in fields.items():
        if value is None:
            raise ValueError(f"batch.{name} is required")
    sampler_logp, action_mask, advantage = fields["sampler_logp"], fields["action_mask"], fields["advantage"]
    if trainer_logp.dim() != 2:
        raise ValueError(f"trainer_view.logp must be [B, L], got shape {tuple(trainer_logp.shape)}")
    shape = trainer_logp.shape
    for name, value in (("sampler_logp", sampler_logp), ("action_mask", action_mask)):
        if value.shape != shape:
            raise ValueError(f"batch.{name} has shape {tuple(value.shape)}, expected {tuple(shape)} like trainer_view.logp")
    on = action_mask.bool()
    mask = on.to(trainer_logp.dtype if trainer_logp.is_floating_point() else torch.float32)

    if advantage.dim() == 1:
        if advantage.shape[0] != shape[0]:
            raise ValueError(f"batch.advantage has {advantage.shape[0]} rows, expected {shape[0]}")
        advantage = advantage[:, None].expand(shape)
    elif advantage.shape != shape:
        raise ValueError(f"batch.advantage must be [B] or [B, L]; got {tuple(advantage.shape)} for [B, L] = {tuple(shape)}")
    advantage = _where_mask(advantage.detach().to(mask.dtype), on)  # sg(A)
    if not torch.isfinite(advantage).all():
        raise ValueError("batch.advantage holds NaN or inf on action tokens")

    def check_logp(name, x, allow_grad):
        x_on = x.detach()[on]
        if torch.isnan(x_on).any():
            raise ValueError(f"{name} holds NaN on action tokens")
        if torch.isinf(x_on).any():
            where = torch.nonzero(torch.isinf(x.detach()) & on)[0].tolist()
            raise ValueError(f"{name} is ±inf on an action token (row {where[0]}, position {where[1]}): "
                             "the recorded token must have positive probability")
        if (x_on > 1e-6).any():
            raise ValueError(f"{name} holds log-probabilities > 0 (max {float(x_on.max()):.3g}) on action tokens")
        out = _where_mask(x if allow_grad else x.detach(), on)
        return out.to(mask.dtype)

    trainer_logp = check_logp("trainer_view.logp", trainer_logp, True)
    sampler_logp = check_logp("batch.sampler_logp", sampler_logp, False)
    anchor = _get(batch, "anchor_logp")
    if anchor is None:
        anchor_logp = trainer_logp.detach()
    else:
        if anchor.shape != shape:
            raise ValueError(f"batch.anchor_logp has shape {tuple(anchor.shape)}, expected {tuple(shape)}")
        anchor_logp = check_logp("batch.anchor_logp", anchor, False)
    ref = _get(batch, "ref_logp")
    if ref is not None:
        if ref.shape != shape:
            raise ValueError(f"batch.ref_logp has shape {tuple(ref.shape)}, expected {tuple(shape)}")
        ref = check_logp("batch.ref_logp", ref, False)
    return Inputs(trainer_logp, sampler_logp, anchor_logp, ref, advantage, mask)


@dataclass
class Objective:
    """Compose the parts; ``name`` is the preset it came from (or ``custom``)."""

    weight: Weight = field(default_factory=Weight)
    surrogate: Surrogate = field(default_factory=Reinforce)
    centering: ScoreCentering | None = None
    penalties: tuple = ()
    reduction: str = "token-mean"
    name: str = "custom"

    def __post_init__(self):
        if self.reduction not in REDUCTIONS:
            raise ValueError(f"reduction must be one of {REDUCTIONS}, got {self.reduction!r}")
        if self.centering is not None:
            if self.weight.level != "token":
                raise ValueError(
                    f"score centering composes with token-level weights only; got level={self.weight.level!r}"
                )
            if not isinstance(self.surrogate, Reinforce):
                raise ValueError(
                    f"score centering composes with the REINFORCE surrogate; got {type(self.surrogate).__name__}"
                )
        if not isinstance(self.surrogate, Surrogate):
            raise ValueError(f"surrogate must implement the Surrogate protocol (objectives/protocols.py), got "
                             f"{type(self.surrogate).__name__}")
        for penalty in self.penalties:
            if not isinstance(penalty, Penalty):
                raise ValueError(f"penalties must implement the Penalty protocol (objectives/protocols.py), got "
                                 f"{type(penalty).__name__}")
        if self.weight.target == "anchor" and not self.surrogate.uses_anchor:
            raise ValueError("weight target 'anchor' (π0/q) needs an anchored surrogate (PPO family)")
        self.penalties = tuple(self.penalties)

    @property
    def needs_head(self) -> bool:
        return self.centering is not None or any(p.needs_head for p in self.penalties)

    @property
    def head_spec(self) -> tuple[int | None, bool]:
        """(how many head ids to read, None = all stored; whether the head must cover q's support)."""
        if self.centering is not None:
            return self.centering.top_k, self.centering.top_k is None
        return None, False

    def __call__(self, trainer_view, batch, totals: Totals | None = None):
        """(loss, metrics). ``totals``: the whole batch's denominators when ``batch`` is one micro-batch or one
        rank's share of it; the loss is then that piece's share, and the pieces' losses sum to the whole's."""
        inp = gather_inputs(trainer_view, batch)
        mask = inp.mask
        target = inp.anchor_logp if self.weight.target == "anchor" else inp.trainer_logp.detach()
        weight, raw_ratio = self.weight(target, inp.sampler_logp, mask)

        loss_tok, surrogate_metrics = self.surrogate(inp, weight)
        metrics = dict(surrogate_metrics)

        head = None
        if self.needs_head:
            top_k, require_full = self.head_spec
            head = build_head(
                _get(batch, "sampler_topk_logp"), _get(trainer_view, "head_logp"), mask, top_k, require_full
            )
            metrics["sampler_head_mass"] = masked_mean(head.sampler_mass, mask)
            metrics["trainer_head_mass"] = masked_mean(head.trainer_mass, mask)
            metrics["tail_ratio"] = masked_mean(head.rho, mask)
        if self.centering is not None:
            correction, m = self.centering(inp, head, self.weight.f)
            loss_tok = loss_tok + correction
            metrics.update(m)
        for penalty in self.penalties:
            extra, m = penalty(inp, head)
            loss_tok = loss_tok + extra
            metrics.update(m)

        loss = reduce_loss(loss_tok, mask, self.reduction, totals=totals)
        if not torch.isfinite(loss):
            raise FloatingPointError(f"objective {self.name!r} produced a non-finite loss ({float(loss)})")
        metrics.update(self._mismatch_metrics(inp, weight, raw_ratio, surrogate_metrics))
        metrics["loss"] = float(loss.detach())
        return loss, metrics

    def _mismatch_metrics(self, inp: Inputs, weight, raw_ratio, surrogate_metrics: dict) -> dict[str, float]:
        mask = inp.mask
        lp, lq = inp.trainer_logp.detach(), inp.sampler_logp
        direct = torch.exp((lp - lq).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
        out = {"tokens": float(mask.sum()), "all_masked": float(mask.sum() == 0)}
        out.update(masked_stats(direct, mask, "ratio"))  # raw token ratio p/q, before any truncation
        out.update(masked_stats(weight, mask, "weight"))  # the weight actually applied
        if self.weight.level != "token":  # the raw sequence / geometric ratio, before truncation
            out.update(masked_stats(raw_ratio, mask, f"{self.weight.level}_ratio"))
        out.update(ratio_diagnostics(lp, lq, mask))  # Rényi D2, quantiles and tails of p/q
        out["ratio_ess"] = effective_sample_size(direct, mask)
        out["weight_ess"] = effective_sample_size(weight, mask)
        kind = self.weight.kind
        if kind == "tis":
            out["truncated_fraction"] = masked_mean((raw_ratio > self.weight.cap).to(mask.dtype), mask)
        else:
            out["truncated_fraction"] = 0.0
        if kind in ("mis", "band"):
            out["masked_fraction"] = masked_mean((weight == 0).to(mask.dtype), mask)
        elif "masked_fraction" not in surrogate_metrics:  # a surrogate that masks (DPPO) reports its own
            out["masked_fraction"] = 0.0
        out["kl_k1"] = kl_k1(lp, lq, mask)
        out["kl_k3"] = kl_k3(lp, lq, mask)
        diff = (lp - lq).abs()
        out["logp_absdiff_mean"] = masked_mean(diff, mask)
        out["logp_absdiff_max"] = float(diff[mask.bool()].max()) if mask.sum() > 0 else 0.0
        return out

    def describe(self) -> str:
        parts = [f"weight: {self.weight.describe()}", f"surrogate: {self.surrogate.describe()}"]
        if self.centering is not None:
            parts.append(f"centering: {self.centering.describe()}")
        parts += [f"penalty: {p.describe()}" for p in self.penalties]
        parts.append(f"reduction: {self.reduction}")
        return "; ".join(parts)


__all__ = ["Inputs", "Objective", "ReferenceKL", "SamplerKL", "gather_inputs"]
