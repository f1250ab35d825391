"""A checkpoint's own tokenizer, with the interface the rollout side uses.

    tok = HFTokenizer("path/to/checkpoint")      # AutoTokenizer, local files only
    ids = tok.encode(text, bos=False)            # no special tokens added (a rendered chat template has them)
    tok.eos_ids                                   # every end-of-sequence id: tokenizer, config.json, generation_config.json
    tok.render_chat(messages)                     # the checkpoint's chat template, with the generation prompt

Pad and end-of-sequence ids come from the checkpoint, never from the built-in character tokenizer:
``eos_token_id`` may be a list in ``config.json`` and ``generation_config.json`` (Qwen3 stops on
both ``<|im_end|>`` and ``<|endoftext|>``), and all of them end a response.
"""

from __future__ import annotations

import json
from pathlib import Path

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def _ids(value) -> list[int]:
    if value is None:
        return []
    if isinstance(value, int):
        return [value]
    return [int(v) for v in value]


def _json(path: Path) -> dict:
    try:
        return json.loads(path.read_text()) if path.exists() else {}
    except json.JSONDecodeError as err:
        raise ValueError(f"{path} is not valid JSON: {err}") from None


class HFTokenizer:
    def __init__(self, path: str | Path):
        try:
            from transformers import AutoTokenizer
        except ImportError as err:  # pragma: no cover - exercised only without the extra
            raise ImportError("a checkpoint's tokenizer needs the 'hf' extra: pip install 'driftless[hf]'") from err
        path = Path(path)
        if not path.is_dir():
            raise ValueError(f"model.hf_path {str(path)!r} is not a directory")
        if not any((path / name).exists() for name in TOKENIZER_FILES):
            raise ValueError(f"model.hf_path {str(path)!r} has no tokenizer (none of {', '.join(TOKENIZER_FILES)}): "
                             "driftless trains with the checkpoint's own tokenizer; save it beside the weights with "
                             "tokenizer.save_pretrained(dir)")
        self.path = path
        self.tok = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
        config, generation = _json(path / "config.json"), _json(path / "generation_config.json")
        eos = _ids(self.tok.eos_token_id) + _ids(config.get("eos_token_id")) + _ids(generation.get("eos_token_id"))
        self.eos_ids: tuple[int, ...] = tuple(dict.fromkeys(eos))  # in order, without repeats
        if not self.eos_ids:
            raise ValueError(f"{path}: no end-of-sequence id (tokenizer eos_token, config.json or generation_config.json "
                             "eos_token_id): responses would never end")
        pad = self.tok.pad_token_id
        if pad is None:
            pad = next(iter(_ids(generation.get("pad_token_id")) + _ids(config.get("pad_token_id"))), self.eos_ids[0])
        self.pad_id = int(pad)
        self.eos_id = self.eos_ids[0]
        self.bos_id = self.tok.bos_token_id
        self.vocab_size = len(self.tok)
        self.special_ids = frozenset(self.tok.all_special_ids)

    @property
    def chat_template(self) -> str | None:
        return getattr(self.tok, "chat_template", None)

    def encode(self, text: str, bos: bool = True) -> list[int]:
        """Token ids of ``text``; ``bos``: add the tokenizer's own special tokens (what it adds to plain text)."""
        return list(self.tok(text, add_special_tokens=bos)["input_ids"])

    def decode(self, ids) -> str:
        """A response's text: up to the first end-of-sequence id, special tokens dropped."""
        ids = [int(i) for i in ids]
        for n, i in enumerate(ids):
            if i in self.eos_ids:
                ids = ids[:n]
                break
        return self.tok.decode(ids, skip_special_tokens=True)

    def show(self, ids) -> str:
        """Text as the model saw it, special tokens and chat template included."""
        return self.tok.decode([int(i) for i in ids], skip_special_tokens=False)

    def render_chat(self, messages: list[dict]) -> str:
        return self.tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
