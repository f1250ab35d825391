"""The smallest learnable task: reward 1 iff the completion starts with one fixed character.

A random-initialised model starts at chance (about 1/vocabulary) and any RL loop that works
reaches reward ~1 within a few dozen updates, so it is the test that the loop can learn at all:
a sign error, or rewards attached to the wrong rows, keeps it at chance.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

_PROMPT_CHARS = "0123456789+-*"


@dataclass(frozen=True)
class FirstTokenProblem:
    text: str
    target: str

    @property
    def prompt(self) -> str:
        return self.text + "="

    @property
    def completion(self) -> str:
        return self.target


class FirstToken:
    name = "first-token"

    def __init__(self, target: str = "7", prompt_len: int = 4):
        if len(target) != 1:
            raise ValueError(f"task.target must be one character, got {target!r}")
        if prompt_len < 1:
            raise ValueError(f"task.prompt_len must be >= 1, got {prompt_len}")
        self.target, self.prompt_len = target, prompt_len

    def sample(self, n: int, rng: random.Random, split: str = "train") -> list[FirstTokenProblem]:
        if split not in ("train", "eval"):
            raise ValueError(f"split must be 'train' or 'eval', got {split!r}")
        out = []
        while len(out) < n:
            text = "".join(rng.choice(_PROMPT_CHARS) for _ in range(self.prompt_len))
            if (hash_split(text) == split):
                out.append(FirstTokenProblem(text, self.target))
        return out

    def eval_set(self, n: int, seed: int = 1234) -> list[FirstTokenProblem]:
        return self.sample(n, random.Random(seed), "eval")

    def score(self, problem: FirstTokenProblem, completion: str) -> float:
        return 1.0 if completion[:1] == problem.target else 0.0


def hash_split(text: str) -> str:
    return "eval" if sum(map(ord, text)) % 10 == 0 else "train"
