"""safetensors save / load for TinyLM (weights + config + version in the metadata)."""

from __future__ import annotations

import json
import os
from pathlib import Path

from safetensors.torch import load_file, save_file


def save_model(model, path, version: int | None = None) -> None:
    """Atomic write: the file appears whole or not at all."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    meta = {"config": json.dumps(model.config_dict()), "kind": type(model).__name__}
    if version is not None:
        meta["version"] = str(int(version))
    tmp = path.with_suffix(path.suffix + ".tmp")
    state = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
    save_file(state, str(tmp), metadata=meta)
    os.replace(tmp, path)


def load_model(path, execution: str = "fast"):
    from safetensors import safe_open

    from driftless.models.tiny import TinyLM, TinyLMConfig

    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"no model file at {path}")
    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata() or {}
    if "config" not in meta:
        raise ValueError(f"{path} has no driftless config in its metadata")
    model = TinyLM(TinyLMConfig(**json.loads(meta["config"])), execution=execution)
    model.load_state_dict(load_file(str(path)))
    version = int(meta["version"]) if "version" in meta else None
    return model, version
