"""How often torch.sqrt misses the correctly rounded root, per MKL code branch (docs/alignment.md).

torch's CPU ``sqrt`` calls MKL's vector math (VML, "high accuracy") on x86 builds; its roots follow the
branch MKL picks (``MKL_CBWR``). Each branch runs in its own process on a million uniform values in
[0, 10) (seeded) and is compared with numpy's root, the processor's correctly rounded instruction, which
``driftless.ops.exact.exact_sqrt`` uses. Prints JSON: the fraction of roots that differ, per branch and dtype.

    .venv/bin/python bench/sqrt_branches.py
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

CHILD = """
import json, numpy as np, torch
g = torch.Generator().manual_seed(0)
x64 = torch.rand(1_000_000, generator=g, dtype=torch.float64) * 10
out = {}
for dt in (torch.float32, torch.float64):
    x = x64.to(dt)
    out[str(dt).replace("torch.", "")] = float((torch.sqrt(x).numpy() != np.sqrt(x.numpy())).mean())
print(json.dumps(out))
"""


def main() -> None:
    import torch

    from driftless.ops.cpu import runnable_kernel_sets

    branches = ["COMPATIBLE", "AUTO"] + [b for b, s in (("AVX2", "avx2"), ("AVX512", "avx512"))
                                         if s in runnable_kernel_sets()]
    result = {"torch": torch.__version__, "cpu_capability": torch.backends.cpu.get_cpu_capability(),
              "mkl": torch.backends.mkl.is_available(), "differ_from_correctly_rounded": {}}
    for branch in branches:
        env = {**os.environ, "MKL_CBWR": branch, "OMP_NUM_THREADS": "1"}
        done = subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True, text=True, check=True)
        result["differ_from_correctly_rounded"][branch] = json.loads(done.stdout)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
