"""Verifiable tasks (Countdown, arithmetic, first-token) and the character tokenizer for the built-in model."""

from driftless.tasks.arithmetic import Arithmetic
from driftless.tasks.countdown import Countdown, CountdownConfig, score
from driftless.tasks.first_token import FirstToken
from driftless.tasks.tokenizer import CharTokenizer


def make_task(name: str, **kwargs):
    if name == "countdown":
        return Countdown(CountdownConfig(**kwargs))
    if name == "arithmetic":
        return Arithmetic(**kwargs)
    if name == "first-token":
        return FirstToken(**kwargs)
    raise ValueError(f"unknown task {name!r}; choose countdown, arithmetic or first-token")


__all__ = ["Arithmetic", "CharTokenizer", "Countdown", "CountdownConfig", "FirstToken", "make_task", "score"]
