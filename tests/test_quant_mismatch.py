"""Quantization formats, STEs, sampler views, trainer numerics and staleness."""

from __future__ import annotations

import pytest
import torch

from driftless.mismatch import SyncPolicy, WeightNoise, parse_view
from driftless.models import TinyLM, TinyLMConfig
from driftless.ops.numerics import Numerics, native_matmul
from driftless.ops.quant import QuantSpec, fake_quant, minifloat_qdq, qdq
from driftless.recipes.mismatch_table import measure_view


# ---------------------------------------------------------------- formats against torch's dtypes
@pytest.mark.parametrize("fmt,dtype", [("e4m3", torch.float8_e4m3fn), ("e5m2", torch.float8_e5m2)])
def test_minifloat_matches_torch_float8_casts(fmt, dtype):
    g = torch.Generator().manual_seed(0)
    x = torch.cat([torch.randn(20000, generator=g) * s for s in (1e-3, 0.1, 1, 30, 300)])
    x = x[x.abs() < (448 if fmt == "e4m3" else 57344)]
    assert torch.equal(minifloat_qdq(x, fmt), x.to(dtype).float())
    # every float8 value is a fixed point
    if fmt == "e4m3":
        codes = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
        codes = codes[torch.isfinite(codes)]
        assert torch.equal(minifloat_qdq(codes, fmt), codes)


def test_saturation():
    big = torch.tensor([460.0, 1000.0, -1e6])
    assert torch.equal(minifloat_qdq(big, "e4m3"), torch.tensor([448.0, 448.0, -448.0]))
    assert torch.equal(big.to(torch.float8_e4m3fn).float(), torch.tensor([448.0, 448.0, -448.0]))  # torch agrees
    # e5m2 saturates here (torch's cast overflows to inf; we document saturation)
    assert torch.equal(minifloat_qdq(torch.tensor([1e6]), "e5m2"), torch.tensor([57344.0]))
    assert torch.equal(minifloat_qdq(torch.tensor([7.0, -100.0]), "e2m1"), torch.tensor([6.0, -6.0]))


def test_fp4_e2m1_grid_and_ties_to_even():
    x = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 0.1, -1.25])
    # grid 0, .5, 1, 1.5, 2, 3, 4, 6: ties go to the even mantissa
    assert torch.equal(minifloat_qdq(x, "e2m1"), torch.tensor([0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 0.0, -1.0]))


def test_int_rounding_is_half_to_even_and_symmetric():
    x = torch.tensor([[127.0, 2.5, 3.5, -2.5, -0.5]])
    assert torch.equal(qdq(x, "int8"), torch.tensor([[127.0, 2.0, 4.0, -2.0, -0.0]]))
    y = torch.tensor([[7.0, -7.0, 3.5, 100.0]])  # int4 per row: scale 100/7
    out = qdq(y, "int4", "row")
    assert out.abs().max() <= 100.0 and len(set(torch.round(out / (100 / 7)).tolist()[0])) <= 4
    assert qdq(torch.zeros(2, 4), "int8", "row").abs().sum() == 0


def test_mx_block_scale_is_an_ocp_power_of_two():
    x = torch.zeros(2, 32)
    x[0, 0], x[0, 1] = 1.0, 0.3  # amax 1 -> scale 2^(0 - 2) for e2m1
    x[1, 0], x[1, 1] = 7.0, 0.5  # amax 7 -> scale 2^(2 - 2) = 1; 7 saturates to 6
    out = qdq(x, "mxfp4")
    assert out[0, 0] == 1.0 and out[0, 1] == 0.25
    assert out[1, 0] == 6.0 and out[1, 1] == 0.5
    # the scale is representable in torch's E8M0 dtype exactly
    scale = torch.tensor([0.25, 1.0])
    assert torch.equal(scale.to(torch.float8_e8m0fnu).float(), scale)
    big = torch.zeros(1, 32)
    big[0, 0] = 500.0  # mxfp8: floor(log2 500) = 8 -> scale 1, 500 saturates to 448
    assert qdq(big, "mxfp8")[0, 0] == 448.0


def test_nvfp4_uses_e4m3_block_scales_under_a_tensor_scale():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(4, 64, generator=g)
    out = qdq(x, "nvfp4")
    tensor_scale = x.abs().max() / (448 * 6)
    blocks_x, blocks_q = x.view(4, 4, 16), out.view(4, 4, 16)
    for b in range(4):
        for j in range(4):
            amax = blocks_x[b, j].abs().max()
            eff = minifloat_qdq(amax / 6 / tensor_scale, "e4m3") * tensor_scale
            elements = blocks_q[b, j] / eff
            assert torch.allclose(elements, minifloat_qdq(elements, "e2m1"), atol=1e-5)
    assert (out - x).abs().max() < x.abs().max() / 4


def test_group_granularity_and_bad_formats():
    x = torch.randn(3, 64)
    a = qdq(x, "int4", "group", 16)
    for j in range(4):  # each group of 16 has its own scale: same as quantizing it alone
        assert torch.equal(a[:, 16 * j:16 * (j + 1)], qdq(x[:, 16 * j:16 * (j + 1)], "int4", "row"))
    with pytest.raises(ValueError, match="does not divide"):
        qdq(x, "int4", "group", 24)
    with pytest.raises(ValueError, match="2–8"):
        qdq(x, "int9")
    with pytest.raises(ValueError, match="2–8"):
        qdq(x, "int1")
    with pytest.raises(ValueError, match="unknown quantization format 'fp6'"):
        qdq(x, "fp6")
    with pytest.raises(ValueError, match="multiple of 32"):
        qdq(torch.randn(2, 48), "mxfp4")
    with pytest.raises(ValueError, match="granularity"):
        QuantSpec("int8", "block")


def test_straight_through_estimators():
    x = torch.tensor([0.3, 100.0, 600.0, -700.0], requires_grad=True)
    y = fake_quant(x, "fp8_e4m3", "unit", ste="identity")
    assert torch.equal(y.detach(), minifloat_qdq(x.detach(), "e4m3"))
    (g,) = torch.autograd.grad(y.sum(), x)
    assert torch.equal(g, torch.ones(4))
    y = fake_quant(x, "fp8_e4m3", "unit", ste="clipped")
    (g,) = torch.autograd.grad(y.sum(), x)
    assert torch.equal(g, torch.tensor([1.0, 1.0, 0.0, 0.0]))  # zero outside the representable range


def test_per_token_scales_are_batch_invariant():
    g = torch.Generator().manual_seed(2)
    rows = torch.randn(9, 64, generator=g)
    spec = QuantSpec("int8", "row")
    alone = torch.stack([spec(r[None])[0] for r in rows])
    assert torch.equal(spec(rows), alone)
    tensor_spec = QuantSpec("int8", "tensor")  # a per-tensor dynamic scale depends on the batch
    assert not torch.equal(tensor_spec(rows)[0], tensor_spec(rows[:1])[0])


def test_native_matmul_is_exact_integer_accumulation():
    g = torch.Generator().manual_seed(3)
    x, w = torch.randn(5, 64, generator=g), torch.randn(7, 64, generator=g)
    spec = QuantSpec("int8", "row")
    out = native_matmul(x, w, spec, spec)
    sx = x.abs().amax(-1, keepdim=True) / 127
    sw = w.abs().amax(-1, keepdim=True) / 127
    cx = torch.round(x / sx).long()
    cw = torch.round(w / sw).long()
    exact = (cx @ cw.t()).double() * sx.double() * sw.double().t()
    assert torch.equal(out, exact.float())


def test_forward_backward_fake_quant_changes_only_the_gradient():
    model = TinyLM(TinyLMConfig(d_model=64, n_head=1, n_kv_head=1, d_ff=128, n_layer=1, max_seq_len=32))
    x = torch.randint(0, 64, (2, 10))
    view = parse_view("w8a8")

    def run(mode):
        model.zero_grad()
        model.numerics = view.quant.numerics.for_trainer(mode)
        out = model(x)
        out.square().mean().backward()
        return out.detach(), model.layers[0].wq.weight.grad.clone()

    v_b, g_b = run("fwd-fq")
    v_c, g_c = run("fwd-bwd-fq")
    assert torch.equal(v_b, v_c)
    assert not torch.equal(g_b, g_c) and torch.allclose(g_b, g_c, rtol=0.2, atol=1e-4)


# ---------------------------------------------------------------- views, severity, staleness
def test_view_parsing_and_bad_specs():
    v = parse_view("w8a8+kv:int4+noise:0.02@3")
    assert v.quant.weight == QuantSpec("int8", "row") and v.quant.kv == QuantSpec("int4", "row")
    assert v.describe().endswith("noise(0.02)")
    assert parse_view("none").views == []
    with pytest.raises(ValueError, match="unknown mismatch view 'w16'"):
        parse_view("w16")
    with pytest.raises(ValueError, match="noise scale must be >= 0"):
        parse_view("noise:-0.1")
    with pytest.raises(ValueError, match="twice"):
        parse_view("w8a8+w:int4")
    with pytest.raises(ValueError, match="native numerics need"):
        parse_view("kv:int8+native")


def test_weight_noise_is_drawn_once_per_run():
    model = TinyLM(TinyLMConfig(d_model=64, n_head=1, n_kv_head=1, d_ff=128, n_layer=1))
    base = {k: v.clone() for k, v in model.state_dict().items()}
    noise = WeightNoise(0.05, seed=1)
    noise.apply(model)
    first = {k: v.clone() for k, v in model.state_dict().items()}
    model.load_state_dict(base)
    noise.apply(model)
    for k, value in first.items():
        assert torch.equal(model.state_dict()[k], value)
    assert not torch.equal(first["layers.0.wq.weight"], base["layers.0.wq.weight"])


def test_staleness_policy():
    assert [SyncPolicy(0).should_refresh(s) for s in range(3)] == [True, True, True]
    assert [s for s in range(10) if SyncPolicy(3).should_refresh(s)] == [0, 4, 8]
    with pytest.raises(ValueError, match="staleness"):
        SyncPolicy(-1)


def test_measured_kl_grows_with_severity():
    config = TinyLMConfig(d_model=64, n_head=1, n_kv_head=1, d_ff=128, n_layer=2, init_std=0.1)
    base = TinyLM(config)
    base.reset_parameters(seed=0)
    state = base.state_dict()

    def make():
        m = TinyLM(config)
        m.load_state_dict(state)
        return m
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(2, 64, (5,), generator=g).tolist() for _ in range(16)]
    kl = {k: measure_view(make, k, prompts, max_new_tokens=16)["kl_k3"] for k in (
        "noise:0.01", "noise:0.02", "noise:0.05", "w:int8", "w:int4", "kv:int8", "kv:int4", "kv:fp8", "kv:fp4")}
    assert kl["noise:0.01"] < kl["noise:0.02"] < kl["noise:0.05"]
    assert kl["w:int8"] < kl["w:int4"]
    assert kl["kv:int8"] < kl["kv:int4"]
    assert kl["kv:fp8"] < kl["kv:fp4"]


def test_aligned_quantized_sampler_agrees_with_matching_trainer_forward():
    from driftless.recipes.alignment import run_check

    for view, numerics in (("w8a8+kv:int8", "fwd-fq"), ("w8a8-fp8+kv:fp4+native", "native"), ("dtype:bf16", "fwd-fq")):
        r = run_check(modes=("aligned+quant",), num_prompts=4, max_new_tokens=8, view=view, trainer_numerics=numerics)
        assert r["modes"]["aligned+quant"]["bitwise_equal_fraction"] == 1.0, view
    # and the fast path does not get there by itself
    r = run_check(modes=("fast+quant",), num_prompts=6, max_new_tokens=12)
    assert r["modes"]["fast+quant"]["max_abs_logp_diff"] > 0


def test_numerics_validation():
    with pytest.raises(ValueError, match="native numerics"):
        Numerics(weight=QuantSpec("mxfp4"), act=QuantSpec("int8", "row"), native=True)
    with pytest.raises(ValueError, match="trainer numerics"):
        Numerics().for_trainer("bf16")
