"""Verifiable tasks (Countdown, arithmetic) and the character tokenizer for the built-in model."""

from driftless.tasks.arithmetic import Arithmetic
from driftless.tasks.countdown import Countdown, CountdownConfig, score
from driftless.tasks.tokenizer import CharTokenizer


def make_task(name: str, **kwargs):
    if name == "countdown":
        return Countdown(CountdownConfig(**kwargs))
    if name == "arithmetic":
        return Arithmetic(**kwargs)
    raise ValueError(f"unknown task {name!r}; choose countdown or arithmetic")


__all__ = ["Arithmetic", "CharTokenizer", "Countdown", "CountdownConfig", "make_task", "score"]
