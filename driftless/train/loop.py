"""The training loop, the same for every runtime.

Each step: get the batch of step s from the rollout source (``rollout.runtime``: sync, thread,
process or ray; driftless.train.sources) → drop the rows older than the source's staleness
bound (counted, never trained on) → trace the batch as consumed (``train.trace``) → update the
learner (scoring, objective, optimizer) → publish the new weights to the source → evaluate on
the held-out split every ``eval_every`` steps → one metrics line → an atomic checkpoint every
``checkpoint_every`` steps. Every random draw is keyed by (seed, step), so on the sync runtime
``resume`` continues with the lines the uninterrupted run would have written.
"""

from __future__ import annotations

import functools
import json
import shutil
import time
from dataclasses import asdict
from pathlib import Path

import torch
from tqdm import tqdm

from driftless.ops import reproducible
from driftless.rollout import Snapshot
from driftless.train import build, checkpoint
from driftless.train.config import RunConfig, dump_config
from driftless.train.evaluate import evaluate
from driftless.train.learners import make_learner
from driftless.train.parallel import Ranks
from driftless.train.sinks import PACKABLE, PACKED_SUFFIX, open_sinks, unpack_run
from driftless.train.sources import drop_stale, make_source, queue_metrics
from driftless.train.trace import TRACE_DIR, write_batch
from driftless.train.warmstart import state_digest

TIMING_KEYS = ("tokens_per_s", "step_time", "rollout_s", "score_s", "loss_s", "optim_s", "eval_s", "wall_time",
               "learner_wait_s", "worker_wait_s", "prequeue_s", "inqueue_s")
SAMPLES_FILE, SAMPLES_PER_EVAL = "samples.jsonl", 4  # a few held-out prompts and responses per evaluation
COLLAPSE_FRACTION = 0.5  # collapsed: train-reward EMA (0.9) below half its best, once the best is >= 0.1


def _reproducible(method):
    """Run ``method`` under ``train.reproducible``'s dispatch mode when the config asks for it (entered once)."""
    @functools.wraps(method)
    def call(self, *args, **kwargs):
        config = self.config if hasattr(self, "config") else args[0]
        with reproducible.within(config.train.reproducible):
            return method(self, *args, **kwargs)
    return call


class Run:
    """One training run. With ``train.reproducible`` every method runs under ``ops.reproducible``'s mode:
    the weights' construction and warm start, each step, evaluation and checkpoints."""

    @_reproducible
    def __init__(self, config: RunConfig, run_dir: str | Path | None = None, *, progress: bool | None = None):
        self.parts = build.Parts(config)  # tokenizer, codec, task, objective, view: each built once, shared
        self.config = build.check(config, self.parts)
        self.dir = Path(run_dir or config.train.run_dir)
        self.progress = config.train.progress if progress is None else progress
        self.tokenizer = self.parts.tokenizer
        self.text = self.parts.codec  # prompts through the model's tokenizer and chat template
        self.task = self.parts.task
        self.eval_problems = self.task.eval_set(config.train.eval_problems)
        check_prompts(self.task, self.text, self.eval_problems)  # refused with their rows before any weights load
        state, self.warm_info = build.initial_state(config, progress=self.progress, parts=self.parts)  # once, here
        self.learner = make_learner(config, state, self.parts)  # the run's own; its source feeds it
        self.source = make_source(config, state, self.learner, self.parts)
        self.ranks = getattr(self.learner, "ranks", None) or Ranks()  # a remote learner runs on one rank
        self.primary = self.ranks.rank == 0  # learner rank 0 evaluates, logs and checkpoints
        # which model the run starts from (a fast-mode warm start's bits follow the CPU's kernels); rank 0 records it
        self.start_digest = state_digest(state) if self.primary else None
        self.step_index = 0  # completed steps
        self.reward_ema: float | None = None
        self.best_reward_ema = 0.0
        self.last_eval: float | None = None
        self.stale_rows_dropped = 0
        self.learner_wait_s = 0.0
        self._sources: dict = {}

    @property
    def policy(self):
        return self.learner.policy

    @property
    def _evaluates(self) -> bool:
        """Rank 0 evaluates; under FSDP every rank runs the evaluation's forwards with it (rank 0 writes)."""
        return self.primary or getattr(self.learner, "sharded", False)

    # ------------------------------------------------------------------ one step
    @_reproducible
    def step(self) -> dict:
        s = self.step_index
        t0 = time.perf_counter()
        delivery = self.source.next(s)
        if delivery.step != s:
            raise RuntimeError(f"batch {delivery.step} arrived for step {s}: batches are consumed in step order")
        self.learner_wait_s += time.perf_counter() - t0
        consumed_at, version = time.time(), self.learner.version
        if delivery.batch is not None:  # learner ranks each sample the whole batch: the same bits, checked
            self.ranks.check_same(delivery.batch.tokens, "batches")
        batch, dropped = drop_stale(delivery.batch, version, self.source.bound)  # never silently used
        self.stale_rows_dropped += dropped
        if self.config.train.trace and self.primary:
            write_batch(self.dir, s, batch, prompts=self._prompt_texts(batch))
        if batch is not None:
            learner = self.learner.update(batch)
        else:
            learner = {"version": version, "skipped_steps": self.learner.skipped_steps}
        self.source.published()
        sources = {}
        if self.source.bound is not None:  # an asynchronous source: how old, how long queued, who waited
            sources["queue"] = {"stale_rows_dropped": self.stale_rows_dropped,
                                **queue_metrics(delivery, batch, version, consumed_at),
                                "learner_wait_s": self.learner_wait_s}
        return self._finish_step(t0, delivery.rollout, learner, {"sampler_refreshed": delivery.refreshed}, sources)

    def _finish_step(self, t0: float, rollout: dict, learner: dict, extra: dict, sources: dict) -> dict:
        """The end of a step: reward EMA and collapse flag, the step count, evaluation, timing."""
        s = self.step_index
        reward = rollout["reward"]
        self.reward_ema = reward if self.reward_ema is None else 0.9 * self.reward_ema + 0.1 * reward
        self.best_reward_ema = max(self.best_reward_ema, self.reward_ema)
        run = {"step": s, **extra,
               "collapsed": bool(self.best_reward_ema >= 0.1 and self.reward_ema < COLLAPSE_FRACTION * self.best_reward_ema)}
        self.step_index += 1
        metrics = {**learner, **rollout, **sources.get("queue", {}), **run}
        if self._evaluates and (self.step_index % self.config.train.eval_every == 0
                             or self.step_index == self.config.train.steps):
            t_eval = time.perf_counter()
            metrics.update(eval_reward=self._evaluate(), eval_s=time.perf_counter() - t_eval)
        metrics["step_time"] = time.perf_counter() - t0
        self._sources = {"rollout": rollout, "learner": learner, **sources, "run": run}
        return metrics

    @_reproducible
    def _evaluate(self) -> float:
        """Held-out reward of the learner's policy (kept as ``last_eval``): greedy, or with ``train.eval_samples``
        the mean over that many samples per problem under the rollout's sampling transform; a few of its prompts
        as the model saw them, with their responses, go to ``samples.jsonl``."""
        n = self.config.train.eval_samples
        result = evaluate(self.policy, self.task, self.text, self.eval_problems,
                          max_new_tokens=self.config.rollout.max_new_tokens, samples=SAMPLES_PER_EVAL,
                          stop=tuple(self.config.rollout.stop), params=self.parts.sampling if n else None,
                          repeats=max(n, 1))
        self.last_eval = result["eval_reward"]
        if not self.primary:
            return self.last_eval
        self.dir.mkdir(parents=True, exist_ok=True)
        with open(self.dir / SAMPLES_FILE, "a") as f:
            f.writelines(json.dumps({"step": self.step_index, **s}, ensure_ascii=False) + "\n" for s in result["samples"])
        return self.last_eval

    def _prompt_texts(self, batch) -> list[str] | None:
        """Each prompt group's prompt as the model saw it (for the trace)."""
        if batch is None:
            return None
        first = {}
        for row, g in enumerate(batch.group.tolist()):
            first.setdefault(g, row)
        return [self.text.show(batch.tokens[row, : batch.prompt_len[row]].tolist()) for row in first.values()]

    # ------------------------------------------------------------------ driving
    @_reproducible
    def run(self, resume: bool = False, overwrite: bool = False) -> Path:
        """Train to ``train.steps``. ``resume`` continues from the newest intact checkpoint; a fresh run
        refuses a directory that already holds one unless ``overwrite``."""
        try:
            return self._run(resume, overwrite)
        finally:
            self.source.close()
            self.ranks.close()

    def _refusal(self, resume: bool, overwrite: bool) -> str | None:
        """Why this run directory cannot start as asked (None: it can); decided by rank 0 for every rank."""
        latest = checkpoint.latest_checkpoint(self.dir)
        if resume and latest is not None and checkpoint.newest_intact(self.dir) is None:
            return f"{self.dir} holds no intact checkpoint (each failed its checksums); pass --overwrite to start over"
        if not resume and latest is not None and not overwrite:
            return (f"{self.dir} already holds a run: pass --resume to continue it, --overwrite to replace it, or "
                    "choose another run directory")
        return None

    def _run(self, resume: bool, overwrite: bool) -> Path:
        cfg = self.config
        refusal = self._refusal(resume, overwrite) if self.primary else None
        refusal = next((r for r in self.ranks.gather(refusal) if r), None)  # every rank stops, not only rank 0
        if refusal:
            raise ValueError(refusal)
        if not self.primary:
            return self._follow(resume)
        self.dir.mkdir(parents=True, exist_ok=True)
        latest = checkpoint.latest_checkpoint(self.dir)
        if resume and latest is not None:
            intact = checkpoint.newest_intact(self.dir)
            self.load_checkpoint(*intact)
            unpack_run(self.dir)  # a packed record is trained further in plain form
            _truncate_metrics(self.dir / "metrics.jsonl", self.step_index)
            _truncate_metrics(self.dir / SAMPLES_FILE, self.step_index + 1)  # samples are keyed by steps done
        else:
            checkpoint.clear_checkpoints(self.dir)
            shutil.rmtree(self.dir / TRACE_DIR, ignore_errors=True)  # a trace is of one run only
            for name in PACKABLE:
                (self.dir / name).unlink(missing_ok=True)
                (self.dir / (name + PACKED_SUFFIX)).unlink(missing_ok=True)
            initial = self._evaluate()
            (self.dir / "initial_eval.json").write_text(json.dumps({"eval_reward": initial,
                                                                    "start_weights_sha256": self.start_digest,
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

    def _follow(self, resume: bool) -> Path:
        """A learner rank other than 0: the same steps (its share of each update), nothing written."""
        cfg = self.config
        intact = checkpoint.newest_intact(self.dir) if resume and checkpoint.latest_checkpoint(self.dir) else None
        if intact is not None:
            self.load_checkpoint(*intact)
        elif self._evaluates:
            self._evaluate()  # the initial evaluation's forwards (FSDP)
        while self.step_index < cfg.train.steps:
            self.step()
            if self.step_index % cfg.train.checkpoint_every == 0 or self.step_index == cfg.train.steps:
                self.save_checkpoint()  # this rank's share of the model and optimizer (torch.distributed.checkpoint)
        return self.dir

    # ------------------------------------------------------------------ checkpoints
    @_reproducible
    def save_checkpoint(self) -> Path:
        learner = self.learner.state_dict()
        sharded = self.learner.sharded_state() if self.ranks.distributed else None  # every rank writes its share
        sampler = self.source.sampler_snapshot()
        snapshots = self.source.snapshots()
        return checkpoint.save_checkpoint(
            self.dir, self.step_index, model=learner["model"], sampler=sampler.state, optimizer=learner["optimizer"],
            sharded=sharded, ranks=self.ranks,
            state={"version": learner["version"], "sampler_version": sampler.version,
                   "skipped_steps": learner["skipped_steps"], "reward_ema": self.reward_ema,
                   "best_reward_ema": self.best_reward_ema, "last_eval": self.last_eval,
                   "stale_rows_dropped": self.stale_rows_dropped,
                   "snapshot_versions": {str(k): v.version for k, v in snapshots.items()}},
            snapshots={k: v.state for k, v in snapshots.items()}, versions=learner["versions"])

    @_reproducible
    def load_checkpoint(self, path: Path, verified: dict | None = None) -> None:
        ckpt = checkpoint.load_checkpoint(path, verified=verified)
        state = ckpt["state"]
        self.learner.load_state_dict({"model": ckpt["model"], "optimizer": ckpt["optimizer"], "dcp": ckpt["dcp"],
                                      "version": state["version"], "skipped_steps": state["skipped_steps"],
                                      "versions": ckpt["versions"]})
        self.step_index = state["step"]
        self.reward_ema, self.best_reward_ema = state["reward_ema"], state["best_reward_ema"]
        self.last_eval = state["last_eval"]
        self.stale_rows_dropped = state.get("stale_rows_dropped", 0)
        versions = state.get("snapshot_versions", {})
        self.source.restore(Snapshot(ckpt["sampler"], state["sampler_version"]),
                            {k: Snapshot(v, versions[str(k)]) for k, v in ckpt["snapshots"].items()})


def check_prompts(task, text, eval_problems) -> None:
    """Every prompt of a finite task (a data file) fits the context, else refused naming its row."""
    rows = [*getattr(task, "train", []), *getattr(task, "eval", [])] if hasattr(task, "rows") else eval_problems
    for row in rows:
        text.encode(row.prompt, where=getattr(row, "where", "held-out prompt"))


def _truncate_metrics(path: Path, completed: int) -> None:
    """Keep only the lines of steps before ``completed`` (a crash may have left later ones)."""
    if not path.exists():
        return
    keep = [line for line in path.read_text().splitlines() if line.strip() and json.loads(line)["step"] < completed]
    checkpoint.atomic_write(path, "".join(line + "\n" for line in keep))


def train(config: RunConfig, run_dir=None, *, resume: bool = False, overwrite: bool = False,
          progress: bool | None = None) -> Path:
    torch.manual_seed(config.train.seed)
    return Run(config, run_dir, progress=progress).run(resume=resume, overwrite=overwrite)
