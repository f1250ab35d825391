"""A simpler task for fast tests: ``"12+7="`` → ``"19"``; reward 1 iff the completion is the sum."""

from __future__ import annotations

import random
from dataclasses import dataclass


@dataclass(frozen=True)
class SumProblem:
    a: int
    b: int

    @property
    def prompt(self) -> str:
        return f"{self.a}+{self.b}="

    @property
    def completion(self) -> str:
        return str(self.a + self.b)


class Arithmetic:
    name = "arithmetic"

    def __init__(self, max_operand: int = 20):
        if max_operand < 1:
            raise ValueError(f"task.max_operand must be >= 1, got {max_operand}")
        self.max_operand = max_operand

    def split_of(self, a, b) -> str:
        return "eval" if (a * 31 + b * 17) % 10 == 0 else "train"

    def sample(self, n: int, rng: random.Random, split: str = "train") -> list[SumProblem]:
        out = []
        while len(out) < n:
            a, b = rng.randint(0, self.max_operand), rng.randint(0, self.max_operand)
            if self.split_of(a, b) == split:
                out.append(SumProblem(a, b))
        return out

    def eval_set(self, n: int, seed: int = 1234) -> list[SumProblem]:
        return self.sample(n, random.Random(seed), "eval")

    def score(self, problem: SumProblem, completion: str) -> float:
        return 1.0 if completion.strip() == problem.completion else 0.0
