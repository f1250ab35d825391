"""The synchronous RL loop: the whole algorithm in ``Run.step``.

Each step: (refresh the sampler per the staleness policy, through the mismatch view) →
prompts × group size rollouts → rewards → advantages → trainer scoring → objective → optimizer
→ a new version. Eval on the held-out split with a clean sampler every ``eval_every`` steps.
One flushed ``metrics.jsonl`` line per step; atomic checkpoints; ``resume`` continues so that
the next line equals the uninterrupted run's (every random draw is keyed by (seed, step)).
"""

from __future__ import annotations

import copy
import json
import math
import os
import random
import shutil
import time
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from tqdm import tqdm

from driftless.mismatch import SyncPolicy, parse_view
from driftless.objectives import group_advantages, shape_rewards
from driftless.rollout import Sampler, Snapshot, score_batch
from driftless.tasks import CharTokenizer
from driftless.train.config import RunConfig, dump_config
from driftless.train.evaluate import encode_prompts, evaluate

TIMING_KEYS = ("tokens_per_s", "step_time", "rollout_s", "score_s", "loss_s", "optim_s", "eval_s", "wall_time")
COLLAPSE_FRACTION = 0.5  # collapsed: train-reward EMA (0.9) below half its best, once the best is >= 0.1


def _step_seed(seed: int, step: int, salt: int) -> int:
    return (seed * 1_000_003 + step * 7919 + salt) % (2**62)


def build_policy(config: RunConfig, tokenizer, progress: bool = True):
    """The trainer's policy (and the warm-start info, if any)."""
    m = config.model
    if m.kind == "hf":
        from driftless.models.hf import HFPolicy, tiny_qwen3_config

        source = m.hf_path or tiny_qwen3_config(vocab_size=tokenizer.vocab_size, max_positions=m.max_seq_len)
        torch.manual_seed(config.train.seed)
        return HFPolicy(source), None
    from driftless.models import TinyLM, TinyLMConfig
    from driftless.train.warmstart import warm_start

    model_config = TinyLMConfig(vocab_size=tokenizer.vocab_size, d_model=m.d_model, n_layer=m.n_layer,
                                n_head=m.n_head, n_kv_head=m.n_kv_head, d_ff=m.d_ff, max_seq_len=m.max_seq_len)
    info = None
    if m.warm_start:
        ws = config.warm_start
        base, info = warm_start(model_config, config.task.build(), tokenizer, ws.settings(),
                                max_new_tokens=config.rollout.max_new_tokens, cache_dir=ws.cache_dir,
                                progress=progress)
        state = base.state_dict()
    else:
        base = TinyLM(model_config)
        base.reset_parameters(seed=config.train.seed)
        state = base.state_dict()
    policy = TinyLM(model_config, execution=m.execution)
    policy.load_state_dict(state)
    return policy, info


class Run:
    def __init__(self, config: RunConfig, run_dir: str | Path | None = None, *, progress: bool | None = None):
        self.config = config
        self.dir = Path(run_dir or config.train.run_dir)
        self.progress = config.train.progress if progress is None else progress
        self.tokenizer = CharTokenizer()
        self.task = config.task.build()
        self.objective = config.objective.build()
        self.sampling = config.rollout.sampling()
        self.sync = SyncPolicy(config.mismatch.staleness)
        self.view = parse_view(config.mismatch.view)
        self.policy, self.warm_info = build_policy(config, self.tokenizer, self.progress)
        if config.mismatch.trainer_numerics != "fp":
            self.policy.numerics = self.view.quant.numerics.for_trainer(config.mismatch.trainer_numerics)
        self.sampler = Sampler(copy.deepcopy(self.policy), head_k=config.rollout.head_k,
                               eos_id=self.tokenizer.eos_id, pad_id=self.tokenizer.pad_id, view=self.view)
        if hasattr(self.sampler.policy, "numerics"):
            self.sampler.policy.numerics = None  # the view decides the sampler's numerics
        o = config.optim
        params = [p for p in self.policy.parameters() if p.requires_grad]
        if o.name == "sgd":
            self.optimizer = torch.optim.SGD(params, lr=o.lr, weight_decay=o.weight_decay)
        else:
            self.optimizer = torch.optim.AdamW(params, lr=o.lr, weight_decay=o.weight_decay, betas=(o.beta1, o.beta2))
        self.eval_problems = self.task.eval_set(config.train.eval_problems)
        self.step_index = 0  # completed steps
        self.version = 0  # optimizer updates applied to the trainer
        self.sampler_state: dict | None = None  # the snapshot the sampler last loaded (pre-view)
        self.sampler_version = -1
        self.skipped_steps = 0
        self.reward_ema: float | None = None
        self.best_reward_ema = 0.0
        self.last_eval: float | None = None

    # ------------------------------------------------------------------ the algorithm
    def step(self) -> dict:
        cfg, s = self.config, self.step_index
        t0 = time.perf_counter()
        refreshed = self.sync.should_refresh(s) or self.sampler_state is None
        if refreshed:  # publish the trainer's weights to the sampler (through the mismatch view)
            self._load_sampler(Snapshot.of(self.policy, self.version))

        # rollouts: prompts x group size
        rng = random.Random(_step_seed(cfg.train.seed, s, 1))
        problems = self.task.sample(cfg.rollout.prompts_per_step, rng, "train")
        group_size = cfg.rollout.group_size
        prompts = [tok for tok in encode_prompts(self.tokenizer, problems) for _ in range(group_size)]
        groups = [i for i in range(len(problems)) for _ in range(group_size)]
        batch = self.sampler.generate(prompts, self.sampling, cfg.rollout.max_new_tokens,
                                      seed=_step_seed(cfg.train.seed, s, 2), group=groups)
        t_rollout = time.perf_counter()

        # rewards -> advantages
        completions = [self.tokenizer.decode(c) for c in batch.completions()]
        success = torch.tensor([self.task.score(problems[g], c) for g, c in zip(groups, completions)])
        reward = shape_rewards(success, batch.group, cfg.objective.reward_mode)
        advantage = group_advantages(reward, batch.group, cfg.objective.advantage).float()
        batch = batch.replace(reward=reward.float(), advantage=advantage)

        # trainer scoring (the anchor π0 is the trainer before this update)
        self.policy.train()
        view = score_batch(self.policy, batch, head_k=cfg.rollout.head_k or None)
        batch = batch.replace(anchor_logp=view.logp.detach())
        t_score = time.perf_counter()

        # objective
        metrics: dict = {}
        skipped = False
        try:
            loss, obj_metrics = self.objective(view, batch)
            metrics.update(obj_metrics)
        except FloatingPointError:
            loss, skipped = None, True
        t_loss = time.perf_counter()

        # optimizer (a non-finite loss or gradient skips the step and leaves the weights untouched)
        grad_norm = float("nan")
        if not skipped:
            self.optimizer.zero_grad(set_to_none=True)
            loss.backward()
            params = [p for p in self.policy.parameters() if p.grad is not None]
            grad_norm = float(torch.stack([p.grad.norm() for p in params]).norm()) if params else 0.0
            if not math.isfinite(grad_norm):
                skipped = True
            else:
                if cfg.optim.grad_clip > 0 and grad_norm > cfg.optim.grad_clip:
                    for p in params:
                        p.grad.mul_(cfg.optim.grad_clip / grad_norm)
                self.optimizer.step()
                self.version += 1
            self.optimizer.zero_grad(set_to_none=True)
        if skipped:
            self.skipped_steps += 1
        t_optim = time.perf_counter()

        # bookkeeping and metrics
        mask = batch.action_mask
        mean_reward = float(success.mean())
        self.reward_ema = mean_reward if self.reward_ema is None else 0.9 * self.reward_ema + 0.1 * mean_reward
        self.best_reward_ema = max(self.best_reward_ema, self.reward_ema)
        ages = batch.token_ages(self.version - (0 if skipped else 1))
        n_tokens = int(mask.sum())
        metrics.update({
            "step": s,
            "version": self.version,
            "reward": mean_reward,
            "loss": metrics.get("loss", float("nan")),
            "grad_norm": grad_norm,
            "entropy": float(view.entropy.detach()[mask].mean()) if n_tokens else 0.0,
            "response_length": float((batch.length - batch.prompt_len).float().mean()),
            "sampler_age_mean": float(ages.float().mean()) if n_tokens else 0.0,
            "sampler_age_max": int(ages.max()) if n_tokens else 0,
            "sampler_refreshed": bool(refreshed),
            "skipped_steps": self.skipped_steps,
            "collapsed": bool(self.best_reward_ema >= 0.1 and self.reward_ema < COLLAPSE_FRACTION * self.best_reward_ema),
            "rollout_s": t_rollout - t0,
            "score_s": t_score - t_rollout,
            "loss_s": t_loss - t_score,
            "optim_s": t_optim - t_loss,
        })
        self.step_index += 1
        if self.step_index % cfg.train.eval_every == 0 or self.step_index == cfg.train.steps:
            t_eval = time.perf_counter()
            self.last_eval = evaluate(self.policy, self.task, self.tokenizer, self.eval_problems,
                                      max_new_tokens=cfg.rollout.max_new_tokens)["eval_reward"]
            metrics["eval_reward"] = self.last_eval
            metrics["eval_s"] = time.perf_counter() - t_eval
        step_time = time.perf_counter() - t0
        metrics["step_time"] = step_time
        metrics["tokens_per_s"] = n_tokens / max(t_rollout - t0, 1e-9)
        return metrics

    def _load_sampler(self, snapshot: Snapshot) -> None:
        self.sampler.load(snapshot)
        self.sampler_state, self.sampler_version = snapshot.state, snapshot.version

    # ------------------------------------------------------------------ driving
    def run(self, resume: bool = False, overwrite: bool = False) -> Path:
        """Train to ``train.steps``. ``resume`` continues from the latest checkpoint; a fresh run
        refuses a directory that already holds one unless ``overwrite``."""
        cfg = self.config
        self.dir.mkdir(parents=True, exist_ok=True)
        metrics_path = self.dir / "metrics.jsonl"
        has_checkpoint = (self.dir / "checkpoints" / "latest").exists()
        if resume and has_checkpoint:
            self.load_checkpoint()
            _truncate_metrics(metrics_path, self.step_index)
        else:
            if has_checkpoint and not overwrite:
                raise ValueError(f"{self.dir} already holds a run: pass --resume to continue it, --overwrite to "
                                 "replace it, or choose another run directory")
            shutil.rmtree(self.dir / "checkpoints", ignore_errors=True)
            if metrics_path.exists():
                metrics_path.unlink()
            if self.step_index == 0:
                initial = evaluate(self.policy, self.task, self.tokenizer, self.eval_problems,
                                   max_new_tokens=cfg.rollout.max_new_tokens)["eval_reward"]
                self.last_eval = initial
                (self.dir / "initial_eval.json").write_text(json.dumps({"eval_reward": initial,
                                                                        "warm_start": self.warm_info}, indent=2))
        _atomic_write(self.dir / "config.yaml", dump_config(cfg))
        start_wall = time.time()
        bar = tqdm(range(self.step_index, cfg.train.steps), desc=f"{cfg.objective.name}", disable=not self.progress,
                   initial=self.step_index, total=cfg.train.steps)
        with metrics_path.open("a") as f:
            for _ in bar:
                m = self.step()
                m["wall_time"] = time.time() - start_wall
                f.write(json.dumps(m) + "\n")
                f.flush()
                bar.set_postfix(reward=f"{m['reward']:.2f}", eval=f"{self.last_eval or 0:.2f}",
                                kl=f"{m.get('kl_k3', 0):.1e}")
                if self.step_index % cfg.train.checkpoint_every == 0 or self.step_index == cfg.train.steps:
                    self.save_checkpoint()
        from driftless.experiments.report import write_run_report

        write_run_report(self.dir)
        return self.dir

    # ------------------------------------------------------------------ checkpoints
    def save_checkpoint(self) -> Path:
        root = self.dir / "checkpoints"
        name = f"step_{self.step_index:06d}"
        tmp = root / f".{name}.tmp"
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir(parents=True)
        save_file({k: v.detach().contiguous() for k, v in self.policy.state_dict().items()}, str(tmp / "model.safetensors"))
        save_file({k: v.contiguous() for k, v in self.sampler_state.items()}, str(tmp / "sampler.safetensors"))
        torch.save(self.optimizer.state_dict(), tmp / "optim.pt")
        state = {"step": self.step_index, "version": self.version, "sampler_version": self.sampler_version,
                 "skipped_steps": self.skipped_steps, "reward_ema": self.reward_ema,
                 "best_reward_ema": self.best_reward_ema, "last_eval": self.last_eval}
        (tmp / "state.json").write_text(json.dumps(state))
        final = root / name
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        _atomic_write(root / "latest", name)
        return final

    def load_checkpoint(self) -> None:
        root = self.dir / "checkpoints"
        name = (root / "latest").read_text().strip()
        ckpt = root / name
        self.policy.load_state_dict(load_file(str(ckpt / "model.safetensors")))
        self.optimizer.load_state_dict(torch.load(ckpt / "optim.pt", weights_only=True))
        state = json.loads((ckpt / "state.json").read_text())
        self.step_index, self.version = state["step"], state["version"]
        self.skipped_steps = state["skipped_steps"]
        self.reward_ema, self.best_reward_ema = state["reward_ema"], state["best_reward_ema"]
        self.last_eval = state["last_eval"]
        self._load_sampler(Snapshot(load_file(str(ckpt / "sampler.safetensors")), state["sampler_version"]))


def _atomic_write(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def _truncate_metrics(path: Path, completed: int) -> None:
    """Keep only the lines of steps before ``completed`` (a crash may have left later ones)."""
    if not path.exists():
        return
    keep = [line for line in path.read_text().splitlines() if line.strip() and json.loads(line)["step"] < completed]
    _atomic_write(path, "".join(line + "\n" for line in keep))


def train(config: RunConfig, run_dir=None, *, resume: bool = False, overwrite: bool = False,
          progress: bool | None = None) -> Path:
    torch.manual_seed(config.train.seed)
    return Run(config, run_dir, progress=progress).run(resume=resume, overwrite=overwrite)
