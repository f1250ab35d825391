"""Forward + backward time and peak memory of objectives on large logits; prints JSON.

    .venv/bin/python bench/objectives.py                 # 4096 tokens x 32768 vocabulary
    .venv/bin/python bench/objectives.py --tokens 8192 --vocab 151936

Each case runs in its own subprocess so its peak RSS is its own. Timed: extract_logprobs (chunked,
with the head for sc) + objective + backward to the logits, median of --repeats after a warm-up.
Timings on a shared 2-core machine drift by tens of percent between processes, so the cases run
in --rounds rounds, alternating the order, and each case keeps its fastest round.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time

CASES = {
    "pg": ("pg", {}),
    "tis": ("tis", {}),
    "sc_top32": ("sc", {"top_k": 32}),
    "sc_top128": ("sc", {"top_k": 128}),
    "sc+tis_top128": ("sc+tis", {"top_k": 128}),
    "reinforce-zero": ("reinforce-zero", {}),
}


def run_case(case: str, tokens: int, vocab: int, repeats: int, threads: int) -> dict:
    import torch

    from driftless.objectives import make
    from driftless.ops import extract_logprobs

    torch.set_num_threads(threads)
    name, params = CASES[case]
    obj = make(name, **params)
    g = torch.Generator().manual_seed(0)
    rows = 8
    cols = tokens // rows
    logits = torch.randn(rows, cols, vocab, generator=g)
    tokens_ids = torch.randint(0, vocab, (rows, cols), generator=g)
    k = params.get("top_k") or 0
    head_ids = torch.randint(0, vocab, (rows, cols, k), generator=g) if k else None
    sampler_logp = -torch.rand(rows, cols, generator=g) * 5 - 5
    head_lq = None
    if k:
        head_lq = torch.log(torch.full((rows, cols, k), 0.5 / k))
    batch = {
        "sampler_logp": sampler_logp,
        "action_mask": torch.ones(rows, cols, dtype=torch.bool),
        "advantage": torch.randn(rows, generator=g),
        "sampler_topk_logp": head_lq,
    }
    base_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    times = []
    for i in range(repeats + 1):
        leaf = logits.requires_grad_(True)
        t0 = time.perf_counter()
        view = extract_logprobs(leaf, tokens_ids, head_ids)
        loss, _ = obj(view, batch)
        loss.backward()
        elapsed = time.perf_counter() - t0
        leaf.grad = None
        if i:
            times.append(elapsed)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {"seconds": statistics.median(times), "peak_rss_mib": peak / 1024,
            "extra_rss_mib": (peak - base_rss) / 1024}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--vocab", type=int, default=32768)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--case", choices=sorted(CASES), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.case:
        print(json.dumps(run_case(args.case, args.tokens, args.vocab, args.repeats, args.threads)))
        return
    results: dict = {}
    for r in range(args.rounds):
        for case in (list(CASES) if r % 2 == 0 else list(CASES)[::-1]):
            cmd = [sys.executable, __file__, "--case", case, "--tokens", str(args.tokens), "--vocab", str(args.vocab),
                   "--repeats", str(args.repeats), "--threads", str(args.threads)]
            out = json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout.strip().splitlines()[-1])
            print(f"round {r} {case}: {out}", file=sys.stderr)
            if case not in results or out["seconds"] < results[case]["seconds"]:
                results[case] = out
    pg = results["pg"]
    print(json.dumps({
        "tokens": args.tokens,
        "vocab": args.vocab,
        "threads": args.threads,
        "rounds": args.rounds,
        "cases": results,
        "ratio_sc_top128_vs_pg": results["sc_top128"]["seconds"] / pg["seconds"],
        "peak_memory_ratio_sc_top128_vs_pg": results["sc_top128"]["peak_rss_mib"] / pg["peak_rss_mib"],
    }, indent=2))


if __name__ == "__main__":
    main()
