#!/usr/bin/env bash
# Issue 51's aligned / reproducible figures on the CPU this runs on, in one go, each into
# results/bench/<kind>-<bench>.json (kind: vendor and kernel set, e.g. xeon-avx512amx, epyc-avx512, epyc-avx2only):
#
#     bash bench/cpu_kind.sh           # from the repository root, after `make install`; a few minutes, run it alone
#
# 1. bench/fixed_mm.py, one thread: the fixed-order GEMM against torch's at the demo model's shapes, and a weight
#    gradient given g.t() (the blocked path);
# 2. bench/rollout.py --repeats 5 --no-transformers: aligned / fast forward, forward + backward and decode;
# 3. bench/reproducible.py --steps 5 --warm-steps 40: a reproducible step and warm start against fast ones (all cores);
# 4. bench/reproducible.py --threads 1 --steps 5 --no-warm-start --profile: the same step on one thread (a demo run's
#    setting), and one profiled step of each mode split by what its operations serve (gemm, attention, norms,
#    log_softmax, optimizer, compiled, dispatch, other): where a reproducible step's extra time goes on this kind.
# Nothing else should run meanwhile (docs/benchmarks.md says why: timings taken beside other work are no figure).
set -euo pipefail
PY=${PY:-.venv/bin/python}
KIND=${KIND:-$($PY bench/_kind.py)}
OUT=${OUT:-results/bench}
mkdir -p "$OUT"
echo "CPU kind: $KIND -> $OUT/$KIND-*.json"
$PY bench/fixed_mm.py > "$OUT/$KIND-fixed-mm-1thread.json"
$PY bench/rollout.py --repeats 5 --no-transformers > "$OUT/$KIND-rollout.json"
$PY bench/reproducible.py --steps 5 --warm-steps 40 > "$OUT/$KIND-reproducible.json"
$PY bench/reproducible.py --threads 1 --steps 5 --no-warm-start --profile > "$OUT/$KIND-reproducible-1thread-profile.json"
$PY - "$OUT" "$KIND" <<'EOF'
import json, sys
out, kind = sys.argv[1:]
r = json.load(open(f"{out}/{kind}-reproducible.json"))
one = json.load(open(f"{out}/{kind}-reproducible-1thread-profile.json"))
roll = json.load(open(f"{out}/{kind}-rollout.json"))
print(json.dumps({"kind": kind, "reproducible_step_ratio": r["step_ratio"], "warm_start_ratio": r["warm_start_ratio"],
                  "reproducible_step_ratio_1thread": one["step_ratio"],
                  "profile_s_1thread": {m: v.get("profile_s") for m, v in one["median_seconds"].items()},
                  "rollout_ratios": roll.get("ratios")}, indent=1))
EOF
