"""driftless against TRL's GRPOTrainer on SmolLM2-135M-Instruct, a step at equal generated lengths, side by side.

    .venv/bin/python bench/vs_trl.py [--sides own trl dtrl32 dtrl128] [--rounds 2] [--steps 4]
                                     [--prompts 8] [--group 4] [--new-tokens 16] [--out FILE]

Sides, each a process of its own (its peak RSS is that process's ru_maxrss), run in interleaved rounds:
- ``own``: driftless's own trainer (``driftless train configs/smollm2.yaml``, ``sc+tis`` with the sampler's top-32
  head, the config's memory bound ``train.micro_batch_tokens``), ``rollout.ignore_eos=true``;
- ``trl``: TRL's ``GRPOTrainer``, given no end ids after construction (``eos_token_ids``, its generation config), so
  every completion runs to N tokens as with ``ignore_eos``;
- ``dtrl32`` / ``dtrl128``: driftless inside TRL (``DriftlessGRPOTrainer``, ``sc+tis``, ``head_k`` 32 / 128), the same
  TRL settings.
Every side: the same checkpoint, the same chat prompts (runs/data/arithmetic-question, the checkpoint's template with
its default system prompt), P prompts x G samples a step, exactly N new tokens each, temperature 1, fp32, plain SGD
at 0.05 with gradient clipping 1.0, one optimizer step per batch, no reference model. A step's time is the median
over the steps after the first; its split: generation (the engine's decode), scoring + rewards (everything else
before the loss: TRL's reward calls and bookkeeping, driftless's rewards and advantages) and the update (forward,
backward, objective, optimizer). Ratios are each side's median over the rounds against TRL's. Prints JSON.
``make real`` first.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _timing import emit
from real_model import cpu_name

ROOT = Path(__file__).resolve().parents[1]
SIDES = ("own", "trl", "dtrl32", "dtrl128")
LR, CLIP = 0.05, 1.0


def cpu_flags() -> str:
    flags = next((x for x in Path("/proc/cpuinfo").read_text().splitlines() if x.startswith("flags")), "").split()
    return "+".join(f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16") if f in flags)


# ---------------------------------------------------------------------------------------------- the child processes
def run_own(args, out: dict, extra: list[str]) -> None:
    from driftless.cli import main as cli

    with tempfile.TemporaryDirectory() as tmp:
        rc = cli(["train", str(ROOT / "configs/smollm2.yaml"), f"model.hf_path={args.model}",
                  f"task.path={args.data}/train.jsonl", f"task.eval_path={args.data}/eval.jsonl",
                  "objective.name=sc+tis", "objective.params={top_k: 32}", "rollout.head_k=32",
                  f"rollout.prompts_per_step={args.prompts}", f"rollout.group_size={args.group}",
                  f"rollout.max_new_tokens={args.new_tokens}", "rollout.ignore_eos=true", f"optim.lr={LR}",
                  f"optim.grad_clip={CLIP}", f"train.steps={args.steps}", f"train.eval_every={args.steps + 1}",
                  "train.eval_problems=1", "train.eval_samples=0",
                  f"train.checkpoint_every={args.steps + 1}", *extra, "--run-dir", tmp, "--no-progress"])
        if rc:
            raise SystemExit(rc)
        rows = [json.loads(x) for x in (Path(tmp) / "metrics.jsonl").read_text().splitlines()]
    # the last step also evaluates and checkpoints (eval_s is its own column; the checkpoint is not in step_time)
    out["step_s"] = [r["step_time"] - r.get("eval_s", 0.0) for r in rows]
    out["generation_s"] = [r["rollout_s"] for r in rows]
    out["update_s"] = [r["score_s"] + r["loss_s"] + r["optim_s"] for r in rows]
    out["response_tokens"] = [r["response_length"] for r in rows]


def run_trl(args, out: dict, head_k: int | None) -> None:
    import datasets
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback

    sys.path.insert(0, str(ROOT / "examples"))
    from arithmetic_reward import final_number

    n = args.new_tokens
    common = {"output_dir": args.tmp, "per_device_train_batch_size": args.prompts * args.group,
              "num_generations": args.group, "max_completion_length": n, "temperature": 1.0, "learning_rate": LR,
              "optim": "sgd", "lr_scheduler_type": "constant", "warmup_steps": 0, "max_grad_norm": CLIP,
              "max_steps": args.steps, "logging_steps": 1, "save_strategy": "no", "report_to": [], "use_cpu": True,
              "seed": 0, "beta": 0.0, "bf16": False, "dataloader_num_workers": 0, "disable_tqdm": True}
    if head_k is None:
        from trl import GRPOConfig as Config
        from trl import GRPOTrainer as Trainer
    else:
        from driftless.integrations.trl import DriftlessGRPOConfig as Config
        from driftless.integrations.trl import DriftlessGRPOTrainer as Trainer
        common.update(objective="sc+tis", objective_params={"top_k": head_k}, head_k=head_k)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32, local_files_only=True)
    tokenizer = AutoTokenizer.from_pretrained(args.model, local_files_only=True)
    data = datasets.load_dataset("json", data_files=f"{args.data}/train.jsonl", split="train")

    def final_number_of_text(prompts, completions, **columns):  # TRL gives chat completions as message lists
        texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
        return final_number(prompts, texts, **columns)

    trainer = Trainer(model=model, processing_class=tokenizer, reward_funcs=final_number_of_text, args=Config(**common),
                      train_dataset=data)
    # exactly N tokens, as driftless's rollout.ignore_eos and vLLM's ignore_eos: no end id stops a completion (one is
    # sampled as any token; q unchanged, so DriftlessGRPOTrainer accepts it: it refuses generation_kwargs)
    trainer.eos_token_ids = []
    trainer.generation_config.eos_token_id = None
    if getattr(trainer, "generation_kwargs", None) is not None:
        trainer.generation_kwargs["eos_token_id"] = None
    marks: dict[str, list[float]] = {"step_s": [], "generation_s": [], "before_loss_s": []}

    def timing(name, fn):
        def wrapped(*a, **k):
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                marks[name].append(time.perf_counter() - t0)
        return wrapped

    trainer._generate_single_turn = timing("generation_s", trainer._generate_single_turn)
    trainer._generate_and_score_completions = timing("before_loss_s", trainer._generate_and_score_completions)
    lengths: list[float] = []

    class Steps(TrainerCallback):
        def on_step_begin(self, *a, **k):
            self.t0 = time.perf_counter()

        def on_step_end(self, *a, **k):
            marks["step_s"].append(time.perf_counter() - self.t0)

        def on_log(self, _args, _state, _control, logs=None, **k):
            if logs and "completions/mean_length" in logs:
                lengths.append(float(logs["completions/mean_length"]))

    trainer.add_callback(Steps())
    trainer.train()
    out["step_s"] = marks["step_s"]
    out["generation_s"] = marks["generation_s"]
    out["update_s"] = [s - b for s, b in zip(marks["step_s"], marks["before_loss_s"])]
    out["response_tokens"] = lengths


def child(args) -> None:
    out: dict = {"side": args.child}
    with tempfile.TemporaryDirectory() as tmp:
        args.tmp = tmp
        if args.child.startswith("own"):  # own, or own@KEY=VALUE,KEY=VALUE: the shipped config with overrides
            run_own(args, out, [x for x in args.child.partition("@")[2].split(",") if x])
        else:
            run_trl(args, out, {"trl": None, "dtrl32": 32, "dtrl128": 128}[args.child])
    out["peak_rss_gb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    import driftless

    out["driftless_from"] = str(Path(driftless.__file__).resolve().parents[1])
    print("RESULT " + json.dumps(out))


# ---------------------------------------------------------------------------------------------- the driver
def median_after_first(values: list[float]) -> float:
    return statistics.median(values[1:] or values)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sides", nargs="+", default=list(SIDES),
                    help=f"of {', '.join(SIDES)}; own@KEY=VALUE,... runs the own trainer with config overrides")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--group", type=int, default=4)
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument("--model", default=os.environ.get("DRIFTLESS_REAL_MODEL", "runs/models/smollm2-135m-instruct"))
    ap.add_argument("--data", default="runs/data/arithmetic-question")
    ap.add_argument("--out", help="also write the JSON here")
    ap.add_argument("--before-tree", help="a checkout of earlier driftless code: adds the side own-before (the own "
                    "trainer imported from there, with the same overrides), interleaved with the rest")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.before_tree and not args.child:
        args.sides = [*args.sides, "own-before"]
    for side in [args.child] if args.child else args.sides:
        if side == "own-before":
            continue
        if side.partition("@")[0] not in SIDES or ("@" in side and not side.startswith("own@")):
            ap.error(f"unknown side {side!r}: one of {', '.join(SIDES)}, or own@KEY=VALUE,...")
    if args.child:
        return child(args)
    if not Path(args.model, "config.json").exists():
        raise SystemExit(f"{args.model}: no checkpoint (run `make real` first)")
    runs: dict[str, list[dict]] = {s: [] for s in args.sides}
    for r in range(args.rounds):
        for side in args.sides:
            cmd = [sys.executable, __file__, "--child", side] + [
                f"--{k.replace('_', '-')}={v}" for k, v in vars(args).items()
                if k in ("steps", "prompts", "group", "new_tokens", "model", "data")]
            env = dict(os.environ)
            if side == "own-before":  # the earlier code first on the path (a script's own folder is bench/, not ROOT)
                cmd[3] = "own"
                env["PYTHONPATH"] = os.pathsep.join(x for x in (args.before_tree, env.get("PYTHONPATH")) if x)
            t0 = time.perf_counter()
            done = subprocess.run(cmd, capture_output=True, text=True, check=False, cwd=ROOT, env=env)
            if done.returncode:
                raise SystemExit(f"{side} failed:\n{done.stderr[-3000:]}")
            got = json.loads(next(x for x in done.stdout.splitlines() if x.startswith("RESULT "))[7:])
            got["process_s"] = round(time.perf_counter() - t0, 1)
            runs[side].append(got)
            print(f"round {r} {side}: step {median_after_first(got['step_s']):.2f} s, "
                  f"peak {got['peak_rss_gb']:.2f} GB", file=sys.stderr)
    summary = {}
    for side, got in runs.items():
        summary[side] = {k: round(statistics.median(median_after_first(g[k]) for g in got), 3)
                         for k in ("step_s", "generation_s", "update_s")}
        summary[side]["before_update_s"] = round(summary[side]["step_s"] - summary[side]["update_s"], 3)
        summary[side]["other_than_generation_before_update_s"] = round(
            summary[side]["before_update_s"] - summary[side]["generation_s"], 3)
        summary[side]["peak_rss_gb"] = round(max(g["peak_rss_gb"] for g in got), 3)
        summary[side]["response_tokens_mean"] = round(statistics.mean(x for g in got for x in g["response_tokens"]), 2)
    ratios = {}
    if "trl" in summary:
        for side in summary:
            if side != "trl":
                ratios[f"{side}_vs_trl_step"] = round(summary[side]["step_s"] / summary["trl"]["step_s"], 3)
                ratios[f"{side}_vs_trl_peak_rss"] = round(summary[side]["peak_rss_gb"] / summary["trl"]["peak_rss_gb"], 3)
    result = {"bench": "vs_trl", "before_tree": args.before_tree, "cpu": cpu_name(), "cpu_flags": cpu_flags(), "threads": os.cpu_count(),
              "batch": f"{args.prompts}x{args.group}", "new_tokens": args.new_tokens, "steps": args.steps,
              "rounds": args.rounds, "ratios": ratios, "summary": summary, "runs": runs}
    emit(result, args.out, indent=1)


if __name__ == "__main__":
    main()
