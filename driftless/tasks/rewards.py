"""Rewards for data files: built-in verifiers by name, or the user's own function.

Every reward is called in batches as ``fn(prompts, completions, **columns) -> list[float]``: the
shape of TRL's ``reward_funcs``, so existing reward code fits. ``prompts`` are the rows' prompts
(strings or chat messages, as in the file), ``completions`` the decoded responses (strings), and
every other column of the rows arrives as a keyword holding one value per row.

Built-ins (``task.reward: <name>``):

- ``countdown``: TinyZero's rule (1 iff the last ``<answer>…</answer>`` uses each of the row's
  ``numbers`` once and equals its ``target``), reading the columns ``numbers`` and ``target``;
- ``exact``: 1 iff the answer (the last ``<answer>…</answer>`` or ``\\boxed{…}`` if present, else
  the whole completion) equals the row's answer (``task.answer_key``) after normalization
  (case, surrounding whitespace and punctuation, inner runs of whitespace);
- ``math``: the ``math-verify`` package's equivalence of the answer (``\\boxed{}`` or
  ``<answer>`` tags) and the row's answer.

A user function: ``task.reward: "package.module:function"`` or ``"path/to/file.py:function"``.
"""

from __future__ import annotations

import importlib
import importlib.util
import re
import sys
from pathlib import Path

from driftless.tasks.countdown import score as countdown_score

ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
BUILTIN = ("countdown", "exact", "math")


def extract_answer(completion: str) -> str:
    """The last ``<answer>…</answer>``, else the last ``\\boxed{…}`` (balanced braces), else the completion."""
    tagged = ANSWER.findall(completion)
    if tagged:
        return tagged[-1]
    start = completion.rfind("\\boxed{")
    if start >= 0:
        depth, i = 0, start + len("\\boxed")
        for j in range(i, len(completion)):
            depth += {"{": 1, "}": -1}.get(completion[j], 0)
            if depth == 0:
                return completion[i + 1:j]
    return completion


def normalize(text: str) -> str:
    return " ".join(str(text).casefold().split()).strip(" .,;:!?\"'`")


def _column(columns: dict, name: str, reward: str) -> list:
    if name not in columns:
        raise ValueError(f"reward {reward!r} reads the column {name!r}, which the rows do not have "
                         f"(columns: {', '.join(sorted(columns)) or 'none'})")
    return columns[name]


def countdown(prompts, completions, **columns) -> list[float]:
    numbers, targets = _column(columns, "numbers", "countdown"), _column(columns, "target", "countdown")
    return [countdown_score(n, t, c) for n, t, c in zip(numbers, targets, completions)]


def exact(prompts, completions, *, answer_key: str = "answer", **columns) -> list[float]:
    answers = _column(columns, answer_key, "exact")
    return [float(normalize(extract_answer(c)) == normalize(a)) for c, a in zip(completions, answers)]


def math(prompts, completions, *, answer_key: str = "answer", **columns) -> list[float]:
    try:
        from math_verify import parse, verify
    except ImportError as err:  # pragma: no cover - exercised only without the extra
        raise ImportError("task.reward=math needs the math-verify package: pip install 'driftless[hf]'") from err
    answers = _column(columns, answer_key, "math")
    out = []
    for completion, answer in zip(completions, answers):
        found = extract_answer(completion)
        gold = parse(str(answer) if "$" in str(answer) or "\\" in str(answer) else f"${answer}$")
        guess = parse(f"\\boxed{{{found}}}") if found != completion else parse(completion)
        out.append(float(bool(gold) and bool(guess) and verify(gold, guess)))
    return out


def load(spec: str):
    """A reward by name, or a user function ``module:function`` / ``file.py:function``; ValueError naming it."""
    if spec in BUILTIN:
        return {"countdown": countdown, "exact": exact, "math": math}[spec]
    if ":" not in spec:
        raise ValueError(f"unknown reward {spec!r}: a built-in ({', '.join(BUILTIN)}) or 'module.path:function'")
    module_name, _, fn_name = spec.rpartition(":")
    try:
        if module_name.endswith(".py"):
            path = Path(module_name)
            if not path.exists():
                raise ValueError(f"reward {spec!r}: file {module_name} does not exist")
            import hashlib

            digest = hashlib.sha256(str(path.resolve()).encode()).hexdigest()[:12]
            name = f"driftless_reward_{path.stem}_{digest}"  # two files with one name are two modules
            module = sys.modules.get(name)
            if module is None:
                module_spec = importlib.util.spec_from_file_location(name, path)
                module = importlib.util.module_from_spec(module_spec)
                sys.modules[name] = module
                module_spec.loader.exec_module(module)
        else:
            module = importlib.import_module(module_name)
    except ImportError as err:
        raise ValueError(f"reward {spec!r}: cannot import {module_name!r} ({err})") from None
    fn = getattr(module, fn_name, None)
    if not callable(fn):
        raise ValueError(f"reward {spec!r}: {module_name} has no function {fn_name!r}")
    return fn
