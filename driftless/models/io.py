"""safetensors save / load: any state dict (tied weights included), and TinyLM files (weights + config + version).

Real checkpoints tie their input and output embeddings (SmolLM2, Qwen2.5-0.5B, Qwen3-0.6B, Llama-3.2-1B):
``state_dict()`` then holds ``model.embed_tokens.weight`` and ``lm_head.weight`` as one tensor under two
names, and safetensors refuses to write a tensor twice. ``save_weights`` writes each shared tensor once and
records the other names in the file's metadata (``driftless_aliases``: alias -> the name written);
``load_weights`` gives the aliases back as the very same tensor, so ``load_state_dict`` (strict) fills both
names and the tie holds. ``clone_state`` copies a state dict keeping its ties (one copy per shared tensor).
"""

from __future__ import annotations

import json
import os
from collections import OrderedDict
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

ALIASES = "driftless_aliases"


def _key(t: torch.Tensor) -> tuple:
    """Two entries are one tensor when they view the same memory the same way."""
    return (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), tuple(t.stride()), t.dtype,
            t.device)


def aliases(state: dict) -> dict[str, str]:
    """{alias: the first name holding the same tensor} for the entries of ``state`` that share memory."""
    first: dict[tuple, str] = {}
    out = {}
    for name, t in state.items():
        if not isinstance(t, torch.Tensor) or t.numel() == 0:
            continue
        k = _key(t)
        if k in first:
            out[name] = first[k]
        else:
            first[k] = name
    return out


def adopt_state(module: torch.nn.Module, state: dict) -> None:
    """``state``'s tensors become ``module``'s own parameters and buffers (``load_state_dict(assign=True)``: no
    copy), and entries that share one tensor (a tied embedding and output layer) stay one parameter, so an
    optimizer sees it once, as with the module's own tying. ``state`` itself is left as it was (torch records
    ``assign`` in a state dict's ``_metadata``, which would make every later load of it assign too)."""
    own = OrderedDict(state)
    metadata = getattr(state, "_metadata", None)
    if metadata is not None:
        own._metadata = {name: dict(entry) for name, entry in metadata.items()}
    module.load_state_dict(own, assign=True)
    for name, first in aliases(state).items():
        owner, _, attr = name.rpartition(".")
        source, _, source_attr = first.rpartition(".")
        setattr(module.get_submodule(owner), attr, getattr(module.get_submodule(source), source_attr))


def clone_state(state: dict) -> dict:
    """Detached copies of ``state``'s tensors, one per shared tensor (a tied embedding stays one tensor)."""
    tied = aliases(state)
    out = {}
    for name, t in state.items():
        out[name] = out[tied[name]] if name in tied else t.detach().clone()
    return out


def save_weights(state: dict, path, metadata: dict | None = None) -> None:
    """Atomic safetensors write of ``state``; a tensor held under several names is written once (the others
    recorded as aliases in the metadata)."""
    path = Path(path)
    tied = aliases(state)
    tensors = {k: v.detach().contiguous() for k, v in state.items() if k not in tied}
    meta = dict(metadata or {})
    if tied:
        meta[ALIASES] = json.dumps(tied, sort_keys=True)
    tmp = path.with_name(path.name + ".tmp")
    save_file(tensors, str(tmp), metadata=meta or None)
    os.replace(tmp, path)


def read_metadata(path) -> dict:
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        return f.metadata() or {}


def load_weights(path) -> dict:
    """The state dict ``save_weights`` wrote (aliases restored as the same tensor), or any safetensors file."""
    tensors = load_file(str(path))
    tied = json.loads(read_metadata(path).get(ALIASES, "{}"))
    for alias, name in tied.items():
        if name not in tensors:
            raise ValueError(f"{path}: alias {alias!r} names {name!r}, which the file does not hold")
        tensors[alias] = tensors[name]
    return tensors


def save_model(model, path, version: int | None = None) -> None:
    """A TinyLM with its config (and version) in the metadata; atomic: the file appears whole or not at all."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    meta = {"config": json.dumps(model.config_dict()), "kind": type(model).__name__}
    if version is not None:
        meta["version"] = str(int(version))
    save_weights(model.state_dict(), path, meta)


def load_model(path, execution: str = "fast"):
    from driftless.models.tiny import TinyLM, TinyLMConfig

    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"no model file at {path}")
    meta = read_metadata(path)
    if "config" not in meta:
        raise ValueError(f"{path} has no driftless config in its metadata")
    model = TinyLM(TinyLMConfig(**json.loads(meta["config"])), execution=execution)
    model.load_state_dict(load_weights(path))
    version = int(meta["version"]) if "version" in meta else None
    return model, version
