"""The model's text interface: task prompts in, token ids out, and responses back to text.

``TextCodec`` holds the model's tokenizer (the checkpoint's own, or TinyLM's characters) and
how prompts are rendered: chat messages go through the tokenizer's chat template
(``task.chat_template: auto`` uses it when the tokenizer has one; ``none`` never), with
``task.system_prompt`` put first; a string prompt is used as it is. A prompt that leaves no room
to generate in the context is refused with its row, or left-truncated to leave ``max_new_tokens``
of room (the generation prompt at the end is kept) when ``truncate`` is set; a response longer
than the room left is cut by the context, as the sampler always does.
"""

from __future__ import annotations

import torch

from driftless.tasks.prompts import plain_text


class TextCodec:
    def __init__(self, tokenizer, *, chat_template: str = "auto", system_prompt: str | None = None,
                 context: int | None = None, max_new_tokens: int = 0, truncate: bool = False):
        if chat_template not in ("auto", "none"):
            raise ValueError(f"task.chat_template must be auto or none, got {chat_template!r}")
        self.tokenizer = tokenizer
        self.templated = chat_template == "auto" and bool(getattr(tokenizer, "chat_template", None))
        self.system_prompt = system_prompt
        self.context, self.max_new_tokens, self.truncate = context, max_new_tokens, truncate
        self.eos_ids = tuple(getattr(tokenizer, "eos_ids", (tokenizer.eos_id,)))
        self.eos_id, self.pad_id = tokenizer.eos_id, tokenizer.pad_id

    def render(self, prompt) -> str:
        """The prompt's text as the model receives it (chat template applied)."""
        if isinstance(prompt, str):
            if self.system_prompt:
                raise ValueError("task.system_prompt applies to chat-message prompts; this prompt is a string")
            return prompt
        messages = list(prompt)
        if self.system_prompt and messages[0]["role"] != "system":
            messages = [{"role": "system", "content": self.system_prompt}, *messages]
        return self.tokenizer.render_chat(messages) if self.templated else plain_text(messages)

    def encode(self, prompt, where: str = "prompt") -> list[int]:
        """Token ids of ``prompt``; a prompt that fills the context is refused naming ``where``."""
        templated = self.templated and not isinstance(prompt, str)
        try:
            ids = self.tokenizer.encode(self.render(prompt), bos=not templated)  # a template carries its own specials
        except ValueError as err:
            raise ValueError(f"{where}: {err}") from None
        if self.context is not None and len(ids) >= self.context:
            if not self.truncate:
                raise ValueError(f"{where}: {len(ids)} prompt tokens leave no room to generate in the context of "
                                 f"{self.context} (model.max_seq_len); raise it, shorten the prompt, or set "
                                 "task.truncate_prompts=true")
            room = max(self.context - self.max_new_tokens, 1)  # keep room for the response where there is some
            ids = ids[len(ids) - room:]
        return ids

    def decode(self, ids) -> str:
        return self.tokenizer.decode(ids)

    def show(self, ids) -> str:
        """Token ids as text with special tokens: what the model saw."""
        return self.tokenizer.show(ids)


def stop_lengths(batch, codec: TextCodec, stop: tuple[str, ...]) -> torch.Tensor:
    """Each row's length once cut at the first token whose decoded prefix contains a stop string.

    The cut keeps that token (as vLLM's ``include_stop_str_in_output`` keeps the text up to the
    stop); every recorded token before it keeps its own log q, since the decision to stop reads
    only the prefix."""
    lengths = batch.length.clone()
    for row, ids in enumerate(batch.completions()):
        text = codec.decode(ids)
        if not any(s in text for s in stop):
            continue
        for n in range(1, len(ids) + 1):
            if any(s in codec.decode(ids[:n]) for s in stop):
                lengths[row] = int(batch.prompt_len[row]) + n
                break
    return lengths
