"""The on-disk layout of a run's checkpoints, in one place.

    RUN/checkpoints/step_000040/model.safetensors    trainer weights
                               sampler.safetensors  the snapshot the rollout worker last loaded (pre-view)
                               optim.pt             optimizer state
                               state.json           counters: step, version, sampler_version, ...
                               snapshot_000038.safetensors  weights published after step 38 (a lagged sampler's)
                               version_000012.safetensors   the learner's weights at version 12 (Eq. 1's p_v)
    RUN/checkpoints/latest                          the name of the newest complete checkpoint

A checkpoint is written to a hidden temporary folder and renamed into place, then ``latest`` is
replaced atomically: a crash at any moment leaves the previous checkpoint intact.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file


def atomic_write(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def save_checkpoint(run_dir: Path, step: int, *, model: dict, sampler: dict, optimizer: dict, state: dict,
                    snapshots: dict[int, dict] | None = None, versions: dict[int, dict] | None = None) -> Path:
    """``snapshots``: published weights a resumed run still needs (a lagged sampler), by step count;
    ``versions``: the learner's past weights by version (the Eq. 1 decomposition's)."""
    root = Path(run_dir) / "checkpoints"
    name = f"step_{step:06d}"
    tmp = root / f".{name}.tmp"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    save_file({k: v.detach().contiguous() for k, v in model.items()}, str(tmp / "model.safetensors"))
    save_file({k: v.contiguous() for k, v in sampler.items()}, str(tmp / "sampler.safetensors"))
    torch.save(optimizer, tmp / "optim.pt")
    for i, snap in (snapshots or {}).items():
        save_file({k: v.contiguous() for k, v in snap.items()}, str(tmp / f"snapshot_{i:06d}.safetensors"))
    for v, weights in (versions or {}).items():
        save_file({k: t.contiguous() for k, t in weights.items()}, str(tmp / f"version_{v:06d}.safetensors"))
    (tmp / "state.json").write_text(json.dumps({"step": step, **state}))
    final = root / name
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    atomic_write(root / "latest", name)
    return final


def latest_checkpoint(run_dir: Path) -> Path | None:
    pointer = Path(run_dir) / "checkpoints" / "latest"
    return pointer.parent / pointer.read_text().strip() if pointer.exists() else None


def load_checkpoint(path: Path, *, weights_only: bool = False) -> dict:
    """``{"model", "sampler", "optimizer", "state"}`` (only ``model`` and ``state`` with ``weights_only``)."""
    path = Path(path)
    out = {"model": load_file(str(path / "model.safetensors")),
           "state": json.loads((path / "state.json").read_text())}
    if not weights_only:
        out["sampler"] = load_file(str(path / "sampler.safetensors"))
        out["optimizer"] = torch.load(path / "optim.pt", weights_only=True)
        out["snapshots"] = {int(f.stem.split("_")[1]): load_file(str(f)) for f in sorted(path.glob("snapshot_*.safetensors"))}
        out["versions"] = {int(f.stem.split("_")[1]): load_file(str(f)) for f in sorted(path.glob("version_*.safetensors"))}
    return out


def clear_checkpoints(run_dir: Path) -> None:
    shutil.rmtree(Path(run_dir) / "checkpoints", ignore_errors=True)
