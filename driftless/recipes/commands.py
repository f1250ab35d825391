"""The recipes' commands: the seed table, alignment and mismatch tables, sweeps, reports, the study, the demo,
calibration and ``make-model``."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from driftless.commands import command, given_keys

# make-model's architecture, named by train's model.* keys (its own defaults: a Qwen3 of about 1.7M parameters)
MAKE_MODEL_SHAPE = {"model.d_model": 192, "model.n_layer": 4, "model.n_head": 3, "model.n_kv_head": 1,
                    "model.d_ff": 512, "model.max_seq_len": 128}


def _seed_table_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--p", type=float, nargs="+", default=[0.8, 0.2])
    p.add_argument("--q", type=float, nargs="+", default=[0.5, 0.5])
    p.add_argument("--advantages", type=float, nargs="+", default=[2.0, 0.0])
    p.add_argument("--beta", type=float, default=0.2)
    p.add_argument("--json", action="store_true")


@command("seed-table", "[mismatch]'s expected-update table, computed by the objectives", arguments=_seed_table_arguments)
def _seed_table(args) -> int:
    """[mismatch]'s worked example, computed by running the library's objectives exactly."""
    from driftless.analysis import expected_logit_update

    p, q, adv = args.p, args.q, args.advantages
    rows = [("pg", {}, "raw E_q[A s_z]"), ("sc", {}, "SC Cov_q(A, s_z)"), ("is", {}, "exact IS E_p[A s_z]"),
            ("sc+kl", {"beta": args.beta}, f"SC + sampler KL, beta={args.beta}"),
            ("tis", {}, "TIS (cap 2)"), ("sc+tis", {}, "SC + TIS"), ("sc+mis", {}, "SC + MIS"),
            ("reinforce-zero", {}, "REINFORCE Zero")]
    out = {}
    print(f"Expected logit update at one prefix: p={p}, q={q}, A={adv}")
    print(f"| {'objective':<16} | {'what':<30} | update |")
    print(f"|{'-' * 18}|{'-' * 32}|--------|")
    for name, params, what in rows:
        vec = expected_logit_update(p, q, adv, name, **params).tolist()
        out[name] = vec
        print(f"| {name:<16} | {what:<30} | ({', '.join(f'{x:.2f}' for x in vec)}) |")
    if args.json:
        print(json.dumps(out))
    return 0


ALIGNMENT_KEYS = ("rollout.max_new_tokens", "rollout.temperature", "rollout.top_k", "rollout.top_p", "train.seed")


def _check_alignment_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", help="a TinyLM safetensors file (default: a random TinyLM)")
    p.add_argument("--modes", nargs="+", default=None,
                   help="aligned-xproc: sampler and trainer in two processes with other CPU kernels, BLAS path "
                        "and thread count, for each pair of kernel sets this CPU runs (named in the output); vllm (not by default, needs the vLLM extra): a vLLM engine's q vs the "
                        "transformers trainer's p (docs/vllm.md)")
    p.add_argument("--view", default="w8a8+kv:int8", help="sampler mismatch view for the +quant modes")
    p.add_argument("--trainer-numerics", default="fwd-fq", choices=["fwd-fq", "native"],
                   help="trainer forward for the +quant modes (with 'native', add native to --view)")
    p.add_argument("--prompts", type=int, default=12)
    p.add_argument("--experts", type=int, default=0,
                   help="a mixture-of-experts TinyLM with this many experts (top-2) for the TinyLM modes (the "
                        "default modes less hf); adds the share of token-layers routed alike (docs/moe.md)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE",
                   help="train's own keys: " + ", ".join(ALIGNMENT_KEYS) + " (default: 24 new tokens, temperature 1, "
                        "no top-k / top-p, seed 0)")


@command("check-alignment", "sampler vs trainer log-probs per execution mode", arguments=_check_alignment_arguments)
def _check_alignment(args) -> int:
    from driftless.recipes.alignment import MODES, run_check
    from driftless.rollout import SamplingParams

    given = given_keys("check-alignment", args.overrides, ALIGNMENT_KEYS)
    params = SamplingParams(temperature=given.get("rollout.temperature", 1.0), top_k=given.get("rollout.top_k", 0),
                            top_p=given.get("rollout.top_p", 1.0))
    modes = args.modes or [m for m in MODES if not (args.experts and m == "hf")]
    result = run_check(model_path=args.model, modes=tuple(modes), num_prompts=args.prompts,
                       max_new_tokens=given.get("rollout.max_new_tokens", 24), seed=given.get("train.seed", 0),
                       params=params, view=args.view,
                       trainer_numerics=args.trainer_numerics, n_experts=args.experts)
    if args.json:
        print(json.dumps(result))
        return 0
    routed = args.experts > 0
    print(f"| {'mode':<13} | {'tokens':>6} | {'bitwise equal':>13} | {'max abs Δ log p':>15} | {'KL(q‖p) k3':>11} |"
          + (" routes equal |" if routed else ""))
    print(f"|{'-' * 15}|{'-' * 8}|{'-' * 15}|{'-' * 17}|{'-' * 13}|" + ("-" * 14 + "|" if routed else ""))
    notes = []
    for mode, r in result["modes"].items():
        if "skipped" in r:
            notes.append(f"{mode}: skipped: {r['skipped']}")
            continue
        print(f"| {mode:<13} | {r['tokens']:>6} | {r['bitwise_equal_fraction']:>13.4f} | "
              f"{r['max_abs_logp_diff']:>15.3e} | {r['kl_k3']:>11.3e} |"
              + (f" {r.get('routes_equal_fraction', float('nan')):>12.4f} |" if routed else ""))
        for pair in r.get("pairs", ()):
            notes.append(f"{mode}: sampler ({pair['sampler']}) vs trainer ({pair['trainer']}): {pair['tokens']} tokens, "
                         f"bitwise equal {pair['bitwise_equal_fraction']:.4f}, max abs Δ log p "
                         f"{pair['max_abs_logp_diff']:.3e}")
    for note in notes:
        print(note)
    return 0


def _mismatch_table_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", help="a TinyLM safetensors file (default: a peaked random TinyLM); with --engine vllm, "
                                    "a transformers directory (default: a peaked random tiny Qwen3); with --config, "
                                    "other weights of its model (model.kind=hf: a transformers directory)")
    p.add_argument("--kinds", nargs="+", help="view specs (default: the docs/mismatch.md list)")
    p.add_argument("--prompts", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--experts", type=int, default=0,
                    help="a mixture-of-experts TinyLM with this many experts (top-2): adds the routing columns "
                         "(expert sets flipped, tokens touched, KL with routing replay; docs/moe.md)")
    p.add_argument("--engine", choices=("driftless", "vllm"), default="driftless",
                    help="the sampler: the built-in one (TinyLM) or a vLLM engine (tiny Qwen3; docs/vllm.md)")
    p.add_argument("--config", help="a run config: measure on its task's training prompts, tokenizer, end ids, "
                                     "sampling and length, from its starting weights (--model: other weights of "
                                     "the same model), as its step 0 sees them; without it, random prompts")
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE",
                   help="with --config: any of train's keys, applied to it; without: rollout.max_new_tokens (default 24)")
    p.add_argument("--json", action="store_true")


@command("mismatch-table", "KL, max |Δ log p| and head mass per sampler mismatch view", arguments=_mismatch_table_arguments)
def _mismatch_table(args) -> int:
    from driftless.recipes.mismatch_table import format_table, run_config_table, run_table

    looks_like_override = [k for k in args.kinds or () if "=" in k]
    if looks_like_override:
        raise ValueError(f"mismatch-table: {looks_like_override[0]} is an override, not a view: put a.b=c "
                         "overrides before --kinds")
    if args.config is not None:
        if args.engine != "driftless" or args.experts:
            raise ValueError("mismatch-table --config measures the config's own model with the built-in sampler: "
                             "drop --engine vllm / --experts (set model.n_experts in the config instead)")
        from driftless.train import load_config

        result = run_config_table(load_config(args.config, args.overrides), model_path=args.model,
                                  kinds=tuple(args.kinds) if args.kinds else None, num_prompts=args.prompts,
                                  seed=args.seed)
        print(json.dumps(result) if args.json else format_table(result))
        return 0
    result = run_table(model_path=args.model, kinds=tuple(args.kinds) if args.kinds else None,
                       num_prompts=args.prompts, seed=args.seed,
                       max_new_tokens=given_keys("mismatch-table (without --config)", args.overrides,
                                                 ("rollout.max_new_tokens",)).get("rollout.max_new_tokens", 24),
                       engine=args.engine, n_experts=args.experts)
    print(json.dumps(result) if args.json else format_table(result))
    return 0


def _calibrate_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--settings", nargs="+", default=None, help="names from driftless.recipes.calibrate.SETTINGS")
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--run-dir", default="runs/calibration")
    p.add_argument("--no-progress", action="store_true")


@command("calibrate", "train named settings without mismatch, several seeds; held-out gains", arguments=_calibrate_arguments)
def _calibrate(args) -> int:
    from driftless.recipes.calibrate import run_calibration

    report = run_calibration(args.run_dir, settings=args.settings, seeds=args.seeds, workers=args.workers,
                             progress=not args.no_progress)
    print(report.read_text())
    return 0


def _sweep_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("experiment", help="YAML with base, set, variants and grid (docs/diagnostics.md)")
    p.add_argument("--run-dir", required=True, help="each trial goes to RUN_DIR/<its grid values>/")
    p.add_argument("--max-concurrent", type=int, default=None, help="trials at once (default: the cluster's CPUs)")
    p.add_argument("--reuse", nargs="+", default=(), metavar="DIR",
                    help="folders searched for finished runs of the very same computation (config.yaml equal but "
                         "for where it is written): a trial that has one takes its record instead of training")
    p.add_argument("--no-progress", action="store_true")


@command("sweep", "a grid of runs on Ray Tune from an experiment file (resumable)", arguments=_sweep_arguments)
def _sweep(args) -> int:
    from driftless.recipes.sweep import run_sweep
    from driftless.recipes.sweep_report import write_sweep_report

    missing = [d for d in args.reuse if not Path(d).is_dir()]
    if missing:
        raise ValueError(f"sweep --reuse: {missing[0]} is not a directory")
    result = run_sweep(args.experiment, args.run_dir, max_concurrent=args.max_concurrent,
                       progress=not args.no_progress, reuse=[Path(d) for d in args.reuse])
    if result.get("reused") and args.no_progress:  # with progress, run_experiment says so itself
        print(f"{result['reused']} trial(s) took the record of a finished run under {' '.join(args.reuse)}")
    report = write_sweep_report(args.run_dir)
    print(report.read_text())
    for name, error in result["failed"].items():
        print(f"driftless: trial {name} failed: {error}", file=sys.stderr)
    return 1 if result["failed"] else 0


def _report_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("sweep_dir")
    p.add_argument("--by", nargs="+", default=None, help="grid keys to group by (default: all but the seeds)")
    p.add_argument("--references", nargs="+", default=(), metavar="SWEEP_DIR",
                     help="other sweeps whose reference runs a run may pair with (same seeds, same initial model)")
    p.add_argument("--pairs", nargs="+", default=(), metavar="A:B",
                     help="groups compared seed by seed: A − B of final reward and AUC with intervals, KL A / B")


@command("report", "one table and plots across a sweep's runs: driftless report SWEEP_DIR", arguments=_report_arguments)
def _report(args) -> int:
    from driftless.recipes.sweep_report import write_sweep_report

    print(write_sweep_report(args.sweep_dir, by=args.by, references=args.references, pairs=args.pairs).read_text())
    return 0


def _compare_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("sweep_dirs", nargs="+", metavar="SWEEP_DIR")
    p.add_argument("--labels", nargs="+", default=None, help="one name per sweep (default: the folders' names)")
    p.add_argument("--by", nargs="+", default=None, help="grid keys to group by (default: all but the seeds)")
    p.add_argument("--out", default=None, help="also write the table to this Markdown file")


@command("compare", "the same methods of several sweeps side by side: driftless compare A B", arguments=_compare_arguments)
def _compare(args) -> int:
    from driftless.recipes.sweep_report import compare_sweeps

    text = compare_sweeps(args.sweep_dirs, labels=args.labels, by=args.by)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text)
    print(text, end="")
    return 0


def _study_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--quick", action="store_true", help="the headline subset only, into runs/study-quick")
    p.add_argument("--only", nargs="+", default=None, help="these experiments of experiments/study/ only")
    p.add_argument("--run-dir", default=None, help="default: results/study (runs/study-quick with --quick)")
    p.add_argument("--workers", type=int, default=None, help="runs trained at once (default: one per CPU)")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--reports", action="store_true",
                    help="regenerate each experiment's report from its committed records, training nothing")


@command("study", "the seeds' comparisons in miniature (docs/RESULTS.md); resumable", arguments=_study_arguments)
def _study(args) -> int:
    from driftless.recipes.study import run_study

    if args.quick and args.only:
        raise ValueError("study: --quick and --only exclude each other")
    if args.reports:
        from driftless.recipes.study import write_reports

        for path in write_reports(args.run_dir or "results/study", only=args.only):
            print(path)
        return 0
    index = run_study(args.run_dir or ("runs/study-quick" if args.quick else "results/study"), only=args.only,
                      quick=args.quick, workers=args.workers, progress=not args.no_progress, reuse=not args.quick)
    print(index.read_text())
    return 0


def _demo_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", default=None, help="base config (default: configs/demo.yaml settings)")
    p.add_argument("--methods", nargs="+", default=["baseline", "pg", "tis", "sc"],
                   help="objective presets, and 'baseline' (pg without the mismatch view)")
    p.add_argument("--workers", type=int, default=None, help="runs trained at once (default: min(2, CPUs))")
    p.add_argument("--seeds", type=int, default=1,
                   help="RL seeds per method (the warm start is shared); the demo's check used 3 (docs/calibration.md)")
    p.add_argument("--first-seed", type=int, default=0,
                   help="RL seeds FIRST_SEED .. FIRST_SEED + SEEDS - 1 (calibration on seeds a record does not show)")
    p.add_argument("--run-dir", default=None, help="default: runs/demo (runs/demo-check with --warm-start-seeds)")
    p.add_argument("--warm-start-seeds", type=int, default=None,
                   help="the demo's check: every method over this many warm starts × --seeds RL seeds (resumable; "
                        "docs/calibration.md)")
    p.add_argument("--expect", default=None, metavar="RECORD",
                   help="after the demo, compare every metric line (timings aside) of its seed-0 runs with RECORD's "
                        "(results/demo-reproducible: the README's numbers); exit 1 naming the first difference")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("overrides", nargs="*", help="key.sub=value overrides for every method")


@command("demo", "the main job: a no-mismatch baseline, then pg, tis and sc under mismatch", arguments=_demo_arguments)
def _demo(args) -> int:
    from driftless.recipes.demo import run_demo

    if args.warm_start_seeds is not None:
        from driftless.recipes.demo import run_demo_check

        report = run_demo_check(args.run_dir or "runs/demo-check", warm_start_seeds=args.warm_start_seeds,
                                methods=args.methods, seeds=args.seeds, first_seed=args.first_seed,
                                config_path=args.config, overrides=args.overrides, progress=not args.no_progress, workers=args.workers)
    else:
        report = run_demo(args.run_dir or "runs/demo", methods=args.methods, seeds=args.seeds,
                          first_seed=args.first_seed, config_path=args.config, overrides=args.overrides, progress=not args.no_progress,
                          workers=args.workers)
    print(report.read_text())
    if args.expect:
        from driftless.recipes.demo import differences

        found = differences(report.parent, args.expect, methods=args.methods)
        if found:
            print(f"the demo differs from {args.expect}:\n  " + "\n  ".join(found), file=sys.stderr)
            return 1
        print(f"every metric line (timings aside) equals {args.expect}'s: the same bits")
    return 0


def _make_model_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("dir", help="where the checkpoint goes (reused when it holds this very build)")
    p.add_argument("--data", help="training rows, JSONL as export-task writes (default: the built-in Countdown)")
    p.add_argument("--eval-data", help="held-out rows, JSONL (needed with --data)")
    p.add_argument("--steps", type=int, default=None, help="supervised steps (default: the calibrated 150)")
    p.add_argument("--lr", type=float, default=None, help="peak learning rate (default: 3e-3)")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--vocab-size", type=int, default=512, help="the BPE's largest vocabulary (stops earlier when the "
                                                               "text has no more pairs to merge)")
    p.add_argument("overrides", nargs="*", metavar="model.KEY=VALUE",
                    help="right after DIR: the architecture, in train's own keys: " + ", ".join(
                        f"{k}={v}" for k, v in MAKE_MODEL_SHAPE.items()) + " (these defaults are make-model's)")
    p.add_argument("--whole-numbers", action="store_true",
                    help="GPT-2's pre-tokenizer (numbers as whole tokens) instead of Qwen's one-digit split")
    p.add_argument("--tie-embeddings", action="store_true",
                    help="one matrix for input and output embeddings (as SmolLM2, Qwen3-0.6B, Llama-3.2-1B)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--force", action="store_true", help="rebuild even if DIR holds this build; replace other files")
    p.add_argument("--no-progress", action="store_true")


@command("make-model", "a small Qwen3 checkpoint (Hugging Face format, SFT on a task), built here", arguments=_make_model_arguments,
         description="A small Qwen3 checkpoint in Hugging Face format with a BPE tokenizer trained "
                                    "here, warm-started by SFT on a task (nothing downloaded).")
def _make_model(args) -> int:
    from driftless.recipes.make_model import DEFAULT_LR, DEFAULT_STEPS, make_model, read_jsonl

    if (args.data is None) != (args.eval_data is None):
        raise ValueError("make-model: give both --data and --eval-data, or neither (the built-in Countdown rows)")
    given = given_keys("make-model", args.overrides, tuple(MAKE_MODEL_SHAPE))  # the architecture, train's keys
    shape = {**MAKE_MODEL_SHAPE, **given}
    rows_train = read_jsonl(args.data) if args.data else None
    rows_eval = read_jsonl(args.eval_data) if args.eval_data else None
    info = make_model(args.dir, rows_train=rows_train, rows_eval=rows_eval, vocab_size=args.vocab_size,
                      hidden=shape["model.d_model"], layers=shape["model.n_layer"], heads=shape["model.n_head"],
                      kv_heads=shape["model.n_kv_head"], intermediate=shape["model.d_ff"],
                      max_positions=shape["model.max_seq_len"],
                      sft_steps=DEFAULT_STEPS if args.steps is None else args.steps,
                      sft_batch=args.batch_size, lr=DEFAULT_LR if args.lr is None else args.lr,
                      split_digits=not args.whole_numbers, tie_embeddings=args.tie_embeddings, seed=args.seed,
                      force=args.force,
                      progress=not args.no_progress)
    print(json.dumps({k: v for k, v in info.items() if k != "settings"}))
    print(f"checkpoint in {args.dir}: held-out greedy reward {info['eval_reward']:.3f}, {info['parameters']:,} "
          f"parameters, vocabulary {info['vocab_size']}, built in {info['seconds']:.0f} s")
    return 0


def _pack_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("paths", nargs="+", help="run folders, or folders searched for finished runs (done.json)")
    p.add_argument("--unfinished", action="store_true",
                    help="also runs without done.json (a run that is still training must not be packed)")
    p.add_argument("--slim", action="store_true",
                    help="keep only the metric columns the sweep reports read (a record for git; the run's own "
                         "directory keeps every column): docs/RESULTS.md, 'What a record keeps'")


@command("pack", "compress finished runs' records in place (metrics.jsonl -> metrics.jsonl.xz)", arguments=_pack_arguments)
def _pack(args) -> int:
    from driftless.train.sinks import has_record, pack_run, slim_run

    runs = []
    for root in map(Path, args.paths):
        if not root.is_dir():
            raise ValueError(f"pack: {root} is not a directory")
        found = [p.parent for p in sorted(root.glob("**/config.yaml")) if has_record(p.parent)]
        runs += [r for r in found if args.unfinished or (r / "done.json").exists()]
        skipped = [r for r in found if not args.unfinished and not (r / "done.json").exists()]
        for r in skipped:
            print(f"skipped {r}: no done.json (unfinished, or not a sweep run: --unfinished packs it)", file=sys.stderr)
    before = after = 0
    if args.slim:
        from driftless.recipes.sweep_report import RECORD_COLUMNS
    for run in runs:
        b, a = slim_run(run, RECORD_COLUMNS) if args.slim else pack_run(run)
        before, after = before + b, after + a
    print(json.dumps({"runs": len(runs), "bytes_before": before, "bytes_after": after,
                      "ratio": round(before / after, 2) if after else None}))
    return 0
