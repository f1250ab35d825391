"""Score centering + TIS inside TRL's GRPO trainer, on CPU, on the stand-in checkpoint (docs/integrations.md).

    .venv/bin/driftless export-task runs/data/countdown
    .venv/bin/driftless make-model runs/models/countdown-qwen3 --data runs/data/countdown/train.jsonl \
        --eval-data runs/data/countdown/eval.jsonl
    .venv/bin/python examples/trl_grpo_sc.py [--steps 20] [--sampler-view noise:0.1]

A TRL GRPO script with three lines changed: the two imports below and ``objective=``. It prints the
driftless metrics TRL logged (under ``driftless/``) for the first and last step.
"""

from __future__ import annotations

import argparse
import json

from datasets import Dataset
from transformers import AutoTokenizer

from driftless.integrations.trl import DriftlessGRPOConfig, DriftlessGRPOTrainer  # changed line 1
from driftless.tasks.rewards import countdown


def countdown_reward(prompts, completions, **columns):
    """TinyZero's Countdown rule on TRL's conversational completions."""
    texts = [c[0]["content"] if isinstance(c, list) else c for c in completions]
    return countdown(prompts, texts, **columns)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="runs/models/countdown-qwen3")
    ap.add_argument("--data", default="runs/data/countdown/train.jsonl")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--objective", default="sc+tis")
    ap.add_argument("--sampler-view", default="noise:0.1", help="a mismatch view on the generating copy ('none': off)")
    args = ap.parse_args()
    rows = [json.loads(line) for line in open(args.data)]
    data = Dataset.from_list([{"prompt": r["prompt"], "numbers": r["numbers"], "target": r["target"]} for r in rows])
    config = DriftlessGRPOConfig(  # changed line 2: DriftlessGRPOConfig, objective=...
        output_dir="runs/trl-example", use_cpu=True, report_to="none", bf16=False, gradient_checkpointing=False,
        per_device_train_batch_size=32, num_generations=8, max_completion_length=24, max_steps=args.steps,
        logging_steps=1, save_strategy="no", learning_rate=2e-4, seed=0,
        objective=args.objective, objective_params={"top_k": 32}, head_k=32, sampler_view=args.sampler_view)
    trainer = DriftlessGRPOTrainer(model=args.model, reward_funcs=countdown_reward, args=config, train_dataset=data,
                                   processing_class=AutoTokenizer.from_pretrained(args.model, local_files_only=True))
    trainer.train()
    logged = [e for e in trainer.state.log_history if "driftless/kl_k3" in e]
    keys = ("reward", "driftless/loss", "driftless/kl_k3", "driftless/ratio_max", "driftless/ratio_ess",
            "driftless/sampler_head_mass", "driftless/trainer_head_mass", "driftless/truncated_fraction")
    for name, entry in (("first", logged[0]), ("last", logged[-1])):
        print(name, json.dumps({k: round(entry[k], 5) for k in keys if k in entry}))


if __name__ == "__main__":
    main()
