"""What a task hands the model: a prompt is a string or a list of chat messages ``{role, content}``.

Tasks speak text; the tokenizer (and its chat template) belong to the model, so rendering and
encoding happen on the rollout side (``driftless.rollout.text``). Here: the shape check that
names the bad row, and the plain rendering used when no chat template applies.
"""

from __future__ import annotations

ROLES = ("system", "user", "assistant", "tool")


def check_prompt(value, where: str):
    """``value`` as a prompt, or a ValueError naming ``where`` (file, row and column)."""
    if isinstance(value, str):
        if not value:
            raise ValueError(f"{where}: the prompt is an empty string")
        return value
    if isinstance(value, (list, tuple)) and value:
        messages = []
        for i, m in enumerate(value):
            if not isinstance(m, dict) or set(m) - {"role", "content", "name"} or "role" not in m \
                    or "content" not in m:
                raise ValueError(f"{where}: message {i} must be a {{role, content}} mapping, got {m!r}")
            if m["role"] not in ROLES:
                raise ValueError(f"{where}: message {i} has role {m['role']!r}; roles are {', '.join(ROLES)}")
            if not isinstance(m["content"], str):
                raise ValueError(f"{where}: message {i} content must be a string, got {m['content']!r}")
            messages.append({k: v for k, v in m.items() if v is not None})
        return messages
    raise ValueError(f"{where}: a prompt must be a string or a non-empty list of {{role, content}} messages, "
                     f"got {value!r}")


def plain_text(messages: list[dict]) -> str:
    """Chat messages without a chat template: their contents, one per line."""
    return "\n".join(m["content"] for m in messages)
