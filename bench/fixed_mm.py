"""The fixed-order GEMM's rate at the demo model's shapes against torch's float32 GEMM; prints JSON.

    .venv/bin/python bench/fixed_mm.py                              # this CPU's kernel set, one thread
    ATEN_CPU_CAPABILITY=avx2 .venv/bin/python bench/fixed_mm.py     # the AVX2 build on an AVX-512 CPU
    .venv/bin/python bench/fixed_mm.py --threads 2

Shapes ``M x K x N``: a scoring forward of 16 x 8 rows of about 40 tokens (M = 5120) through the demo TinyLM's
projections (d 192, q/k/v 320, gate/up 1024, down 512 -> 192, the 64-token head), and a decode step (M = 128).
Per shape: GFLOP/s of ``fixed_order_mm`` (the median of 7 timings of a loop of about 2e8 multiply-adds) and of
``a @ b`` (torch: MKL / oneDNN), with ``b`` in the kernel's layout (``gemm_layout``) for both.
``transposed_a_ms``: a weight gradient ``g.t() @ x`` of the demo's scoring batch (``g [8448, out]``, ``x [8448, in]``):
torch's ``g.t().contiguous()`` alone, the GEMM on that copy, and the GEMM given ``g.t()`` (made row-major inside the
kernel library); milliseconds, the median of 7.
"""

from __future__ import annotations

import argparse
import platform

import torch
from _timing import emit, timed

from driftless.ops.fixed_mm import _flags, fixed_order_mm, gemm_layout

GRADIENTS = [(8448, 1024, 192), (8448, 320, 192), (8448, 192, 1024)]  # (tokens, out, in)
SHAPES = [(5120, 192, 320), (5120, 192, 1024), (5120, 512, 192), (5120, 192, 64),
          (128, 192, 320), (128, 192, 1024), (128, 512, 192), (1024, 512, 512)]


def rate(fn, m: int, k: int, n: int) -> float:
    reps = max(1, int(2e8 // (m * k * n)))

    def loop():
        for _ in range(reps):
            fn()

    return 2 * m * k * n * reps / timed(loop, 7) / 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    out = {"cpu": platform.processor() or platform.machine(), "cpu_capability": torch.backends.cpu.get_cpu_capability(),
           "kernel_flags": _flags(), "threads": args.threads, "gflops": {}}
    g = torch.Generator().manual_seed(0)
    for m, k, n in SHAPES:
        a, b = torch.randn(m, k, generator=g), gemm_layout(torch.randn(k, n, generator=g))
        out["gflops"][f"{m}x{k}x{n}"] = {
            "fixed_order": round(rate(lambda a=a, b=b: fixed_order_mm(a, b), m, k, n), 1),
            "torch": round(rate(lambda a=a, b=b: a @ b, m, k, n), 1)}
    out["transposed_a_ms"] = {}
    for t, o, i in GRADIENTS:
        grad, x = torch.randn(t, o, generator=g), torch.randn(t, i, generator=g)
        assert torch.equal(fixed_order_mm(grad.t(), x), fixed_order_mm(grad.t().contiguous(), x))
        out["transposed_a_ms"][f"{o}x{t}x{i}"] = {
            "torch_contiguous": round(1e3 * timed(lambda grad=grad: grad.t().contiguous(), 7), 2),
            "gemm_of_contiguous": round(1e3 * timed(lambda grad=grad, x=x: fixed_order_mm(grad.t().contiguous(), x), 7), 2),
            "gemm_of_transposed": round(1e3 * timed(lambda grad=grad, x=x: fixed_order_mm(grad.t(), x), 7), 2),
            "torch_gemm_of_transposed": round(1e3 * timed(lambda grad=grad, x=x: grad.t() @ x, 7), 2)}
    emit(out, None)


if __name__ == "__main__":
    main()
