"""Traces of asynchronous runs, and their replay.

Which version a batch starts from, and when refreshes happen, depends on timing in an
asynchronous run. The trace (``train.trace``, on every runtime) records what the learner actually consumed, step by step: every
batch as trained on (tokens, per-token versions and kv_versions, recorded log q and head,
rewards, advantages; stale rows already dropped) and its refresh events, in
``RUN/trace/step_000012.safetensors``. ``replay(run_dir)`` rebuilds the learner from the same
initial weights and config and re-runs its updates on the traced batches: the same losses,
gradient norms and weights as the original run, because the learner is deterministic given its
batches. ``driftless replay RUN`` does it from the command line.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from driftless.rollout import RolloutBatch, SamplingParams
from driftless.train import build
from driftless.train.config import load_config

TRACE_DIR = "trace"


def write_batch(run_dir: Path, step: int, batch: RolloutBatch | None, prompts: list[str] | None = None) -> None:
    """Record the batch the learner consumed at ``step`` (None: every row was dropped as stale); ``prompts``:
    each prompt group's prompt as the model saw it (chat template included), kept in the file's metadata."""
    out = Path(run_dir) / TRACE_DIR
    out.mkdir(parents=True, exist_ok=True)
    tensors, meta = {}, {"step": str(step)}
    if batch is not None:
        for f in dataclasses.fields(batch):
            value = getattr(batch, f.name)
            if isinstance(value, torch.Tensor):
                tensors[f.name] = value.contiguous()
        meta["sampling"] = json.dumps(dataclasses.asdict(batch.sampling))
        meta["meta"] = json.dumps(batch.meta)
        if prompts is not None:
            meta["prompts"] = json.dumps(prompts, ensure_ascii=False)
    tmp = out / f".step_{step:06d}.tmp"
    save_file(tensors, str(tmp), metadata=meta)
    tmp.replace(out / f"step_{step:06d}.safetensors")


def read_batch(path: Path) -> RolloutBatch | None:
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
        tensors = load_file(str(path))
    except (SafetensorError, OSError) as err:
        raise ValueError(f"trace file {path} is damaged and cannot be replayed: {err}") from None
    if not tensors:
        return None
    sampling = SamplingParams(**json.loads(meta["sampling"]))
    return RolloutBatch(**tensors, sampling=sampling, meta=json.loads(meta.get("meta", "{}")))


def replay(run_dir):
    """Re-run the learner of ``run_dir`` on its traced batches: (the learner's metrics per step, the learner)."""
    run_dir = Path(run_dir)
    files = sorted((run_dir / TRACE_DIR).glob("step_*.safetensors"))
    if not files:
        raise ValueError(f"{run_dir} has no trace (runs with train.trace=true write one, under {TRACE_DIR}/)")
    config = load_config(run_dir / "config.yaml")
    torch.manual_seed(config.train.seed)
    state, _ = build.initial_state(config, progress=False)
    learner = build.learner(config, state)
    out = []
    for path in files:
        batch = read_batch(path)
        if batch is None:
            out.append({"version": learner.version, "skipped_steps": learner.skipped_steps})
            continue
        out.append(learner.update(batch))
    return out, learner
