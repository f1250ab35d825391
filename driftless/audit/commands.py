"""``driftless audit`` (docs/audit.md)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from driftless.commands import command, given_keys

RECORD_KEYS = ("rollout.temperature", "rollout.top_k", "rollout.top_p")
ENGINE_KEYS = (*RECORD_KEYS, "rollout.max_new_tokens", "train.seed")


def _audit_arguments(p: argparse.ArgumentParser) -> None:
    au_sub = p.add_subparsers(dest="audit_command", required=True, metavar="WHAT")
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
            x.add_argument("--batch-tolerance", type=float, default=1e-3)
            x.add_argument("--vllm-dtype", choices=("float32", "bfloat16"), default=None,
                           help="with --engine vllm: the engine's precision (default: the sampler's float32)")
            x.add_argument("--write-records", help="also write the sampled records here (JSONL)")
        keys = RECORD_KEYS if name == "records" else ENGINE_KEYS
        x.add_argument("overrides", nargs="*", metavar="KEY=VALUE",
                       help="train's own keys: " + ", ".join(keys) + (" (the sampling transform; default: each "
                            "line's, else 1 / 0 / 1)" if name == "records" else
                            " (default: temperature 1, no top-k / top-p, 16 new tokens, seed 0)"))
        x.add_argument("--logprobs-mode", choices=("raw_logprobs", "processed_logprobs"), default=None,
                       help="what the engine declares it records (vLLM's names; default: each line's, else processed)")
        x.add_argument("--max-kl", type=float, default=1e-3, help="numerics: the mean KL(q‖p) per token tolerated")
        x.add_argument("--report", help="write audit.json, audit.md and a plot here")
        x.add_argument("--json", action="store_true", help="print the audit as JSON")


@command("audit", "where sampler-trainer disagreement comes from: audit records or a live engine", arguments=_audit_arguments,
         description="Checks that name the cause of a sampler-trainer disagreement (docs/audit.md). "
                     "Exit status 0 when every check passes, 1 otherwise.")
def _audit(args) -> int:
    from driftless.audit import checks as audit

    given = given_keys(f"audit {args.audit_command}", args.overrides,
                       RECORD_KEYS if args.audit_command == "records" else ENGINE_KEYS)
    settings = {k.split(".", 1)[1]: v for k, v in given.items() if k in RECORD_KEYS}
    if args.logprobs_mode is not None:
        settings["logprobs_mode"] = args.logprobs_mode
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
                                             max_new_tokens=given.get("rollout.max_new_tokens", 16),
                                             seed=given.get("train.seed", 0), eos_ids=eos,
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
