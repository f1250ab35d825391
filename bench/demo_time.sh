#!/usr/bin/env bash
# Issue 50's figure on the CPU this runs on: `make demo` from a fresh clone, install excluded, every cache cold.
#
#     bash bench/demo_time.sh          # from the repository root, after `make install`; ~10 minutes + an install
#
# Clones this repository's committed HEAD into a temporary folder, runs `make install` there (timed apart: pip's
# own cache makes it short), points inductor's cache (TORCHINDUCTOR_CACHE_DIR) and the fixed-order GEMM's kernel
# cache (XDG_CACHE_HOME) at empty folders, and times `make demo` with /usr/bin/time -v. Then writes
# results/bench/<kind>-demo-time.json (kind: bench/_kind.py): the total, the phases read from the runs' own files
# (warm start, workers' start, each pair of runs, the report), the peak RSS, the console's last lines (tqdm's
# redraws resolved) and `demo.differences` against the committed record (empty: every metric line is the
# record's). Nothing else should run meanwhile. WORK=DIR keeps the clone and its logs in DIR.
set -euo pipefail
REPO=$(pwd)
PY=${PY:-$REPO/.venv/bin/python}
KIND=${KIND:-$($PY bench/_kind.py)}
OUT=${OUT:-$REPO/results/bench}
WORK=${WORK:-$(mktemp -d /tmp/driftless-demo-time.XXXXXX)}
mkdir -p "$OUT" "$WORK/inductor" "$WORK/xdg"
rm -rf "$WORK/clone"
git clone -q "$REPO" "$WORK/clone"
cd "$WORK/clone"
echo "CPU kind: $KIND; fresh clone of $(git rev-parse --short HEAD) in $WORK/clone"
install_start=$(date +%s.%N)
make install > "$WORK/install.log" 2>&1
install_end=$(date +%s.%N)
echo "make install: $(awk "BEGIN { print $install_end - $install_start }") s; timing make demo (cold caches) ..."
start=$(date +%s.%N)
status=0
TORCHINDUCTOR_CACHE_DIR="$WORK/inductor" XDG_CACHE_HOME="$WORK/xdg" \
    /usr/bin/time -v -o "$WORK/time.txt" make demo > "$WORK/console.txt" 2>&1 || status=$?
end=$(date +%s.%N)
[ "$status" = 0 ] || echo "make demo exited with $status: the console is $WORK/console.txt" >&2
.venv/bin/python "$REPO/bench/_demo_time.py" --clone "$WORK/clone" --start "$start" --end "$end" \
    --install-s "$(awk "BEGIN { print $install_end - $install_start }")" --time-v "$WORK/time.txt" \
    --console "$WORK/console.txt" --kind "$KIND" --status "$status" | tee "$OUT/$KIND-demo-time.json"
exit "$status"
