"""The on-disk layout of a run's checkpoints, in one place.

    RUN/checkpoints/step_000040/model.safetensors    trainer weights
                               sampler.safetensors  the snapshot the rollout workers last got (pre-view)
                               optim.pt             optimizer state
                               dcp/                 model and optimizer of a run on several learner ranks
                                                    (torch.distributed.checkpoint: resumes at any number)
                               state.json           counters (step, version, ...) and every file's SHA-256
                               snapshot_000038.safetensors  weights published after step 38 (a lagged sampler's)
                               version_000012.safetensors   the learner's weights at version 12 (Eq. 1's p_v)
    RUN/checkpoints/latest                          the name of the newest complete checkpoint

A checkpoint is written to a hidden temporary folder and renamed into place, then ``latest`` is
replaced atomically: a crash at any moment leaves the previous checkpoint intact. A checkpoint
damaged afterwards (a truncated or flipped file, a lost one) is named, never crashed on:
``verify`` checks every file against the SHA-256 recorded in ``state.json`` and
``newest_intact`` walks back to the newest checkpoint that passes, saying which it skipped and why.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import warnings
from pathlib import Path

import torch

from driftless.models.io import load_weights, save_weights


class DamagedCheckpoint(ValueError):
    """A checkpoint whose files do not match what was written."""


def atomic_write(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def save_checkpoint(run_dir: Path, step: int, *, model: dict, sampler: dict, optimizer: dict | None, state: dict,
                    snapshots: dict[int, dict] | None = None, versions: dict[int, dict] | None = None,
                    sharded: dict | None = None, ranks=None) -> Path:
    """``snapshots``: published weights a resumed run still needs (a lagged sampler), by step count;
    ``versions``: the learner's past weights by version (the Eq. 1 decomposition's). ``sharded``: the
    model and optimizer as torch.distributed.checkpoint saves them, written by every rank of ``ranks``
    (collective: every rank calls this; rank 0 writes the rest, checksums every file and renames)."""
    root = Path(run_dir) / "checkpoints"
    name = f"step_{step:06d}"
    tmp = root / f".{name}.tmp"
    primary = ranks is None or ranks.rank == 0
    if primary:
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir(parents=True)
    if sharded is not None:
        import torch.distributed.checkpoint as dcp

        ranks.barrier()  # the folder exists before any rank writes into it
        dcp.save(sharded, checkpoint_id=str(tmp / "dcp"))
    if not primary:
        ranks.barrier()  # rank 0 has renamed the checkpoint into place
        return root / name
    save_weights(model, tmp / "model.safetensors")  # tied embeddings: written once, re-tied on load
    save_weights(sampler, tmp / "sampler.safetensors")
    if sharded is None:
        torch.save(optimizer, tmp / "optim.pt")
    for i, snap in (snapshots or {}).items():
        save_weights(snap, tmp / f"snapshot_{i:06d}.safetensors")
    for v, weights in (versions or {}).items():
        save_weights(weights, tmp / f"version_{v:06d}.safetensors")
    files = {f.relative_to(tmp).as_posix(): _sha256(f) for f in sorted(tmp.rglob("*")) if f.is_file()}
    (tmp / "state.json").write_text(json.dumps({"step": step, **state, "files": files}))
    final = root / name
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    atomic_write(root / "latest", name)
    if sharded is not None:
        ranks.barrier()
    return final


def verify(path: Path) -> dict:
    """The checkpoint's state, once every file matches its recorded SHA-256; DamagedCheckpoint otherwise."""
    path = Path(path)
    try:
        state = json.loads((path / "state.json").read_text())
    except FileNotFoundError:
        raise DamagedCheckpoint(f"{path}: state.json is missing") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise DamagedCheckpoint(f"{path}: state.json is not readable JSON ({err})") from None
    files = state.get("files")
    if not isinstance(files, dict):  # written before checksums were kept: loaded as it is
        warnings.warn(f"{path} records no checksums (an older checkpoint): loaded without verification",
                      stacklevel=2)
        return state
    for name, digest in files.items():
        f = path / name
        if not f.exists():
            raise DamagedCheckpoint(f"{path}: {name} is missing")
        if _sha256(f) != digest:
            raise DamagedCheckpoint(f"{path}: {name} does not match its recorded SHA-256 ({f.stat().st_size} bytes "
                                    "now): truncated or altered after it was written")
    return state


def checkpoints(run_dir: Path) -> list[Path]:
    """Every complete checkpoint folder of a run, newest first."""
    root = Path(run_dir) / "checkpoints"
    if not root.exists():
        return []
    return sorted((p for p in root.iterdir() if p.is_dir() and p.name.startswith("step_")), reverse=True)


def latest_checkpoint(run_dir: Path) -> Path | None:
    pointer = Path(run_dir) / "checkpoints" / "latest"
    if pointer.exists():
        return pointer.parent / pointer.read_text().strip()
    found = checkpoints(run_dir)
    return found[0] if found else None


def newest_intact(run_dir: Path) -> tuple[Path, dict] | None:
    """(the newest checkpoint whose files all match their checksums, its verified state), warning about
    each one skipped."""
    for path in checkpoints(run_dir):
        try:
            return path, verify(path)
        except DamagedCheckpoint as err:
            warnings.warn(f"skipping damaged checkpoint {path.name}: {err}", stacklevel=2)
    return None


def load_checkpoint(path: Path, *, weights_only: bool = False, verified: dict | None = None) -> dict:
    """``{"model", "sampler", "optimizer", "state", ...}`` (only ``model`` and ``state`` with ``weights_only``),
    after ``verify`` (skipped when ``verified`` is the state ``newest_intact`` already checked): a damaged
    checkpoint raises DamagedCheckpoint naming the file."""
    path = Path(path)
    out = {"state": verified if verified is not None else verify(path),
           "model": load_weights(path / "model.safetensors")}
    if not weights_only:
        out["sampler"] = load_weights(path / "sampler.safetensors")
        out["dcp"] = path / "dcp" if (path / "dcp").is_dir() else None  # model + optimizer of several ranks
        out["optimizer"] = None if out["dcp"] else torch.load(path / "optim.pt", weights_only=True)
        out["snapshots"] = {int(f.stem.split("_")[1]): load_weights(f) for f in sorted(path.glob("snapshot_*.safetensors"))}
        out["versions"] = {int(f.stem.split("_")[1]): load_weights(f) for f in sorted(path.glob("version_*.safetensors"))}
    return out


def clear_checkpoints(run_dir: Path) -> None:
    shutil.rmtree(Path(run_dir) / "checkpoints", ignore_errors=True)
