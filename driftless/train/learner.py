"""The learner: trainer scoring, the objective and the optimizer; publishes versioned snapshots.

``update(batch)`` fixes the anchor π0 as the trainer before its first optimizer step on the
batch, then takes ``ppo_epochs × minibatches`` optimizer steps (rows split into contiguous
minibatches, verl's ppo_epochs / ppo_mini_batch_size). Each step advances the version, so the
tokens' age as seen by the objective grows within a batch (``objective_age_*``). With one
epoch and one minibatch the anchor is the detached log p of the very forward that gives the
gradient, so π0 = p and the PPO clip never acts (Eq. 3's proximal term only matters when a
batch is reused). A non-finite loss or gradient skips the step and leaves the weights untouched.
"""

from __future__ import annotations

import math
import time

import torch

from driftless.rollout import RolloutBatch, Snapshot, score_batch


def make_optimizer(params, name: str, lr: float, weight_decay: float = 0.0, betas=(0.9, 0.999)):
    if name == "sgd":
        return torch.optim.SGD(params, lr=lr, weight_decay=weight_decay)
    if name == "adamw":
        return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay, betas=betas)
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
    def __init__(self, policy, objective, optimizer, *, grad_clip: float = 1.0, head_k: int | None = None,
                 ppo_epochs: int = 1, minibatches: int = 1, schedule: str = "constant", total_steps: int = 1):
        for name, value in (("ppo_epochs", ppo_epochs), ("minibatches", minibatches)):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"train.{name} must be an integer >= 1, got {value!r}")
        self.policy, self.objective, self.optimizer = policy, objective, optimizer
        self.grad_clip, self.head_k = grad_clip, head_k
        self.ppo_epochs, self.minibatches = ppo_epochs, minibatches
        self.schedule, self.total_steps = schedule, total_steps  # total optimizer steps of the run
        self.base_lrs = [group["lr"] for group in optimizer.param_groups]
        self.version = 0  # optimizer steps applied
        self.skipped_steps = 0

    # ------------------------------------------------------------------ the update
    def update(self, batch: RolloutBatch) -> dict:
        t0 = time.perf_counter()
        self.policy.train()
        start_version = self.version
        if self.ppo_epochs * self.minibatches == 1:
            view = score_batch(self.policy, batch, head_k=self.head_k)
            batch = batch.replace(anchor_logp=view.logp.detach())
            steps = [self._step(batch, view, t0)]
        else:
            with torch.no_grad():  # π0: the trainer before the first step on this batch
                anchor = score_batch(self.policy, batch, head_k=self.head_k).logp
            batch = batch.replace(anchor_logp=anchor)
            parts = [rows for rows in torch.arange(batch.batch_size).tensor_split(self.minibatches) if len(rows)]
            steps = []
            for _ in range(self.ppo_epochs):
                for rows in parts:
                    t = time.perf_counter()
                    sub = batch.select(rows)
                    steps.append(self._step(sub, score_batch(self.policy, sub, head_k=self.head_k), t))
        metrics = _combine(steps)
        mask = batch.action_mask
        ages = batch.token_ages(start_version)
        n_tokens = int(mask.sum())
        metrics.update({
            "version": self.version,
            "skipped_steps": self.skipped_steps,
            "sampler_age_mean": float(ages.float().mean()) if n_tokens else 0.0,
            "sampler_age_max": int(ages.max()) if n_tokens else 0,
        })
        if len(steps) > 1:
            metrics["optimizer_steps"] = len(steps)
        return metrics

    def _step(self, batch: RolloutBatch, view, t0: float) -> dict:
        t_score = time.perf_counter()
        metrics: dict = {}
        skipped = False
        try:
            loss, obj_metrics = self.objective(view, batch)
            metrics.update(obj_metrics)
        except FloatingPointError:
            loss, skipped = None, True
        t_loss = time.perf_counter()
        grad_norm = float("nan")
        version_seen = self.version
        if not skipped:
            self.optimizer.zero_grad(set_to_none=True)
            loss.backward()
            params = [p for p in self.policy.parameters() if p.grad is not None]
            grad_norm = float(torch.stack([p.grad.norm() for p in params]).norm()) if params else 0.0
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
        if skipped:
            self.skipped_steps += 1
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
    def publish(self) -> Snapshot:
        return Snapshot.of(self.policy, self.version)

    def state_dict(self) -> dict:
        return {"model": {k: v.detach().contiguous() for k, v in self.policy.state_dict().items()},
                "optimizer": self.optimizer.state_dict(), "version": self.version,
                "skipped_steps": self.skipped_steps}

    def load_state_dict(self, state: dict) -> None:
        self.policy.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        for group, base in zip(self.optimizer.param_groups, self.base_lrs):
            group["lr"] = base  # the schedule sets it again before each step
        self.version, self.skipped_steps = state["version"], state["skipped_steps"]


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
