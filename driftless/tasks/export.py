"""The built-in problems as data rows: what ``driftless export-task`` writes and ``task.name=dataset`` reads.

One row per distinct problem, as JSON-ready dicts::

    {"prompt": [{"role": "user", "content": "3 7=21:"}],   # chat messages (the task's prompt text)
     "answer": "3*7",                                        # one solution (the verifier accepts any)
     "completion": "<answer>3*7</answer>",                  # what a supervised warm start teaches
     "numbers": [3, 7], "target": 21}                        # countdown: what its reward reads

Arithmetic rows carry ``"answer": "19"`` and ``"completion": "19"``. The split is the task's own
hash split, so an exported eval file holds exactly the built-in held-out problems.
"""

from __future__ import annotations

import json
import random
from pathlib import Path


def problem_row(task, problem) -> dict:
    row = {"prompt": [{"role": "user", "content": problem.prompt}], "completion": problem.completion}
    if task.name == "countdown":
        row.update(answer=problem.solution, numbers=list(problem.numbers), target=problem.target)
    else:
        row["answer"] = problem.completion
    return row


def task_rows(task, split: str, *, draws: int = 20_000, seed: int = 0, limit: int | None = None) -> list[dict]:
    """The distinct problems of ``split`` found in ``draws`` draws of the task's generator, in the order found."""
    if split not in ("train", "eval"):
        raise ValueError(f"split must be 'train' or 'eval', got {split!r}")
    rng, seen, rows = random.Random(seed), set(), []
    batch = 256
    for _ in range(0, draws, batch):
        for problem in task.sample(batch, rng, split):
            key = problem.prompt  # distinct prompts (countdown: "3 7=21:" and "7 3=21:" are two)
            if key in seen:
                continue
            seen.add(key)
            rows.append(problem_row(task, problem))
            if limit is not None and len(rows) >= limit:
                return rows
    return rows


QUESTION = "What is {a} + {b}? Answer with the number only."


def question_rows(split: str, *, min_operand: int = 1, max_operand: int = 20) -> list[dict]:
    """Every sum ``a + b`` with a, b in [min_operand, max_operand] asked as a chat question (``QUESTION``), the
    held-out split by the arithmetic task's own hash (about 1 in 10, disjoint from train), in (a, b) order:
    ``{"prompt": [{"role": "user", "content": "What is 12 + 7? Answer with the number only."}], "answer": "19",
    "completion": "19", "a": 12, "b": 7}``. What ``driftless export-task --questions`` writes for a
    pretrained chat model (docs/real-model.md)."""
    from driftless.tasks.arithmetic import Arithmetic

    if split not in ("train", "eval"):
        raise ValueError(f"split must be 'train' or 'eval', got {split!r}")
    if not 0 <= min_operand <= max_operand:
        raise ValueError(f"operands: need 0 <= min_operand <= max_operand, got {min_operand}, {max_operand}")
    splitter = Arithmetic(max(max_operand, 1))
    return [{"prompt": [{"role": "user", "content": QUESTION.format(a=a, b=b)}], "answer": str(a + b),
             "completion": str(a + b), "a": a, "b": b}
            for a in range(min_operand, max_operand + 1) for b in range(min_operand, max_operand + 1)
            if splitter.split_of(a, b) == split]


def write_jsonl(rows: list[dict], path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(json.dumps(r) + "\n" for r in rows))
    tmp.replace(path)
    return path
