"""A character-level tokenizer for the built-in model (ids 0–2 are pad, bos, eos)."""

from __future__ import annotations

PAD, BOS, EOS = 0, 1, 2
CHARS = "0123456789+-*/() =<>:,answerASNWER?"


class CharTokenizer:
    def __init__(self, chars: str = CHARS, vocab_size: int = 64):
        unique = []
        for c in chars:
            if c not in unique:
                unique.append(c)
        self.chars = unique
        self.stoi = {c: i + 3 for i, c in enumerate(unique)}
        self.itos = {i: c for c, i in self.stoi.items()}
        if vocab_size < len(unique) + 3:
            raise ValueError(f"vocab_size {vocab_size} is smaller than the {len(unique) + 3} tokens needed")
        self.vocab_size = vocab_size
        self.pad_id, self.bos_id, self.eos_id = PAD, BOS, EOS
        self.eos_ids = (EOS,)
        self.chat_template = None  # no chat template: chat messages are rendered as plain text

    def encode(self, text: str, bos: bool = True) -> list[int]:
        bad = sorted({c for c in text if c not in self.stoi})
        if bad:
            raise ValueError(f"characters not in the tokenizer: {bad}")
        return ([BOS] if bos else []) + [self.stoi[c] for c in text]

    def decode(self, ids) -> str:
        out = []
        for i in ids:
            i = int(i)
            if i == EOS:
                break
            if i in self.itos:
                out.append(self.itos[i])
        return "".join(out)

    def show(self, ids) -> str:
        """Text as the model saw it (BOS and pad dropped: they have no character)."""
        return "".join(self.itos.get(int(i), "") for i in ids)
