"""Where a sweep's runs spent their time, per variant (mean over its runs); prints JSON.

    .venv/bin/python bench/run_phases.py results/study/recipes

Sums each run's per-step seconds from its metrics.jsonl (generation ``rollout_s``, scoring
``score_s``, optimizer ``optim_s``, held-out ``eval_s``, the learner waiting for batches
``learner_wait_s``), its mean sampler age and its final ``wall_time``. The numbers docs/RESULTS.md
quotes for where time went come from here.
"""

from __future__ import annotations

import json
import sys
from collections import defaultdict
from pathlib import Path

from driftless.train.sinks import has_record, read_metrics

SUMS = ("rollout_s", "score_s", "optim_s", "eval_s", "learner_wait_s")


def main() -> None:
    if len(sys.argv) != 2 or not Path(sys.argv[1]).is_dir():
        sys.exit("usage: bench/run_phases.py SWEEP_DIR (a folder of run folders with metrics.jsonl)")
    per_variant = defaultdict(list)
    for run_dir in sorted(p for p in Path(sys.argv[1]).iterdir() if p.is_dir() and has_record(p)):
        rows = read_metrics(run_dir)  # metrics.jsonl or its packed metrics.jsonl.xz
        if not rows:
            continue
        run = {k: sum(r.get(k) or 0.0 for r in rows) for k in SUMS}
        run["sampler_age_mean"] = sum(r.get("sampler_age_mean") or 0.0 for r in rows) / len(rows)
        run["wall_time"] = rows[-1].get("wall_time")
        per_variant[run_dir.name.split(",")[0]].append(run)
    out = {v: {k: round(sum(r[k] or 0.0 for r in runs) / len(runs), 2) for k in runs[0]} | {"runs": len(runs)}
           for v, runs in per_variant.items()}
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
