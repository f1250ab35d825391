"""The fixed-order GEMM (ops/fixed_mm.py): one fma chain per output, the same bits whatever the machine does."""

import os
import subprocess
import sys

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from driftless.ops import fixed_mm
from driftless.ops.cpu import runnable_kernel_sets
from driftless.ops.fixed_mm import fixed_order_bmm, fixed_order_mm, fixed_order_mm_reference


def _operands(seed: int, m: int, k: int, n: int, spread: float) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    # rows and columns of very different magnitudes: the chain's roundings matter
    a = torch.randn(m, k, generator=g) * torch.exp(spread * torch.randn(m, 1, generator=g))
    b = torch.randn(k, n, generator=g) * torch.exp(spread * torch.randn(1, n, generator=g))
    return a, b


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), m=st.integers(1, 30), k=st.integers(1, 70), n=st.integers(1, 40),
       spread=st.sampled_from([0.0, 3.0, 10.0]))
def test_the_compiled_kernel_gives_the_reference_chain_bit_for_bit(seed, m, k, n, spread):
    a, b = _operands(seed, m, k, n, spread)
    assert torch.equal(fixed_order_mm(a, b), fixed_order_mm_reference(a, b))
    assert fixed_mm.kernel_failure() is None  # the compiled kernel was what ran


def test_each_step_is_one_fma_not_a_double_then_float_rounding():
    # 1 + (2^-24 + 2^-60): just above the midpoint between 1 and 1 + 2^-23. One rounding (an fma) goes up;
    # rounding to float64 first lands exactly on the midpoint and then ties to even, down to 1.
    a1 = (1 + 2.0**-12) * 2.0**-24
    b1 = 1 - 2.0**-12 + 2.0**-24
    a = torch.tensor([[1.0, a1]])
    b = torch.tensor([[1.0], [b1]])
    assert float(torch.tensor(a1, dtype=torch.float32)) == a1 and float(torch.tensor(b1, dtype=torch.float32)) == b1
    naive = (a.double() @ b.double()).float()
    assert naive.item() == 1.0  # the test can tell the two apart
    assert fixed_order_mm(a, b).item() == 1 + 2.0**-23
    assert fixed_order_mm_reference(a, b).item() == 1 + 2.0**-23


@settings(max_examples=15, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), m=st.integers(2, 300), lo=st.integers(0, 299), size=st.integers(1, 40))
def test_a_row_does_not_depend_on_its_neighbours_or_the_thread_count(seed, m, lo, size):
    a, b = _operands(seed, m, 192, 576, 2.0)  # large enough to run on several threads
    lo = min(lo, m - 1)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        full = fixed_order_mm(a, b)
        torch.set_num_threads(1)
        assert torch.equal(fixed_order_mm(a, b), full)
        assert torch.equal(fixed_order_mm(a[lo:lo + size], b), full[lo:lo + size])
        assert torch.equal(fixed_order_mm(a.flip(0), b), full.flip(0))
    finally:
        torch.set_num_threads(before)


def test_it_is_an_fp32_gemm_in_accuracy():
    a, b = _operands(0, 64, 512, 96, 0.0)
    exact = a.double() @ b.double()
    err = (fixed_order_mm(a, b).double() - exact).abs().max().item()
    assert 0 < err < 1e-4 * exact.abs().max().item()


def test_empty_reductions_give_zeros():
    assert torch.equal(fixed_order_mm(torch.ones(3, 0), torch.ones(0, 5)), torch.zeros(3, 5))
    assert fixed_order_mm(torch.ones(0, 4), torch.ones(4, 5)).shape == (0, 5)


def test_bad_operands_are_refused_by_name():
    with pytest.raises(ValueError, match=r"a \[M, K\] and b \[K, N\]"):
        fixed_order_mm(torch.zeros(2, 3), torch.zeros(4, 5))
    with pytest.raises(ValueError, match="float32"):
        fixed_order_mm(torch.zeros(2, 3, dtype=torch.float64), torch.zeros(3, 5))


def test_without_a_compiler_it_warns_once_and_gives_the_same_bits(tmp_path):
    a, b = _operands(7, 5, 33, 19, 3.0)
    torch.save({"a": a, "b": b}, tmp_path / "ab.pt")
    script = (
        "import warnings, torch\n"
        "from driftless.ops.fixed_mm import fixed_order_mm, kernel_failure\n"
        f"d = torch.load({str(tmp_path / 'ab.pt')!r})\n"
        "with warnings.catch_warnings(record=True) as w:\n"
        "    warnings.simplefilter('always')\n"
        "    c = fixed_order_mm(d['a'], d['b'])\n"
        "    fixed_order_mm(d['a'], d['b'])\n"
        f"torch.save(c, {str(tmp_path / 'c.pt')!r})\n"
        "print(len([x for x in w if 'fixed-order GEMM' in str(x.message)]), kernel_failure() is not None)\n"
    )
    env = {**os.environ, "CC": str(tmp_path / "no-such-compiler"), "XDG_CACHE_HOME": str(tmp_path / "cache")}
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, check=True)
    assert done.stdout.split() == ["1", "True"]
    assert torch.equal(torch.load(tmp_path / "c.pt"), fixed_order_mm(a, b))


@pytest.mark.parametrize("kernel_set", runnable_kernel_sets())
def test_every_kernel_set_builds_a_kernel_with_the_same_bits(tmp_path, kernel_set):
    # the AVX-512 build (12-row tiles of 16-lane vectors), the AVX2 one (6-row tiles of two 8-lane vectors, plain C
    # for the rest), the plain-C one (ATEN_CPU_CAPABILITY=default), as far as this CPU runs them: each row count 1-30 (full tiles and every remainder), a transposed b
    # (the panel path) too; compared with this process's kernel and with the reference
    # b three ways: in the kernel's layout (read in place, tiles in blocks of 60 rows: m up to 130), tight (its last
    # row not readable to 48 columns: copied panel by panel) and transposed (strided: panels); and a transposed a
    # (a weight gradient's g.t(): made row-major first) with b in place and strided
    ms = [*range(1, 31), 59, 61, 72, 130]
    cases = [_operands(seed, m, 37, 45, 3.0) for seed, m in enumerate(ms)]
    # a transposed a over more than one block of k (the blocked path: packed operands, each chain continued block
    # to block): full and partial tiles, a partial last block, several chunks of row tiles (m = 400)
    long = [_operands(100 + seed, m, k, 21, 3.0) for seed, (m, k) in enumerate([(1, 300), (12, 513), (13, 257),
                                                                               (400, 600)])]
    torch.save((cases, long), tmp_path / "cases.pt")
    script = (
        "import torch\n"
        "from driftless.ops import fixed_mm\n"
        "assert fixed_mm._native() is not None\n"
        f"cases, long = torch.load({str(tmp_path / 'cases.pt')!r})\n"
        "out = [[fixed_mm.fixed_order_mm(a, fixed_mm.gemm_layout(b)), fixed_mm.fixed_order_mm(a, b),\n"
        "        fixed_mm.fixed_order_mm(a, b.t().contiguous().t()),\n"
        "        fixed_mm.fixed_order_mm(a.t().contiguous().t(), fixed_mm.gemm_layout(b)),\n"
        "        fixed_mm.fixed_order_mm(a.t().contiguous().t(), b.t().contiguous().t())] for a, b in cases]\n"
        "torch.set_num_threads(2)\n"
        "out_long = [[fixed_mm.fixed_order_mm(a.t().contiguous().t(), b),\n"
        "             fixed_mm.fixed_order_mm(a.t().contiguous().t(), b.t().contiguous().t())] for a, b in long]\n"
        f"torch.save((out, out_long, fixed_mm._flags()), {str(tmp_path / 'out.pt')!r})\n"
    )
    env = {**os.environ, "ATEN_CPU_CAPABILITY": kernel_set, "XDG_CACHE_HOME": str(tmp_path / "cache")}
    env.pop(fixed_mm.ENV, None)
    subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, check=True)
    out, out_long, flags = torch.load(tmp_path / "out.pt")
    assert ("-mavx512f" in flags) == (kernel_set == "avx512")  # the build this kernel set asks for
    for (a, b), (c_layout, c_tight, c_strided, c_at, c_at_strided) in zip(cases, out, strict=True):
        c = fixed_order_mm_reference(a, b)
        assert torch.equal(c_layout, c) and torch.equal(c_tight, c) and torch.equal(c_strided, c)
        assert torch.equal(c_at, c) and torch.equal(c_at_strided, c)  # a transposed a (a weight gradient's g.t())
        assert torch.equal(fixed_order_mm(a, fixed_mm.gemm_layout(b)), c)
    for (a, b), (c_at, c_at_strided) in zip(long, out_long, strict=True):
        c = fixed_order_mm_reference(a, b)
        assert torch.equal(c_at, c) and torch.equal(c_at_strided, c)


@pytest.mark.parametrize("m,k", [(70, 200), (64, 128), (9, 130), (130, 9), (1, 70), (70, 600), (400, 257)])
def test_a_transposed_a_gives_the_bits_of_its_row_major_copy(m, k):
    """A weight gradient's ``g.t()`` (columns adjacent) is made row-major inside the kernel library, 8 x 8 register
    transposes in 64 x 64 blocks with scalar edges: several blocks each way, partial blocks, one row; batched too.
    Past 256 k steps it is packed block by block instead (the blocked path): k = 600 and 257 (a last block of one
    step), 400 rows (several chunks of row tiles), one and two threads."""
    a, b = _operands(m + k, m, k, 33, 3.0)
    wide = torch.zeros(k, m + 3)
    wide[:, 1:m + 1] = a.t()
    at = wide[:, 1:m + 1].t()  # rows adjacent, columns m + 3 apart (inside a wider matrix)
    assert at.stride() == (1, m + 3) and torch.equal(at, a)
    want = fixed_order_mm_reference(a, b)
    assert torch.equal(fixed_order_mm(at, b), want)
    batch = torch.stack([a, 2 * a]).transpose(1, 2).contiguous().transpose(1, 2)
    got = fixed_order_bmm(batch, torch.stack([b, b]))
    assert torch.equal(got[0], want) and torch.equal(got[1], fixed_order_mm_reference(2 * a, b))
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2 if before == 1 else 1)
        assert torch.equal(fixed_order_mm(at, b), want)
        assert torch.equal(fixed_order_mm(at[m // 3:], b), want[m // 3:])  # rows of another chunk and tile split
    finally:
        torch.set_num_threads(before)


def test_the_reference_can_be_chosen_and_a_bad_choice_is_refused_by_name(monkeypatch):
    a, b = _operands(3, 6, 40, 21, 3.0)
    native = fixed_order_mm(a, b)
    calls = []
    monkeypatch.setattr(fixed_mm, "fixed_order_mm_reference", lambda x, y: calls.append(1) or fixed_order_mm_reference(x, y))
    monkeypatch.setenv(fixed_mm.ENV, "reference")
    assert torch.equal(fixed_order_mm(a, b), native)
    assert calls == [1]  # the reference ran
    monkeypatch.setenv(fixed_mm.ENV, "fast")
    with pytest.raises(ValueError, match="DRIFTLESS_FIXED_MM must be 'native' or 'reference', got 'fast'"):
        fixed_order_mm(a, b)


def test_operands_are_read_in_place_or_padded_and_neighbouring_values_never_leak():
    # the kernel reads each row of b up to the next multiple of 16 columns: a view into a wider tensor
    # is read in place, its neighbouring columns (here inf and nan) computed and dropped
    a, wide = _operands(11, 13, 37, 40, 3.0)
    wide[:, 21:] = float("nan")
    wide[:, 30:] = float("inf")
    from driftless.ops.fixed_mm import fixed_order_bmm

    view = wide[:, :21]
    expect = fixed_order_mm_reference(a, view.contiguous())
    assert torch.equal(fixed_order_mm(a, view), expect)
    assert torch.equal(fixed_order_mm(a, view.contiguous()), expect)  # its last row cannot be read past N: copied
    assert torch.equal(fixed_order_mm(a.t().contiguous().t(), view), expect)  # a column-major a
    # transposed and batched views (attention's K^T and a cache's slots): copied into padded rows
    k = torch.randn(3, 50, 16)
    q = torch.randn(3, 7, 16)
    got = fixed_order_bmm(q, k[:, :29].transpose(1, 2))
    for i in range(3):
        assert torch.equal(got[i], fixed_order_mm_reference(q[i], k[i, :29].t().contiguous()))
    cache = torch.randn(2, 1, 64, 16)  # [B, Hkv, max_len, D]: the first 29 slots of each row
    v = cache[:, :, :29].reshape(2, 29, 16)
    p = torch.randn(2, 5, 29)
    got = fixed_order_bmm(p, v)
    for i in range(2):
        assert torch.equal(got[i], fixed_order_mm_reference(p[i], v[i].contiguous()))


def test_linear_weights_are_kept_in_padded_rows_of_an_odd_number_of_cache_lines():
    from driftless.ops.exact import linear_weight

    for n in (1, 16, 64, 320, 1024, 1000):
        w = torch.randn(n, 24)
        wt = linear_weight(w)
        assert torch.equal(wt, w.t()) and wt.stride(1) == 1
        assert wt.stride(0) % 16 == 0 and (wt.stride(0) // 16) % 2 == 1 and wt.stride(0) >= n
        x = torch.randn(5, 24)
        assert torch.equal(fixed_order_mm(x, wt), fixed_order_mm_reference(x, w.t().contiguous()))
