"""The learner: trainer scoring, the objective and the optimizer; publishes versioned snapshots.

``update(batch)`` fixes the anchor π0 as the trainer before its first optimizer step on the
batch, then takes ``ppo_epochs × minibatches`` optimizer steps (rows split into contiguous
minibatches, verl's ppo_epochs / ppo_mini_batch_size). Each step advances the version, so the
tokens' age as seen by the objective grows within a batch (``objective_age_*``). With one
epoch and one minibatch the anchor is the detached log p of the very forward that gives the
gradient, so π0 = p and the PPO clip never acts (Eq. 3's proximal term only matters when a
batch is reused). A non-finite loss or gradient skips the step and leaves the weights untouched.

Micro-batches (``micro_batch_tokens``): each optimizer step's rows are split into consecutive
micro-batches of at most that many tokens (prompt + response; a longer row goes alone), each scored
and back-propagated on its own with the whole step's denominators (``Totals``: tokens, responses,
rows, horizon, counted before any backward), so the accumulated gradient is the whole batch's for
every reduction and preset. The logged objective and mismatch metrics are then computed once on the
whole batch from the micro-batches' detached log-probabilities: the same metrics as one forward.
"""

from __future__ import annotations

import copy
import math
import time

import torch

from driftless.diagnostics.evidence import age_diagnostics, eq1_decomposition, head_diagnostics, routing_diagnostics
from driftless.models.io import clone_state
from driftless.objectives.reductions import Totals
from driftless.ops.logprobs import TokenLogprobs
from driftless.rollout import RolloutBatch, Snapshot, score_batch
from driftless.rollout.scoring import ROUTINGS
from driftless.train.optim import ExactAdamW, ExactSGD
from driftless.train.parallel import (
    Ranks,
    dcp_state,
    full_state,
    gather_whole_state,
    load_dcp,
    load_whole_state,
    shard_rows,
    sharded,
)

PRECISIONS = ("fp32", "bf16")


def micro_batches(lengths: torch.Tensor, budget: int | None) -> list[torch.Tensor]:
    """Consecutive row groups of at most ``budget`` padded tokens each (rows × the group's longest row; a row longer
    than the budget goes alone); None: one group."""
    n = int(lengths.shape[0])
    if budget is None:
        return [torch.arange(n)]
    groups, current, widest = [], [], 0
    for row, length in enumerate(lengths.tolist()):  # a micro-batch is padded to its longest row: budget that
        if current and (len(current) + 1) * max(widest, length) > budget:
            groups.append(torch.tensor(current))
            current, widest = [], 0
        current.append(row)
        widest = max(widest, length)
    if current:
        groups.append(torch.tensor(current))
    return groups


def _assemble(pieces: list[tuple[torch.Tensor, TokenLogprobs]], rows: int, width: int) -> TokenLogprobs:
    """One detached [B, L] view from the micro-batches' views (each row back in its place, zero-padded)."""
    def place(name):
        first = getattr(pieces[0][1], name)
        if first is None:
            return None
        out = first.new_full((rows, width, *first.shape[2:]), -1 if name == "routes" else 0)
        for index, view in pieces:
            value = getattr(view, name).detach()
            out[index, : value.shape[1]] = value
        return out
    return TokenLogprobs(logp=place("logp"), head_logp=place("head_logp"), entropy=place("entropy"),
                         routes=place("routes"))


def make_optimizer(params, name: str, lr: float, weight_decay: float = 0.0, betas=(0.9, 0.999), *,
                   exact: bool = False):
    """torch's SGD / AdamW; ``exact``: the same updates as single correctly rounded operations (``train.optim``)."""
    if name == "sgd":
        return ExactSGD(params, lr=lr, weight_decay=weight_decay) if exact else \
            torch.optim.SGD(params, lr=lr, weight_decay=weight_decay)
    if name == "adamw":
        return ExactAdamW(params, lr=lr, weight_decay=weight_decay, betas=betas) if exact else \
            torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay, betas=betas)
    raise ValueError(f"optim.name must be 'sgd' or 'adamw', got {name!r}")


def lr_factor(schedule: str, step: int, total: int) -> float:
    """Learning-rate multiplier before optimizer step ``step`` (0-based) of ``total``."""
    if schedule == "constant" or total <= 1:
        return 1.0
    frac = min(step, total - 1) / (total - 1)
    if schedule == "linear":
        return 1.0 - frac * (1.0 - 1.0 / total)  # ends at 1/total of the peak, never exactly 0
    if schedule == "cosine":
        return 0.5 * (1.0 + math.cos(math.pi * frac * (1.0 - 1.0 / total)))
    raise ValueError(f"optim.schedule must be constant, linear or cosine, got {schedule!r}")


class Learner:
    """``decomposition``: log Eq. 1's two parts every update; ``keep_versions``: how many past versions'
    weights to keep for it (tokens generated by an older version are reported in ``eq1_unscored_fraction``)."""

    def __init__(self, policy, objective, optimizer, *, grad_clip: float = 1.0, head_k: int | None = None,
                 ppo_epochs: int = 1, minibatches: int = 1, schedule: str = "constant", total_steps: int = 1,
                 decomposition: bool = True, keep_versions: int = 0, micro_batch_tokens: int | None = None,
                 ranks: Ranks | None = None, precision: str = "fp32", routing: str = "recompute"):
        for name, value in (("ppo_epochs", ppo_epochs), ("minibatches", minibatches)):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"train.{name} must be an integer >= 1, got {value!r}")
        if micro_batch_tokens is not None and (not isinstance(micro_batch_tokens, int) or micro_batch_tokens < 1):
            raise ValueError(f"train.micro_batch_tokens must be a positive integer or null, got {micro_batch_tokens!r}")
        self.micro_batch_tokens = micro_batch_tokens
        if precision not in PRECISIONS:
            raise ValueError(f"train.precision must be one of {', '.join(PRECISIONS)}, got {precision!r}")
        if precision == "bf16" and getattr(policy, "execution", "fast") == "aligned":
            raise ValueError("train.precision=bf16 with aligned execution: aligned is float32 by construction")
        self.precision = precision
        if routing not in ROUTINGS:
            raise ValueError(f"train.routing must be one of {', '.join(ROUTINGS)}, got {routing!r}")
        if routing == "replay" and getattr(policy, "route_shape", None) is None:
            raise ValueError("train.routing=replay needs a mixture-of-experts policy (model.n_experts > 0)")
        self.routing = routing  # a mixture of experts' selections: the trainer's own, or the sampler's (R3)
        self.ranks = ranks or Ranks()  # data-parallel learner ranks (driftless.train.parallel)
        self.sharded = sharded(policy)  # FSDP2 (train.parallel=fsdp): collectives inside every forward / backward
        if hasattr(policy, "prompt_backward_last") and not self.sharded:
            policy.prompt_backward_last = True  # gradients only by .backward() here: shared prompts' backward last
        if self.sharded and decomposition and keep_versions:
            raise ValueError("train.parallel=fsdp keeps no past versions' weights for Eq. 1: diagnostics.keep_versions "
                             "must be 0 (or diagnostics.decomposition false)")
        if not isinstance(keep_versions, int) or keep_versions < 0:
            raise ValueError(f"diagnostics.keep_versions must be an integer >= 0, got {keep_versions!r}")
        self.policy, self.objective, self.optimizer = policy, objective, optimizer
        self.grad_clip, self.head_k = grad_clip, head_k
        self.ppo_epochs, self.minibatches = ppo_epochs, minibatches
        self.schedule, self.total_steps = schedule, total_steps  # total optimizer steps of the run
        self.base_lrs = [group["lr"] for group in optimizer.param_groups]
        self.version = 0  # optimizer steps applied
        self.skipped_steps = 0
        self.decomposition, self.keep_versions = decomposition, keep_versions
        self.versions: dict[int, dict] = {}  # version -> weights, the newest keep_versions (Eq. 1's p_v)
        self._scorer = None  # a copy of the policy that scores a batch at a past version
        self._remember()

    # ------------------------------------------------------------------ the update
    def update(self, batch: RolloutBatch) -> dict:
        t0 = time.perf_counter()
        self.policy.train()
        device = next(self.policy.parameters()).device
        if batch.tokens.device != device:  # rollouts arrive on the CPU; the learner may be on a GPU (train.device)
            batch = batch.to(device)
        start_version = self.version
        if self.ppo_epochs * self.minibatches == 1:  # π0 = p: each micro-batch's own detached log p
            step, view = self._step(batch, t0)
            batch = batch.replace(anchor_logp=view.logp)
            diagnostics = self._diagnostics(batch, view, start_version)
            steps = [step]
        else:
            with torch.no_grad():  # π0: the trainer before the first step on this batch
                start = self._score(batch)
            batch = batch.replace(anchor_logp=start.logp)
            diagnostics = self._diagnostics(batch, start, start_version)
            parts = [rows for rows in torch.arange(batch.batch_size).tensor_split(self.minibatches) if len(rows)]
            steps = [self._step(batch.select(rows), time.perf_counter())[0]
                     for _ in range(self.ppo_epochs) for rows in parts]
        metrics = _combine(steps)
        mask = batch.action_mask
        ages = batch.token_ages(start_version)
        n_tokens = int(mask.sum())
        metrics.update({
            "version": self.version,
            "skipped_steps": self.skipped_steps,
            "sampler_age_mean": float(ages.float().mean()) if n_tokens else 0.0,
            **age_diagnostics(ages),
            **diagnostics,
        })
        if len(steps) > 1:
            metrics["optimizer_steps"] = len(steps)
        self._remember()
        return metrics

    # ------------------------------------------------------------------ Eq. 1 and the evidence
    def _remember(self) -> None:
        """Keep the current weights under their version (the newest ``keep_versions``)."""
        if not self.decomposition or not self.keep_versions or self.version in self.versions:
            return
        self.versions[self.version] = clone_state(self.policy.state_dict())
        for old in sorted(self.versions)[:-self.keep_versions]:
            del self.versions[old]

    def _diagnostics(self, batch: RolloutBatch, start, start_version: int) -> dict:
        """The sampler's head as the trainer sees it, and Eq. 1 per token: each token scored by the trainer
        at the version that generated it. ``start``: the trainer's scoring before this update's first step."""
        mask = batch.action_mask
        out = {}
        if start.head_logp is not None and batch.sampler_topk_ids is not None:
            out.update(head_diagnostics(batch.tokens, batch.sampler_topk_ids, batch.sampler_topk_logp,
                                        start.head_logp, mask))
        if start.routes is not None and batch.sampler_routes is not None:
            out.update(routing_diagnostics(batch.sampler_routes, start.routes, start.logp.detach(),
                                           batch.sampler_logp, mask))
        if not self.decomposition:
            return out
        current_logp = start.logp.detach()
        version_logp = current_logp.clone()
        unscored = torch.zeros_like(mask)
        for v in batch.version[mask].unique().tolist():
            if v == start_version:
                continue  # p_v is the trainer as it stands
            rows = mask & (batch.version == v)
            if v not in self.versions:
                unscored |= rows
                continue
            version_logp = torch.where(rows, self._score_at(v, batch), version_logp)
        scored = mask & ~unscored
        out.update(eq1_decomposition(current_logp, version_logp, batch.sampler_logp, scored))
        out["eq1_unscored_fraction"] = float(unscored.sum()) / max(int(mask.sum()), 1)
        return out

    def _score_at(self, version: int, batch: RolloutBatch) -> torch.Tensor:
        if self._scorer is None:
            self._scorer = copy.deepcopy(self.policy)
        self._scorer.load_state_dict(self.versions[version])
        with torch.no_grad():
            return self._forward(self._scorer, batch).logp

    def _forward(self, policy, batch: RolloutBatch) -> TokenLogprobs:
        """The trainer's scoring forward; bf16: the model's matrix products in bfloat16 under autocast, the
        weights, gradients and optimizer state float32, every log-probability float32."""
        if self.precision == "fp32":
            return score_batch(policy, batch, head_k=self.head_k, routing=self.routing)
        device = next(policy.parameters()).device.type
        with torch.autocast(device_type=device, dtype=torch.bfloat16):
            view = score_batch(policy, batch, head_k=self.head_k, routing=self.routing)
        return TokenLogprobs(view.logp.float(), None if view.head_logp is None else view.head_logp.float(),
                             view.entropy.float(), view.routes)

    def _score(self, batch: RolloutBatch) -> TokenLogprobs:
        """The trainer's view of ``batch``, micro-batch by micro-batch when ``micro_batch_tokens`` is set."""
        if self.micro_batch_tokens is None:
            return self._forward(self.policy, batch)
        pieces = [(rows, self._forward(self.policy, batch.select(rows)))
                  for rows in micro_batches(batch.length, self.micro_batch_tokens)]
        return _assemble(pieces, batch.batch_size, batch.tokens.shape[1])

    def _step(self, batch: RolloutBatch, t0: float) -> tuple[dict, TokenLogprobs]:
        """One optimizer step: score → objective → backward, micro-batch by micro-batch (no ``micro_batch_tokens``:
        one micro-batch; learner ranks: this rank's rows) with the whole step's denominators → clip → step; the
        metrics computed once on the whole batch. Returns (metrics, the whole detached view)."""
        t_score = time.perf_counter()
        totals = Totals.of(batch.action_mask)
        version_seen = self.version
        self.optimizer.zero_grad(set_to_none=True)
        pieces, skipped, t_objective = [], False, 0.0
        mine = shard_rows(batch.length, self.ranks.world, self.ranks.rank)  # all rows on one rank
        groups = [mine[g] for g in micro_batches(batch.length[mine], self.micro_batch_tokens)] if len(mine) else []
        if self.sharded:  # FSDP's collectives run in every forward and backward: the same count on every rank
            groups += [None] * (self.ranks.max_(len(groups)) - len(groups))
        for rows in groups:
            if rows is None:  # an empty micro-batch (FSDP): one row's forward and a zero backward
                view = self._forward(self.policy, batch.select(torch.tensor([0])))
                (view.logp.sum() * 0).backward()
                continue
            sub = batch.select(rows)
            view = self._forward(self.policy, sub)
            if sub.anchor_logp is None:
                sub = sub.replace(anchor_logp=view.logp.detach())
            t = time.perf_counter()
            try:
                loss, piece_metrics = self.objective(view, sub, totals=totals)
            except FloatingPointError:
                skipped, loss = True, None
            t_objective += time.perf_counter() - t
            pieces.append((rows, TokenLogprobs(view.logp.detach(), None if view.head_logp is None else
                                               view.head_logp.detach(), view.entropy.detach(), view.routes)))
            if loss is None:
                if not self.sharded:
                    break
                loss = view.logp.sum() * 0  # FSDP's backward collectives still run; the step is skipped below
            loss.backward()
        skipped = self.ranks.any(skipped)  # every rank steps, or none does
        if skipped:  # a non-finite loss: no step; the metrics' view is the whole batch's, scored again
            self.optimizer.zero_grad(set_to_none=True)
            with torch.no_grad():
                whole = self._score(batch)
        else:
            if not self.sharded:  # FSDP summed them in the backward
                self.ranks.sum_gradients(p for p in self.policy.parameters() if p.requires_grad)
            pieces = [piece for share in self.ranks.gather(pieces) for piece in share]
            whole = _assemble(pieces, batch.batch_size, batch.tokens.shape[1])
        anchored = batch if batch.anchor_logp is not None else batch.replace(anchor_logp=whole.logp)
        metrics: dict = {}
        whole_batch_once = len(groups) == 1 and not self.ranks.distributed and len(mine) == batch.batch_size
        if not skipped and whole_batch_once:  # one micro-batch of every row: its metrics are the whole batch's
            metrics.update(piece_metrics)
        elif not skipped:
            with torch.no_grad():
                t = time.perf_counter()
                try:  # the whole batch's objective metrics, from the micro-batches' log-probabilities
                    metrics.update(self.objective(whole, anchored)[1])
                except FloatingPointError:
                    skipped = True
                t_objective += time.perf_counter() - t
        t_loss = time.perf_counter()
        grad_norm = self._apply(metrics, skipped)
        step = self._step_metrics(metrics, batch, whole, version_seen, grad_norm, t0, t_score, t_loss)
        step["loss_s"], step["score_s"] = t_objective, t_loss - t_score - t_objective
        return step, whole

    def _apply(self, metrics: dict, skipped: bool) -> float:
        """Clip, schedule and step on the accumulated gradient (none: skipped); the gradient norm."""
        grad_norm = float("nan")
        if not skipped:
            params = [p for p in self.policy.parameters() if p.grad is not None]
            grad_norm = float(torch.stack([_whole(p.grad.norm()) for p in params]).norm()) if params else 0.0
            if not math.isfinite(grad_norm):
                skipped = True
            else:
                if self.grad_clip > 0 and grad_norm > self.grad_clip:
                    for p in params:
                        p.grad.mul_(self.grad_clip / grad_norm)
                if self.schedule != "constant":  # a function of the version: nothing extra to checkpoint
                    factor = lr_factor(self.schedule, self.version, self.total_steps)
                    for group, base in zip(self.optimizer.param_groups, self.base_lrs):
                        group["lr"] = base * factor
                    metrics["lr"] = self.base_lrs[0] * factor
                self.optimizer.step()
                self.version += 1
        self.optimizer.zero_grad(set_to_none=True)
        if skipped or not math.isfinite(grad_norm):
            self.skipped_steps += 1
        return grad_norm

    def _step_metrics(self, metrics: dict, batch: RolloutBatch, view, version_seen: int, grad_norm: float,
                      t0: float, t_score: float, t_loss: float) -> dict:
        mask = batch.action_mask
        ages = batch.token_ages(version_seen)
        metrics.update({
            "loss": metrics.get("loss", float("nan")),
            "grad_norm": grad_norm,
            "entropy": float(view.entropy.detach()[mask].mean()) if bool(mask.any()) else 0.0,
            "objective_age_mean": float(ages.float().mean()) if bool(mask.any()) else 0.0,
            "objective_age_max": int(ages.max()) if bool(mask.any()) else 0,
            "score_s": t_score - t0,
            "loss_s": t_loss - t_score,
            "optim_s": time.perf_counter() - t_loss,
        })
        return metrics

    # ------------------------------------------------------------------ publishing and state
    def publish(self, *, shared: bool = False) -> Snapshot:
        """The trainer's weights for the rollout workers (under FSDP gathered whole: every rank calls it); ``shared``:
        its own tensors rather than copies (``Snapshot.sharing``; not under FSDP), for a sampler in this process
        that takes every version as it is published."""
        if self.sharded:
            return Snapshot(full_state(self.policy), self.version)
        return Snapshot.sharing(self.policy, self.version) if shared else Snapshot.of(self.policy, self.version)

    def sharded_state(self) -> dict:
        """Model and optimizer state as torch.distributed.checkpoint saves them (``parallel.dcp_state``)."""
        return dcp_state(self.policy, self.optimizer)

    def load_sharded(self, checkpoint_id) -> None:
        """Model and optimizer from a torch.distributed.checkpoint folder, resharded to this learner's ranks."""
        load_dcp(self.policy, self.optimizer, checkpoint_id)

    def state_dict(self) -> dict:
        if self.sharded:
            return {"model": full_state(self.policy), "optimizer": None, "version": self.version,
                    "skipped_steps": self.skipped_steps, "versions": dict(self.versions)}
        return {"model": {k: v.detach().contiguous() for k, v in self.policy.state_dict().items()},
                "optimizer": self.optimizer.state_dict(), "version": self.version,
                "skipped_steps": self.skipped_steps, "versions": dict(self.versions)}

    def whole_state_dict(self) -> dict | None:
        """One process's checkpoint state (whole model, optimizer keyed by parameter index, as ``state_dict``
        without ranks) on rank 0, None on the others (under FSDP a collective: every rank calls it)."""
        if not self.sharded:
            return self.state_dict() if self.ranks.rank == 0 else None
        whole = gather_whole_state(self.policy, self.optimizer, self.ranks)
        if whole is None:
            return None
        return {**whole, "version": self.version, "skipped_steps": self.skipped_steps, "versions": dict(self.versions)}

    def load_state_dict(self, state: dict) -> None:
        """``state["dcp"]``: a torch.distributed.checkpoint folder (any number of ranks wrote it) holding the model
        and optimizer; otherwise ``model`` and ``optimizer`` as one process saves them."""
        if state.get("dcp") is not None:
            self.load_sharded(state["dcp"])
        elif self.sharded:
            load_whole_state(self.policy, self.optimizer, state["model"], state["optimizer"])
        else:
            self.policy.load_state_dict(state["model"])
            self.optimizer.load_state_dict(state["optimizer"])
        for group, base in zip(self.optimizer.param_groups, self.base_lrs):
            group["lr"] = base  # the schedule sets it again before each step
        self.version, self.skipped_steps = state["version"], state["skipped_steps"]
        self.versions = dict(state.get("versions", {}))
        self._remember()


def _whole(value: torch.Tensor) -> torch.Tensor:
    """A DTensor's value gathered (a norm over FSDP shards); a tensor as it is."""
    full = getattr(value, "full_tensor", None)
    return full() if full is not None else value


def _combine(steps: list[dict]) -> dict:
    """One step: its metrics. Several: the mean of each numeric metric, the max of the maxima, the sum of times."""
    if len(steps) == 1:
        out = dict(steps[0])
        out.pop("objective_age_mean")
        out.pop("objective_age_max")
        return out
    out: dict = {}
    for key in steps[0]:
        values = [s[key] for s in steps if key in s]
        if key.endswith("_max"):
            out[key] = max(values)
        elif key.endswith("_s"):
            out[key] = sum(values)
        else:
            finite = [v for v in values if isinstance(v, (int, float)) and math.isfinite(v)]
            out[key] = sum(finite) / len(finite) if finite else float("nan")
    return out
