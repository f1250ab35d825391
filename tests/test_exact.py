"""The machine-independent kernels of aligned execution (driftless.ops.exact)."""

from __future__ import annotations

import math

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from driftless.ops.exact import (
    code_sum,
    exact_attention,
    exact_linear,
    exact_log_softmax,
    exact_sqrt,
    exp32,
    exp64,
    fixed_point,
    hidden_slots,
    log64,
    pow2,
    reduction_bits,
    snap,
)


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 10_000), b=st.integers(1, 4), t=st.integers(1, 10), extra=st.integers(1, 20),
       groups=st.sampled_from([1, 3]), scale=st.sampled_from([1e-3, 1.0, 30.0]))
def test_exact_attention_ignores_slots_it_cannot_see_and_other_rows(seed, b, t, extra, groups, scale):
    g = torch.Generator().manual_seed(seed)
    d, max_len = 16, 64
    positions = torch.randint(0, 8, (b,), generator=g)[:, None] + torch.arange(t)[None]
    span = int(positions.max()) + 1
    k, v = (torch.randn(b, 1, span + extra, d, generator=g) * scale for _ in range(2))
    q = torch.randn(b, groups, t, d, generator=g) * scale
    out = exact_attention(q, k[:, :, :span], v[:, :, :span], hidden_slots(positions, span, groups), max_len)
    # more slots (never visible to these queries, finite values) change no bit
    wide = exact_attention(q, k, v, hidden_slots(positions, span + extra, groups), max_len)
    assert torch.equal(out, wide)
    # a row alone gives its bits in the batch; so does its last query alone (a decode step)
    one = exact_attention(q[-1:], k[-1:, :, :span], v[-1:, :, :span], hidden_slots(positions[-1:], span, groups), max_len)
    assert torch.equal(one, out[-1:])
    last = exact_attention(q[:, :, -1:], k[:, :, :span], v[:, :, :span], hidden_slots(positions[:, -1:], span, groups),
                           max_len)
    assert torch.equal(last, out[:, :, -1:])
    # and it is attention: close to softmax(q kᵀ + mask) v in float64
    s64 = (q.double() @ k[:, :, :span].double().transpose(-1, -2)).masked_fill(
        torch.arange(span)[None, None, None, :] > positions[:, None, :, None], float("-inf"))
    ref = torch.softmax(s64, -1) @ v[:, :, :span].double()
    assert (out.double() - ref).abs().max() <= 1e-4 * (1 + ref.abs().max())


@settings(max_examples=40, deadline=None)
@given(bits=st.lists(st.integers(0, 0x7F7FFFFF), min_size=1, max_size=64))
def test_exact_sqrt_is_the_correctly_rounded_root(bits):
    """For every positive finite float32 (subnormals included), r = exact_sqrt(x) is the float32 nearest √x:
    x lies strictly between the squares of the midpoints to its neighbours, computed exactly in float64 (a
    midpoint has 25 significant bits, its square 50). torch.sqrt misses this on Intel's MKL branches."""
    x = torch.tensor(bits, dtype=torch.int32).view(torch.float32)
    x = torch.where(x > 0, x, torch.ones_like(x))
    r = exact_sqrt(x)
    up = torch.nextafter(r, torch.full_like(r, math.inf)).double()
    down = torch.nextafter(r, torch.zeros_like(r)).double()
    r64, x64 = r.double(), x.double()
    assert bool(((r64 + down) / 2 * ((r64 + down) / 2) < x64).all())
    assert bool((x64 < (r64 + up) / 2 * ((r64 + up) / 2)).all())
    assert torch.equal(exact_sqrt(x.double()).float(), r)  # float64's root rounded again: the same float32
    specials = torch.tensor([0.0, -0.0, math.inf, -1.0, math.nan])
    got = exact_sqrt(specials)
    assert got[0] == 0 and got[1] == 0 and math.copysign(1, got[1]) == -1 and got[2] == math.inf
    assert got[3].isnan() and got[4].isnan()
    assert torch.equal(exact_sqrt(torch.tensor(4.0, dtype=torch.bfloat16)), torch.tensor(2.0, dtype=torch.bfloat16))


def test_pow2_is_exact_over_the_whole_range():
    e = torch.arange(-1022, 1024)
    assert torch.equal(pow2(e), torch.tensor([math.ldexp(1.0, int(k)) for k in e], dtype=torch.float64))


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 10_000), rows=st.integers(1, 40), k=st.sampled_from([3, 64, 192, 512]),
       scale=st.sampled_from([1e-30, 1e-3, 1.0, 1e4]))
def test_exact_linear_rows_do_not_depend_on_their_neighbours_or_order(seed, rows, k, scale):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k, generator=g) * scale
    x[0, 0] = 0.0  # zeros and mixed magnitudes inside a row
    w = torch.randn(48, k, generator=g)
    full = exact_linear(x, w)
    perm = torch.randperm(rows, generator=g)
    assert torch.equal(exact_linear(x[perm], w), full[perm])
    assert torch.equal(exact_linear(x[-1:], w), full[-1:])
    # and close to the float64 product (fp32-level accuracy)
    ref = x.double() @ w.double().t()
    err = (full.double() - ref).abs().max() / (x.double().abs() @ w.double().abs().t()).max()
    assert float(err) < 1e-6


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 10_000), n=st.integers(1, 300))
def test_exact_sum_is_order_free(seed, n):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(3, n, generator=g, dtype=torch.float64) * torch.logspace(-5, 5, n, dtype=torch.float64)
    bits = reduction_bits(n)
    total = code_sum(x, bits)
    assert torch.equal(code_sum(x[:, torch.randperm(n, generator=g)], bits), total)
    assert torch.allclose(total[:, 0], x.sum(-1), rtol=1e-12, atol=1e-12 * float(x.abs().max()))


def test_codes_fit_their_bits():
    x = torch.tensor([[3.0, -1.0, 0.5], [0.0, 0.0, 0.0], [1e-40, 2e-40, -3e-40]])
    codes, _ = fixed_point(x, 20)
    assert codes.abs().max() <= 2**20
    assert torch.equal(codes[1], torch.zeros(3, dtype=torch.float64))
    s = snap(x, 20)
    assert torch.equal(s[0], x[0].double())  # few significant bits: represented exactly


def test_exp_and_log_match_the_reference_functions():
    z = torch.linspace(-87, 88, 200_001)
    rel = ((exp32(z).double() - torch.exp(z.double())) / torch.exp(z.double())).abs().max()
    assert float(rel) < 2 * 2.0**-24  # within 2 ulp of float32
    z64 = torch.linspace(-700, 700, 200_001, dtype=torch.float64)
    assert float(((exp64(z64) - torch.exp(z64)) / torch.exp(z64)).abs().max()) < 1e-11
    s = torch.logspace(-300, 300, 100_001, dtype=torch.float64)
    assert float((log64(s) - torch.log(s)).abs().max()) < 1e-12 * 700
    assert exp32(torch.tensor([float("-inf")])).item() == 0.0 and exp64(torch.tensor([float("-inf")])).item() == 0.0


def test_exact_log_softmax_values_and_gradient():
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(5, 64, generator=g) * 4).requires_grad_(True)
    x_masked = x.masked_fill(torch.arange(64) > 50, float("-inf"))
    out = exact_log_softmax(x_masked)
    ref = torch.log_softmax(x_masked.double(), -1)
    assert torch.equal(torch.isinf(out), torch.isinf(ref))
    finite = torch.isfinite(ref)
    assert float((out.detach().double() - ref.detach())[finite].abs().max()) < 1e-6
    w = torch.randn(5, 64, generator=g)
    (gx,) = torch.autograd.grad((torch.where(finite, out, 0.0) * w).sum(), x)
    x2 = x.detach().clone().requires_grad_(True)
    ref2 = torch.log_softmax(x2.masked_fill(torch.arange(64) > 50, float("-inf")), -1)
    (gr,) = torch.autograd.grad((torch.where(finite, ref2, 0.0) * w).sum(), x2)
    assert torch.allclose(gx, gr, atol=1e-5)
