"""A user reward in TRL's shape for `driftless export-task --questions` rows (configs/smollm2.yaml).

    task.reward: examples/arithmetic_reward.py:final_number

1.0 when the last number in the response is the sum, else 0.0: for "What is 12 + 7? Answer with the number only.",
"19", "12 + 7 = 19." and "The answer is 19." score 1; "The 12 + 7 problem, a classic" and a response cut off
before its answer score 0. SmolLM2-135M-Instruct at temperature 1 scores about 0.1-0.15 (docs/real-model.md).
"""

from __future__ import annotations

import re

NUMBER = re.compile(r"-?\d+")


def final_number(prompts, completions, answer, **columns) -> list[float]:
    out = []
    for completion, expected in zip(completions, answer):
        found = NUMBER.findall(completion.replace(",", ""))
        out.append(1.0 if found and found[-1].lstrip("-").lstrip("0") == str(expected).strip().lstrip("-").lstrip("0")
                   and found[-1].startswith("-") == str(expected).strip().startswith("-") else 0.0)
    return out
