"""Cold compile cost of an aligned piece under inductor's store-vs-inline threshold; prints JSON.

    .venv/bin/python bench/compile_cost.py                 # the log-softmax piece at 50 (torch's CPU default) and 30

Each setting compiles ``ops.exact._log_softmax_rows`` (128 × 40 rows, one thread) in a process of its own with empty
inductor and kernel caches, and reports the first call's seconds, inductor's code-generation seconds
(``Scheduler.codegen``) and the compiled call's median milliseconds (ops.fuse uses 30: docs/alignment.md).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

CHILD = r"""
import json, statistics, sys, time, torch
from torch._dynamo.utils import compile_times
from driftless.ops import exact, fuse
torch.set_num_threads(1)
fuse._cache_per_kernel_set()
from torch._inductor.cpu_vec_isa import pick_vec_isa
pick_vec_isa()  # its probes apart from the piece's own compile
fn = exact._log_softmax_rows.eager
x = torch.randn(128, 40, generator=torch.Generator().manual_seed(0))
options = {**fuse.INDUCTOR_OPTIONS, "realize_opcount_threshold": int(sys.argv[1])}
compiled = torch.compile(fn, dynamic=True, options=options)
with fuse._trace_settings(), torch.no_grad():
    t = time.perf_counter(); out = compiled(x); first = time.perf_counter() - t
    runs = []
    for _ in range(20):
        t = time.perf_counter(); compiled(x); runs.append(time.perf_counter() - t)
rows = dict(line.split(", ") for line in compile_times(repr="str", aggregate=True).splitlines() if ", " in line)
print(json.dumps({"first_call_s": round(first, 2), "codegen_s": round(float(rows.get("Scheduler.codegen", 0)), 2),
                  "run_ms": round(statistics.median(runs) * 1e3, 3), "same_as_eager": bool(torch.equal(out, fn(x)))}))
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--thresholds", type=int, nargs="+", default=[50, 30])
    args = ap.parse_args()
    out = {}
    for threshold in args.thresholds:
        with tempfile.TemporaryDirectory() as tmp:
            env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": os.path.join(tmp, "inductor"),
                   "XDG_CACHE_HOME": os.path.join(tmp, "xdg")}
            done = subprocess.run([sys.executable, "-c", CHILD, str(threshold)], env=env, capture_output=True,
                                  text=True, check=True)
            out[str(threshold)] = json.loads(done.stdout.strip().splitlines()[-1])
    print(json.dumps({"piece": "_log_softmax_rows", "by_realize_opcount_threshold": out}, indent=1))


if __name__ == "__main__":
    main()
