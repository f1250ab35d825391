"""Warm start: supervised pretraining of the built-in model on generated solutions.

RL needs a policy whose reward is nonzero but improvable. ``warm_start`` trains TinyLM with
teacher forcing on prompt → solution pairs from the task's training split (loss on completion
tokens only), deterministically, then measures greedy eval reward on the held-out split. The
result is cached under ``runs/warmstart/<key>/`` (model.safetensors + info.json), keyed by every
setting that changes it, and reused by later runs.
"""

from __future__ import annotations

import hashlib
import json
import random
import time
from dataclasses import asdict
from pathlib import Path

import torch

from driftless.models import TinyLM, TinyLMConfig, load_model, save_model
from driftless.ops.reproducible import within
from driftless.train.config import WarmStartConfig
from driftless.train.evaluate import evaluate
from driftless.train.optim import ExactAdamW, one_cycle
from driftless.train.sft import sft


def sft_batch(problems, tokenizer):
    seqs, starts = [], []
    for p in problems:
        prompt = tokenizer.encode(p.prompt)
        seqs.append(prompt + tokenizer.encode(p.completion, bos=False) + [tokenizer.eos_id])
        starts.append(len(prompt))
    width = max(len(s) for s in seqs)
    tokens = torch.full((len(seqs), width), tokenizer.pad_id, dtype=torch.long)
    mask = torch.zeros(len(seqs), width, dtype=torch.bool)
    for i, (s, st) in enumerate(zip(seqs, starts)):
        tokens[i, : len(s)] = torch.tensor(s)
        mask[i, st:len(s)] = True
    return tokens, mask


# Bump when the model's numerics change: 1000 SFT steps amplify ulp-level differences into a
# different warm start (seen: held-out 0.38 vs 0.30 after a change in the attention kernel call).
NUMERICS_VERSION = 2
REPRODUCIBLE_VERSION = 3  # 3: correctly rounded √ (exact_sqrt). Bump when the reproducible recipe's bits change (its digest is the same on every CPU)


def cache_key(model_config: TinyLMConfig, task, ws: WarmStartConfig, max_new_tokens: int,
              reproducible: bool = False) -> str:
    task_cfg = asdict(task.config) if hasattr(task, "config") else {"max_operand": getattr(task, "max_operand", None)}
    model = asdict(model_config)
    if not model_config.n_experts:  # a dense model: the key it had before mixtures of experts existed
        for name in ("n_experts", "experts_per_token", "norm_topk_prob"):
            model.pop(name)
    settings = {"model": model, "task": [task.name, task_cfg], "warm": asdict(ws),
                "max_new_tokens": max_new_tokens, "v": NUMERICS_VERSION}
    if reproducible:  # another recipe (aligned, exact AdamW, no momentum cycling), another model
        settings["reproducible"] = REPRODUCIBLE_VERSION
    blob = json.dumps(settings, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:12]


def weights_digest(model: torch.nn.Module) -> str:
    """SHA-256 of the parameters' bytes in order: the same key can train other weights on another CPU (the
    warm start runs in fast mode, whose bits follow the kernel set), and a study must not pair runs that
    started from different models (the sweep report flags them)."""
    return state_digest(model.state_dict())


def state_digest(state: dict) -> str:
    """``weights_digest`` of a state dict: which model a run starts from (its ``initial_eval.json`` records it as
    ``start_weights_sha256``, and a sweep reuses a finished run only when this machine would start from the same)."""
    h = hashlib.sha256()
    for name, tensor in state.items():
        h.update(name.encode())
        h.update(tensor.detach().contiguous().cpu().reshape(-1).view(torch.uint8).numpy().tobytes())  # bf16 too
    return h.hexdigest()[:16]


def warm_start(model_config: TinyLMConfig, task, tokenizer, ws: WarmStartConfig, *, max_new_tokens: int,
               cache_dir: str | Path = "runs/warmstart", progress: bool = True, reproducible: bool = False):
    """Train (or load from the cache) the warm-started model; returns (model, info).

    ``reproducible`` (``train.reproducible``): aligned execution, ``ExactAdamW`` and ``one_cycle``'s learning
    rate without momentum cycling, every operation under ``ops.reproducible.Reproducible`` (entered here
    when no caller has: the sweep's driver warms up outside any run), so the weights (and their digest)
    are the same on every CPU."""
    with within(reproducible):
        return _warm_start(model_config, task, tokenizer, ws, max_new_tokens=max_new_tokens, cache_dir=cache_dir,
                           progress=progress, reproducible=reproducible)


def _warm_start(model_config, task, tokenizer, ws, *, max_new_tokens, cache_dir, progress, reproducible):
    key = cache_key(model_config, task, ws, max_new_tokens, reproducible)
    out_dir = Path(cache_dir) / key
    if (out_dir / "model.safetensors").exists() and (out_dir / "info.json").exists():
        model, _ = load_model(out_dir / "model.safetensors")
        return model, {**json.loads((out_dir / "info.json").read_text()), "weights_sha256": weights_digest(model)}
    torch.manual_seed(ws.seed)
    model = TinyLM(model_config, execution="aligned" if reproducible else "fast")
    model.reset_parameters(seed=ws.seed)
    if reproducible:
        opt = ExactAdamW(model.parameters(), lr=ws.lr, weight_decay=ws.weight_decay, betas=(0.9, 0.95))
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: one_cycle(step, ws.steps))
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=ws.lr, weight_decay=ws.weight_decay, betas=(0.9, 0.95))
        if 0.05 * ws.steps >= 2:
            sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=ws.lr, total_steps=ws.steps, pct_start=0.05)
        else:  # torch's OneCycleLR divides by a zero-length warm-up under 40 steps: the same curve, no momentum cycling
            sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: one_cycle(step, ws.steps))
    rng = random.Random(ws.seed)
    t0 = time.time()
    loss_value = sft(model, opt, sched, lambda: sft_batch(task.sample(ws.batch_size, rng, "train"), tokenizer), ws.steps,
                     desc="warm start", progress=progress, clip_foreach=False)
    result = evaluate(model, task, tokenizer, task.eval_set(ws.eval_problems), max_new_tokens=max_new_tokens)
    info = {"key": key, "final_loss": loss_value, "seconds": time.time() - t0, **result,
            "config": asdict(ws), "model": asdict(model_config),
            "cpu_capability": torch.backends.cpu.get_cpu_capability(), "reproducible": reproducible,
            "weights_sha256": weights_digest(model)}
    out_dir.mkdir(parents=True, exist_ok=True)
    save_model(model, out_dir / "model.safetensors", version=0)
    tmp = out_dir / "info.json.tmp"
    tmp.write_text(json.dumps(info, indent=2))
    tmp.replace(out_dir / "info.json")
    return model, info
