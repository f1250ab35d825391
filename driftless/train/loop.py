"""The synchronous driver: a rollout worker and a learner taking turns.

Each step: publish the learner's weights to the worker when the staleness policy says so →
``worker.produce(step)`` (prompts × group size rollouts, rewards, advantages) →
``learner.update(batch)`` (scoring, objective, optimizer) → evaluation on the held-out split
every ``eval_every`` steps → one metrics line → an atomic checkpoint every
``checkpoint_every`` steps. Every random draw is keyed by (seed, step), so ``resume`` continues
with the lines the uninterrupted run would have written.
"""

from __future__ import annotations

import json
import random
import time
from dataclasses import asdict
from pathlib import Path

import torch
from tqdm import tqdm

from driftless.mismatch import SyncPolicy, parse_view
from driftless.rollout import Snapshot
from driftless.rollout.worker import RolloutSettings, RolloutWorker, step_seed
from driftless.tasks import CharTokenizer
from driftless.train import checkpoint
from driftless.train.config import RunConfig, dump_config
from driftless.train.evaluate import evaluate
from driftless.train.factory import initial_state, make_policy
from driftless.train.learner import Learner, make_optimizer
from driftless.train.sinks import open_sinks

TIMING_KEYS = ("tokens_per_s", "step_time", "rollout_s", "score_s", "loss_s", "optim_s", "eval_s", "wall_time")
COLLAPSE_FRACTION = 0.5  # collapsed: train-reward EMA (0.9) below half its best, once the best is >= 0.1


def rollout_settings(config: RunConfig) -> RolloutSettings:
    r = config.rollout
    return RolloutSettings(prompts_per_step=r.prompts_per_step, group_size=r.group_size,
                           max_new_tokens=r.max_new_tokens, sampling=r.sampling(),
                           reward_mode=config.objective.reward_mode, advantage=config.objective.advantage,
                           head_k=r.head_k, seed=config.train.seed, refresh=r.refresh, refresh_every=r.refresh_every,
                           reward_latency=r.reward_latency, engine=r.engine)


def make_learner(config: RunConfig, tokenizer, state) -> Learner:
    """The learner of ``config`` on weights ``state``: policy (with the trainer's numerics), objective, optimizer."""
    policy = make_policy(config, tokenizer, state)
    if config.mismatch.trainer_numerics != "fp":
        view = parse_view(config.mismatch.view)
        policy.numerics = view.quant.numerics.for_trainer(config.mismatch.trainer_numerics)
    o, t = config.optim, config.train
    optimizer = make_optimizer([p for p in policy.parameters() if p.requires_grad], o.name, o.lr, o.weight_decay,
                               (o.beta1, o.beta2))
    return Learner(policy, config.objective.build(), optimizer, grad_clip=o.grad_clip,
                   head_k=config.rollout.head_k or None, ppo_epochs=t.ppo_epochs, minibatches=t.minibatches,
                   schedule=o.schedule, total_steps=t.steps * t.ppo_epochs * t.minibatches,
                   decomposition=config.diagnostics.decomposition, keep_versions=config.versions_to_keep())


class Run:
    def __init__(self, config: RunConfig, run_dir: str | Path | None = None, *, progress: bool | None = None):
        self.config = config
        self.dir = Path(run_dir or config.train.run_dir)
        self.progress = config.train.progress if progress is None else progress
        self.tokenizer = CharTokenizer()
        self.task = config.task.build()
        self.sync = SyncPolicy(config.mismatch.staleness)
        view = parse_view(config.mismatch.view)
        state, self.warm_info = initial_state(config, self.tokenizer, self.progress)  # once, here
        self.learner = make_learner(config, self.tokenizer, state)
        self.worker = RolloutWorker(make_policy(config, self.tokenizer, state), self.task, self.tokenizer,
                                    rollout_settings(config), view=view)
        self.eval_problems = self.task.eval_set(config.train.eval_problems)
        self.step_index = 0  # completed steps
        self.reward_ema: float | None = None
        self.best_reward_ema = 0.0
        self.last_eval: float | None = None
        self.lag = config.rollout.lag
        self.history: dict[int, Snapshot] = {}  # lag > 0: weights published after each step count
        self._sources: dict = {}

    @property
    def policy(self):
        return self.learner.policy

    # ------------------------------------------------------------------ one step
    def step(self) -> dict:
        s = self.step_index
        t0 = time.perf_counter()
        if self.lag:  # a virtual clock: batch s comes from the weights after max(0, s − lag) steps
            if not self.history:
                self.history[s] = self.learner.publish()
            snapshot = self.history[max(0, s - self.lag)]
            refreshed = self.worker.snapshot is None or self.worker.snapshot.version != snapshot.version
            if refreshed:
                self.worker.load(snapshot)
        else:
            refreshed = self.sync.should_refresh(s) or self.worker.snapshot is None
            if refreshed:  # publish the learner's weights to the worker (which applies its mismatch view)
                self.worker.load(self.learner.publish())
        batch, rollout = self.worker.produce(s, weights=self._virtual_refresh(s))
        learner = self.learner.update(batch)
        if self.lag:
            self.history[s + 1] = self.learner.publish()
            for old in [k for k in self.history if k < s + 1 - self.lag]:
                del self.history[old]
        return self._finish_step(t0, rollout, learner, {"sampler_refreshed": bool(refreshed)})

    def _finish_step(self, t0: float, rollout: dict, learner: dict, extra: dict, sources: dict | None = None) -> dict:
        """Every driver's end of a step: reward EMA and collapse flag, the step count, evaluation, timing."""
        s = self.step_index
        reward = rollout["reward"]
        self.reward_ema = reward if self.reward_ema is None else 0.9 * self.reward_ema + 0.1 * reward
        self.best_reward_ema = max(self.best_reward_ema, self.reward_ema)
        run = {"step": s, **extra,
               "collapsed": bool(self.best_reward_ema >= 0.1 and self.reward_ema < COLLAPSE_FRACTION * self.best_reward_ema)}
        self.step_index += 1
        metrics = {**learner, **rollout, **(sources or {}).get("queue", {}), **run}
        if self.step_index % self.config.train.eval_every == 0 or self.step_index == self.config.train.steps:
            t_eval = time.perf_counter()
            metrics.update(eval_reward=self._evaluate(), eval_s=time.perf_counter() - t_eval)
        metrics["step_time"] = time.perf_counter() - t0
        self._sources = {"rollout": rollout, "learner": learner, **(sources or {}), "run": run}
        return metrics

    def _evaluate(self) -> float:
        """Held-out greedy reward of the learner's policy (kept as ``last_eval``)."""
        self.last_eval = evaluate(self.policy, self.task, self.tokenizer, self.eval_problems,
                                  max_new_tokens=self.config.rollout.max_new_tokens)["eval_reward"]
        return self.last_eval

    def _virtual_refresh(self, s: int):
        """With a lag and an in-flight refresh policy: the next version arrives mid-response at refresh
        checks drawn from a seeded schedule (probability 1/2 per check, keyed by (seed, step))."""
        if not self.lag or self.config.rollout.refresh == "pin" or s - self.lag + 1 not in self.history:
            return None
        rng = random.Random(step_seed(self.config.train.seed, s, 3))
        newer = self.history[max(0, s - self.lag + 1)]
        arrived = []

        def weights():
            if not arrived and rng.random() < 0.5:
                arrived.append(True)
            return newer if arrived else None
        return weights

    # ------------------------------------------------------------------ driving
    def run(self, resume: bool = False, overwrite: bool = False) -> Path:
        """Train to ``train.steps``. ``resume`` continues from the latest checkpoint; a fresh run
        refuses a directory that already holds one unless ``overwrite``."""
        cfg = self.config
        self.dir.mkdir(parents=True, exist_ok=True)
        latest = checkpoint.latest_checkpoint(self.dir)
        if resume and latest is not None:
            self.load_checkpoint(latest)
            _truncate_metrics(self.dir / "metrics.jsonl", self.step_index)
        else:
            if latest is not None and not overwrite:
                raise ValueError(f"{self.dir} already holds a run: pass --resume to continue it, --overwrite to "
                                 "replace it, or choose another run directory")
            checkpoint.clear_checkpoints(self.dir)
            (self.dir / "metrics.jsonl").unlink(missing_ok=True)
            initial = self._evaluate()
            (self.dir / "initial_eval.json").write_text(json.dumps({"eval_reward": initial,
                                                                    "warm_start": self.warm_info}, indent=2))
        checkpoint.atomic_write(self.dir / "config.yaml", dump_config(cfg))
        sinks = open_sinks(cfg.train.loggers, self.dir, asdict(cfg))
        start_wall = time.time()
        bar = tqdm(range(self.step_index, cfg.train.steps), desc=f"{cfg.objective.name}", disable=not self.progress,
                   initial=self.step_index, total=cfg.train.steps)
        try:
            for _ in bar:
                m = self.step()
                m["wall_time"] = time.time() - start_wall
                step = m["step"]
                for source, part in self._sources.items():
                    sinks.log(step, part, source)
                sinks.log(step, {k: m[k] for k in ("eval_reward", "eval_s") if k in m}, "eval")
                sinks.log(step, {k: m[k] for k in ("step_time", "wall_time")}, "run")
                sinks.end_step(step)
                bar.set_postfix(reward=f"{m['reward']:.2f}", eval=f"{self.last_eval or 0:.2f}",
                                kl=f"{m.get('kl_k3', 0):.1e}")
                if self.step_index % cfg.train.checkpoint_every == 0 or self.step_index == cfg.train.steps:
                    self.save_checkpoint()
        finally:
            sinks.close()
        return self.dir

    # ------------------------------------------------------------------ checkpoints
    def save_checkpoint(self) -> Path:
        learner = self.learner.state_dict()
        snapshot = self.worker.snapshot
        return checkpoint.save_checkpoint(
            self.dir, self.step_index, model=learner["model"], sampler=snapshot.state, optimizer=learner["optimizer"],
            state={"version": learner["version"], "sampler_version": snapshot.version,
                   "skipped_steps": learner["skipped_steps"], "reward_ema": self.reward_ema,
                   "best_reward_ema": self.best_reward_ema, "last_eval": self.last_eval,
                   "snapshot_versions": {str(k): v.version for k, v in self.history.items()}},
            snapshots={k: v.state for k, v in self.history.items()}, versions=learner["versions"])

    def load_checkpoint(self, path: Path) -> None:
        ckpt = checkpoint.load_checkpoint(path)
        state = ckpt["state"]
        self.learner.load_state_dict({"model": ckpt["model"], "optimizer": ckpt["optimizer"],
                                      "version": state["version"], "skipped_steps": state["skipped_steps"],
                                      "versions": ckpt["versions"]})
        self.step_index = state["step"]
        self.reward_ema, self.best_reward_ema = state["reward_ema"], state["best_reward_ema"]
        self.last_eval = state["last_eval"]
        self.worker.load(Snapshot(ckpt["sampler"], state["sampler_version"]))
        versions = state.get("snapshot_versions", {})
        self.history = {k: Snapshot(v, versions[str(k)]) for k, v in ckpt["snapshots"].items()}


def _truncate_metrics(path: Path, completed: int) -> None:
    """Keep only the lines of steps before ``completed`` (a crash may have left later ones)."""
    if not path.exists():
        return
    keep = [line for line in path.read_text().splitlines() if line.strip() and json.loads(line)["step"] < completed]
    checkpoint.atomic_write(path, "".join(line + "\n" for line in keep))


def train(config: RunConfig, run_dir=None, *, resume: bool = False, overwrite: bool = False,
          progress: bool | None = None) -> Path:
    torch.manual_seed(config.train.seed)
    driver = Run
    if config.rollout.mode == "async" and config.rollout.runtime == "ray":
        from driftless.train.ray_loop import RayRun as driver
    elif config.rollout.mode == "async" and config.rollout.runtime == "process":
        from driftless.train.process_loop import ProcessRun as driver
    elif config.rollout.mode == "async":
        from driftless.train.async_loop import AsyncRun as driver
    return driver(config, run_dir, progress=progress).run(resume=resume, overwrite=overwrite)
