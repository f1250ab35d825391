"""Weights, reductions, advantages, chunked extraction and every bad input named in the issue."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from driftless.objectives import group_advantages, importance_weights, make, reduce_loss, shape_rewards
from driftless.ops import extract_logprobs, naive_logprobs
from driftless.ops.logprobs import linear_logprobs


# ---------------------------------------------------------------- importance_weights (verl semantics)
def test_importance_weights_levels_and_modes():
    target = torch.log(torch.tensor([[0.5, 0.2, 0.1, 0.9], [0.3, 0.3, 0.3, 0.3]]))
    sampler = torch.log(torch.tensor([[0.1, 0.2, 0.4, 0.9], [0.3, 0.6, 0.3, 0.3]]))
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]], dtype=torch.bool)
    tok = importance_weights(target, sampler, mask)
    assert torch.allclose(tok, torch.tensor([[5.0, 1.0, 0.25, 0.0], [1.0, 0.5, 0.0, 0.0]]))
    assert torch.allclose(importance_weights(target, sampler, mask, mode="truncate", upper=2.0),
                          torch.tensor([[2.0, 1.0, 0.25, 0.0], [1.0, 0.5, 0.0, 0.0]]))
    # mask keeps the ratio in band; lower defaults to 1/upper = 0.4
    assert torch.allclose(importance_weights(target, sampler, mask, mode="mask", upper=2.5),
                          torch.tensor([[0.0, 1.0, 0.0, 0.0], [1.0, 0.5, 0.0, 0.0]]))
    assert torch.allclose(importance_weights(target, sampler, mask, mode="reject", lower=0.2, upper=2.0),
                          torch.tensor([[0.0, 1.0, 1.0, 0.0], [1.0, 1.0, 0.0, 0.0]]))
    seq = importance_weights(target, sampler, mask, level="sequence")
    assert torch.allclose(seq, torch.tensor([[1.25] * 3 + [0.0], [0.5, 0.5, 0.0, 0.0]]))
    geo = importance_weights(target, sampler, mask, level="geometric")
    assert torch.allclose(geo[0, :3], torch.full((3,), 1.25 ** (1 / 3))) and geo[0, 3] == 0
    assert torch.allclose(geo[1, :2], torch.full((2,), 0.5 ** 0.5))
    assert not tok.requires_grad


def test_sequence_level_objectives_report_raw_sequence_ratios():
    lq = torch.log(torch.tensor([[0.5, 0.5], [0.5, 0.5]]))
    lp = torch.log(torch.tensor([[1.0, 1.0], [0.5, 0.25]]))  # sequence ratios 4 and 0.5
    batch = SimpleNamespace(sampler_logp=lq, action_mask=torch.ones(2, 2, dtype=torch.bool), advantage=torch.ones(2))
    _, m = make("tis", level="sequence")(SimpleNamespace(logp=lp), batch)
    assert m["sequence_ratio_max"] == pytest.approx(4.0) and m["sequence_ratio_min"] == pytest.approx(0.5)
    assert m["weight_max"] == pytest.approx(2.0) and m["truncated_fraction"] == pytest.approx(0.5)
    _, m = make("mis", level="geometric", lower=0.9, upper=1.5)(SimpleNamespace(logp=lp), batch)
    assert m["geometric_ratio_max"] == pytest.approx(2.0) and m["masked_fraction"] == pytest.approx(1.0)


def test_importance_weights_clamp_log_ratio():
    t = torch.tensor([[0.0]])
    s = torch.tensor([[-100.0]])
    w = importance_weights(t, s, torch.ones(1, 1))
    assert math.isclose(float(w), math.exp(20), rel_tol=1e-6)


@pytest.mark.parametrize("kwargs,match", [
    ({"mode": "truncate"}, "needs upper"),
    ({"mode": "clip", "upper": 2.0}, "mode must be"),
    ({"level": "seq"}, "level must be"),
    ({"mode": "mask", "lower": 3.0, "upper": 2.0}, "lower <= upper"),
])
def test_importance_weights_bad_arguments(kwargs, match):
    x = torch.zeros(1, 2)
    with pytest.raises(ValueError, match=match):
        importance_weights(x, x, torch.ones(1, 2), **kwargs)


# ---------------------------------------------------------------- reductions
def test_reductions_exact_values():
    loss = torch.tensor([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0], [9.0, 9.0, 9.0]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0], [0, 0, 0]])
    assert float(reduce_loss(loss, mask, "token-mean")) == pytest.approx(10 / 4)
    assert float(reduce_loss(loss, mask, "token-sum")) == pytest.approx(10)
    assert float(reduce_loss(loss, mask, "seq-mean-token-mean")) == pytest.approx((2 + 4) / 2)
    assert float(reduce_loss(loss, mask, "seq-mean-token-sum")) == pytest.approx((6 + 4) / 2)
    assert float(reduce_loss(loss, mask, "seq-mean-token-sum-norm")) == pytest.approx(10 / (3 * 3))
    with pytest.raises(ValueError, match="reduction must be"):
        reduce_loss(loss, mask, "mean")


def test_all_masked_batch_gives_zero_loss_with_a_graph():
    lp = torch.log(torch.full((2, 3), 0.3)).requires_grad_(True)
    batch = SimpleNamespace(sampler_logp=torch.log(torch.full((2, 3), 0.3)),
                            action_mask=torch.zeros(2, 3, dtype=torch.bool), advantage=torch.ones(2))
    for name in ("pg", "tis", "reinforce-zero", "ppo", "gspo"):
        loss, metrics = make(name)(SimpleNamespace(logp=lp), batch)
        assert float(loss.detach()) == 0.0 and metrics["all_masked"] == 1.0
        (g,) = torch.autograd.grad(loss, lp)
        assert torch.count_nonzero(g) == 0


# ---------------------------------------------------------------- advantages and reward modes
def test_group_advantages():
    reward = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 1.0])
    group = torch.tensor([0, 0, 0, 7, 7, 7])
    assert torch.allclose(group_advantages(reward, group), torch.tensor([2 / 3, -1 / 3, -1 / 3, 0, 0, 0]).double())
    std = math.sqrt(2 / 9)
    assert torch.allclose(group_advantages(reward, group, "grpo"),
                          torch.tensor([(2 / 3) / (std + 1e-6), (-1 / 3) / (std + 1e-6), (-1 / 3) / (std + 1e-6), 0, 0, 0]).double())
    assert torch.allclose(group_advantages(reward, group, "leave-one-out"),
                          torch.tensor([1.0, -0.5, -0.5, 0, 0, 0]).double())
    with pytest.raises(ValueError, match="estimator"):
        group_advantages(reward, group, "gae")
    with pytest.raises(ValueError, match="NaN"):
        group_advantages(torch.tensor([float("nan"), 1.0]), torch.tensor([0, 0]))


def test_reward_modes():
    success = torch.tensor([1.0, 0.0, 0.0, 0.0])
    group = torch.tensor([0, 0, 1, 1])
    assert torch.equal(shape_rewards(success, group, "+1/0"), success.double())
    assert torch.equal(shape_rewards(success, group, "±1"), torch.tensor([1.0, -1, -1, -1]).double())
    assert torch.equal(shape_rewards(success, group, "±1-centered"), torch.tensor([1.0, -1, 0, 0]).double())
    with pytest.raises(ValueError, match="reward_mode"):
        shape_rewards(success, group, "binary")


# ---------------------------------------------------------------- chunked extraction
@settings(max_examples=25, deadline=None)
@given(b=st.integers(1, 3), l=st.integers(1, 5), v=st.integers(2, 40), k=st.integers(0, 4),
       chunk=st.integers(1, 9), seed=st.integers(0, 1000))
def test_chunked_extraction_equals_naive(b, l, v, k, chunk, seed):
    g = torch.Generator().manual_seed(seed)
    k = min(k, v)
    logits = (3 * torch.randn(b, l, v, generator=g, dtype=torch.float64)).requires_grad_(True)
    tokens = torch.randint(0, v, (b, l), generator=g)
    head = torch.argsort(torch.rand(b, l, v, generator=g), -1)[..., :k] if k else None
    got = extract_logprobs(logits, tokens, head, chunk_rows=chunk)
    ref = naive_logprobs(logits, tokens, head)
    assert torch.allclose(got.logp, ref.logp, atol=1e-12)
    assert torch.allclose(got.entropy, ref.entropy, atol=1e-12)
    w1, w3 = torch.randn(b, l, generator=g, dtype=torch.float64), torch.randn(b, l, generator=g, dtype=torch.float64)
    out_got = (got.logp * w1).sum() + (got.entropy * w3).sum()
    out_ref = (ref.logp * w1).sum() + (ref.entropy * w3).sum()
    if k:
        assert torch.allclose(got.head_logp, ref.head_logp, atol=1e-12)
        w2 = torch.randn(b, l, k, generator=g, dtype=torch.float64)
        out_got = out_got + (got.head_logp * w2).sum()
        out_ref = out_ref + (ref.head_logp * w2).sum()
    (g1,) = torch.autograd.grad(out_got, logits)
    (g2,) = torch.autograd.grad(out_ref, logits)
    assert torch.allclose(g1, g2, atol=1e-10)


@settings(max_examples=25, deadline=None)
@given(n=st.integers(0, 11), v=st.integers(2, 30), d=st.integers(1, 6), k=st.integers(0, 4),
       chunk=st.integers(1, 12), scale=st.sampled_from([1.0, 1 / 0.7]), seed=st.integers(0, 1000))
def test_the_fused_output_layer_equals_the_full_logits_in_any_number_of_chunks(n, v, d, k, chunk, scale, seed):
    """``linear_logprobs(hidden, weight)`` (the output layer and the extraction chunk by chunk, the weight's gradient
    summed over the chunks in place) gives the values and the gradients of hidden and weight of the whole
    ``scale · hidden @ weight.T`` logits, in one chunk or in several, a partial last one and no rows included."""
    g = torch.Generator().manual_seed(seed)
    k = min(k, v)
    hidden = torch.randn(n, d, generator=g, dtype=torch.float64).requires_grad_(True)
    weight = torch.randn(v, d, generator=g, dtype=torch.float64).requires_grad_(True)
    tokens = torch.randint(0, v, (n,), generator=g)
    head = torch.argsort(torch.rand(n, v, generator=g), -1)[:, :k] if k else None
    got = linear_logprobs(hidden, weight, tokens, head, scale=scale, chunk_rows=chunk)
    ref = naive_logprobs((hidden @ weight.t() * scale)[None], tokens[None], None if head is None else head[None])
    w1, w3 = torch.randn(n, generator=g, dtype=torch.float64), torch.randn(n, generator=g, dtype=torch.float64)
    outs = []
    for view, logp, entropy in ((got, got.logp, got.entropy), (ref, ref.logp[0], ref.entropy[0])):
        out = (logp * w1).sum() + (entropy * w3).sum()
        if k:
            out = out + (view.head_logp.reshape(n, k) * torch.arange(1.0, k + 1, dtype=torch.float64)).sum()
        outs.append(out)
    assert torch.allclose(got.logp, ref.logp[0], atol=1e-12) and torch.allclose(got.entropy, ref.entropy[0], atol=1e-12)
    if k:
        assert torch.allclose(got.head_logp, ref.head_logp[0], atol=1e-12)
    grads = [torch.autograd.grad(out, (hidden, weight), allow_unused=True) for out in outs]
    for a, b in zip(*grads):
        b = torch.zeros_like(a) if b is None else b  # no rows: the reference's graph never reads them
        assert a.shape == b.shape and torch.allclose(a, b, atol=1e-10)


def test_the_fused_output_layers_backward_makes_one_vocabulary_sized_tensor_whatever_the_chunks():
    """Memory: the weight's gradient ``[V, D]`` is the only vocabulary-by-width tensor the backward makes (the first
    chunk's product; later chunks add into it in place), not a zero buffer plus a product per chunk; and under
    bf16 autocast (products in bf16, sums in fp32) the values stay those of the full logits to bf16's precision."""
    from torch.utils._python_dispatch import TorchDispatchMode

    v, d, n = 50, 8, 30
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(n, d, generator=g).requires_grad_(True)
    weight = torch.randn(v, d, generator=g).requires_grad_(True)
    tokens = torch.randint(0, v, (n,), generator=g)

    class Made(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.storages = set()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if isinstance(out, torch.Tensor) and tuple(out.shape) == (v, d):
                self.storages.add(out.untyped_storage().data_ptr())  # views (detach) share their base's
            return out

    out = linear_logprobs(hidden, weight, tokens, chunk_rows=7)  # 5 chunks
    made = Made()
    with made:
        out.logp.sum().backward()
    assert len(made.storages) == 1
    ref = naive_logprobs((hidden @ weight.t())[None].double(), tokens[None])
    want = torch.autograd.grad(ref.logp.sum(), weight)[0].double()
    assert torch.allclose(weight.grad.double(), want, atol=1e-5)
    weight.grad = None
    with torch.autocast("cpu", dtype=torch.bfloat16):
        low = linear_logprobs(hidden, weight, tokens, chunk_rows=7)
    low.logp.sum().backward()
    assert weight.grad.dtype == torch.float32
    assert torch.allclose(low.logp.double(), ref.logp[0], atol=0.1)
    assert torch.allclose(weight.grad.double(), want, atol=0.05 * float(want.abs().max()))


def test_extraction_bad_input():
    logits = torch.randn(1, 2, 5)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        extract_logprobs(logits, torch.tensor([[0, 5]]))
    with pytest.raises(ValueError, match="more than the vocabulary"):
        extract_logprobs(logits, torch.tensor([[0, 1]]), torch.zeros(1, 2, 6, dtype=torch.long))
    with pytest.raises(ValueError, match="token_ids must have shape"):
        extract_logprobs(logits, torch.tensor([0, 1]))


# ---------------------------------------------------------------- bad input to objectives
def base_batch():
    lq = torch.log(torch.tensor([[0.5, 0.25, 0.25]]))
    view = SimpleNamespace(logp=torch.log(torch.tensor([[0.4, 0.3, 0.2]])).requires_grad_(True),
                           head_logp=torch.log(torch.tensor([[[0.4, 0.3]] * 3])))
    batch = SimpleNamespace(sampler_logp=lq, action_mask=torch.ones(1, 3, dtype=torch.bool),
                            advantage=torch.ones(1), sampler_topk_logp=torch.log(torch.tensor([[[0.5, 0.25]] * 3])))
    return view, batch


def test_bad_inputs_name_the_field():
    view, batch = base_batch()
    bad = SimpleNamespace(**{**vars(batch), "sampler_logp": torch.zeros(1, 4)})
    with pytest.raises(ValueError, match="sampler_logp has shape"):
        make("pg")(view, bad)
    bad = SimpleNamespace(**{**vars(batch), "sampler_logp": torch.tensor([[-1.0, -float("inf"), -1.0]])})
    with pytest.raises(ValueError, match=r"sampler_logp is ±inf on an action token \(row 0, position 1\)"):
        make("is")(view, bad)
    bad = SimpleNamespace(**{**vars(batch), "sampler_logp": torch.tensor([[-1.0, float("nan"), -1.0]])})
    with pytest.raises(ValueError, match="NaN"):
        make("pg")(view, bad)
    nan_view = SimpleNamespace(logp=torch.tensor([[float("nan"), -1.0, -1.0]]), head_logp=view.head_logp)
    with pytest.raises(ValueError, match="trainer_view.logp holds NaN"):
        make("pg")(nan_view, batch)
    bad = SimpleNamespace(**{**vars(batch), "advantage": torch.tensor([float("inf")])})
    with pytest.raises(ValueError, match="advantage"):
        make("pg")(view, bad)
    bad = SimpleNamespace(**{**vars(batch), "advantage": torch.ones(2)})
    with pytest.raises(ValueError, match="advantage has 2 rows"):
        make("pg")(view, bad)
    missing = SimpleNamespace(sampler_logp=batch.sampler_logp, action_mask=batch.action_mask)
    with pytest.raises(ValueError, match="batch.advantage is required"):
        make("pg")(view, missing)
    # a head whose sampler mass exceeds 1 is not a distribution
    bad = SimpleNamespace(**{**vars(batch), "sampler_topk_logp": torch.log(torch.tensor([[[0.7, 0.6]] * 3]))})
    with pytest.raises(ValueError, match="head mass"):
        make("sc")(view, bad)
    no_head = SimpleNamespace(**{**vars(batch), "sampler_topk_logp": None})
    with pytest.raises(ValueError, match="sampler_topk_logp"):
        make("sc")(view, no_head)


def test_degenerate_trainer_tail_is_guarded():
    """Trainer head mass ≥ 1 (numerically): the tail ratio is clamped, never NaN."""
    view, batch = base_batch()
    view.head_logp = torch.log(torch.tensor([[[0.6, 0.4]] * 3])).requires_grad_(True)
    loss, metrics = make("sc+kl")(view, batch)
    assert torch.isfinite(loss) and math.isfinite(metrics["tail_ratio"]) and metrics["tail_ratio"] > 0
    grads = torch.autograd.grad(loss, [view.logp, view.head_logp])
    assert all(torch.isfinite(g).all() for g in grads)


def test_unknown_preset_and_parameter():
    with pytest.raises(ValueError, match="unknown objective preset 'grpo2'"):
        make("grpo2")
    with pytest.raises(ValueError, match="preset 'tis' has no parameter 'top_k'"):
        make("tis", top_k=4)
    with pytest.raises(ValueError, match="top_k must be"):
        make("sc", top_k=0)
    with pytest.raises(ValueError, match="cap must be"):
        make("tis", cap=-1.0)
    with pytest.raises(ValueError, match="variant"):
        make("icepop", variant="both")
