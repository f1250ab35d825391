"""Reproducible training (train.reproducible): the same bits on every CPU kernel set and thread count.

The end-to-end proof runs a shrunk training (warm start included) under every kernel-set profile
this CPU can run (``ops.cpu``: scalar kernels with 1 thread, AVX2 with 1 thread, AVX-512 with 2,
as far as the CPU reports them) and compares every weight and every metric line, timings aside,
with ``torch.equal`` / ``==``. Below it: each rule of the dispatch mode and each exact backward
piece, as properties (order and composition independence, closeness to float64).
"""

from __future__ import annotations

import glob
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from driftless.ops import exact, reproducible
from driftless.ops.cpu import kernel_pairs, kernel_profile, runnable_kernel_sets
from driftless.ops.reproducible import NotReproducible, Reproducible
from driftless.train.optim import ExactAdamW, ExactSGD, one_cycle

REPO = Path(__file__).resolve().parents[1]
TIMING = ("tokens_per_s", "step_time", "wall_time")
SHRUNK = [  # the demo's setting (noise 0.3 view), shrunk: a small model, a short warm start, a few steps
    "model.execution=aligned", "train.reproducible=true", "task.name=arithmetic", "task.max_operand=4",
    "model.d_model=64", "model.n_layer=2", "model.n_head=2", "model.d_ff=128", "model.max_seq_len=32",
    "warm_start.steps=40", "warm_start.batch_size=16", "warm_start.eval_problems=16",
    "rollout.prompts_per_step=4", "rollout.group_size=4", "rollout.max_new_tokens=6", "rollout.head_k=8",
    "train.steps=5", "train.eval_every=2", "train.eval_problems=16", "train.checkpoint_every=5",
    "train.progress=false",
]
CASES = {
    "pg": ["objective.name=pg"],
    "sc+tis-ppo": ["objective.name=sc+tis", "objective.params={top_k: 8}", "train.ppo_epochs=2",
                   "train.minibatches=2"],
    "pg-row-draws": ["objective.name=pg", "rollout.draws=row"],  # each row its own stream (sharded generation)
}
needs_two_kernel_sets = pytest.mark.skipif(not kernel_pairs(), reason="this CPU runs one kernel set only")


def profiles() -> dict[str, dict[str, str]]:
    """Every kernel set this CPU runs: the lower ones with 1 thread, the reported one with 2."""
    sets = runnable_kernel_sets()
    return {s: kernel_profile(s, threads=2 if s == sets[-1] else 1, top=s == sets[-1]) for s in sets}


def train_in(profile: dict[str, str], run_dir: Path, extra: list[str]) -> Path:
    env = {**os.environ, **profile, "PYTHONHASHSEED": "0"}
    cmd = [sys.executable, "-m", "driftless", "train", str(REPO / "configs/demo.yaml"), *SHRUNK, *extra,
           f"warm_start.cache_dir={run_dir / 'warmstart'}", f"train.run_dir={run_dir / 'run'}"]
    done = subprocess.run(cmd, check=False, env=env, capture_output=True, text=True, timeout=600, cwd=REPO)
    assert done.returncode == 0, done.stderr[-3000:]
    return run_dir / "run"


def record(run: Path) -> tuple[list[dict], dict[str, torch.Tensor], dict]:
    from safetensors.torch import load_file

    lines = [{k: v for k, v in json.loads(line).items() if k not in TIMING and not k.endswith("_s")}
             for line in (run / "metrics.jsonl").read_text().splitlines()]
    weights = load_file(max(glob.glob(str(run / "checkpoints/*/model.safetensors"))))
    return lines, weights, json.loads((run / "initial_eval.json").read_text())


class _Runs(dict):
    """{case: {kernel set: record}}, each case trained under each profile when first asked for (a run of
    `make test` trains only the cases it tests)."""

    def __init__(self, tmp_path_factory):
        super().__init__()
        self.tmp = tmp_path_factory

    def __missing__(self, case):
        self[case] = {name: record(train_in(profile, self.tmp.mktemp(f"{case}-{name}"), CASES[case]))
                      for name, profile in profiles().items()}
        return self[case]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return _Runs(tmp_path_factory)


@needs_two_kernel_sets
# pg in `make test`; the PPO and row-draw cases (another minute of training per kernel set) in `make test-slow`
@pytest.mark.parametrize("case", [c if c == "pg" else pytest.param(c, marks=pytest.mark.slow) for c in CASES])
@pytest.mark.parametrize("pair", range(len(kernel_pairs())), ids=lambda i: "-vs-".join(
    p["ATEN_CPU_CAPABILITY"] for p in kernel_pairs()[i]))
def test_training_is_bitwise_the_same_on_every_kernel_set(runs, case, pair):
    a, b = (runs[case][p["ATEN_CPU_CAPABILITY"]] for p in kernel_pairs()[pair])
    lines_a, weights_a, start_a = a
    lines_b, weights_b, start_b = b
    assert start_a["warm_start"]["weights_sha256"] == start_b["warm_start"]["weights_sha256"]
    assert start_a["eval_reward"] == start_b["eval_reward"]
    assert len(lines_a) == len(lines_b) == 5
    for x, y in zip(lines_a, lines_b):
        assert x == y, {k: (x[k], y.get(k)) for k in x if x[k] != y.get(k)}
    assert weights_a.keys() == weights_b.keys()
    assert all(torch.equal(weights_a[k], weights_b[k]) for k in weights_a)
    # the run learned something to compare: gradients flowed and rewards varied
    assert any(line["grad_norm"] > 0 for line in lines_a)
    assert len({line["reward"] for line in lines_a}) > 1


def warm_start_digest_in(profile: dict[str, str], cache: Path) -> str:
    """The warm start as the sweep's driver makes it (`driftless demo`, before any trial): outside any run."""
    code = ("import sys, json; from driftless.train import load_config; "
            "from driftless.recipes.sweep import prepare_warm_starts; from driftless.train import build; "
            f"cfg = load_config({str(REPO / 'configs/demo.yaml')!r}, {[*SHRUNK, f'warm_start.cache_dir={cache}']!r}); "
            "prepare_warm_starts([cfg], progress=False); "
            "print(build.initial_state(cfg, progress=False)[1]['weights_sha256'])")
    env = {**os.environ, **profile, "PYTHONHASHSEED": "0"}
    done = subprocess.run([sys.executable, "-c", code], check=False, env=env, capture_output=True, text=True,
                          timeout=600, cwd=REPO)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout.split()[-1]


@needs_two_kernel_sets
def test_the_sweep_drivers_warm_start_is_the_runs_on_every_kernel_set(runs, tmp_path):
    """`driftless demo` warms up in its driver, outside any run: the same digest there as inside one."""
    inside = {start["warm_start"]["weights_sha256"] for _, _, start in runs["pg"].values()}
    outside = {warm_start_digest_in(p, tmp_path / name) for name, p in profiles().items()}
    assert outside == inside and len(inside) == 1


@needs_two_kernel_sets
def test_without_reproducible_the_same_training_differs_across_kernel_sets(tmp_path):
    """The control: the demo's fast execution, shrunk the same way, lands elsewhere under other kernels."""
    extra = ["model.execution=fast", "train.reproducible=false", "objective.name=pg"]
    low, high = kernel_pairs()[0]
    a, b = (record(train_in(p, tmp_path / name, extra)) for name, p in (("low", low), ("high", high)))
    assert a[2]["warm_start"]["weights_sha256"] != b[2]["warm_start"]["weights_sha256"]
    assert not all(torch.equal(a[1][k], b[1][k]) for k in a[1])


def test_a_reproducible_run_resumes_to_the_same_bits(tmp_path):
    """Stopped after a checkpoint and resumed, a reproducible run ends with the uninterrupted run's bits."""
    from driftless.train import load_config
    from driftless.train.loop import Run, train

    base = load_config(REPO / "configs/demo.yaml", [*SHRUNK, "train.steps=4", "train.checkpoint_every=2",
                                                    f"warm_start.cache_dir={tmp_path / 'ws'}"])
    whole = record(train(base, tmp_path / "whole", progress=False))
    half = load_config(REPO / "configs/demo.yaml", [*SHRUNK, "train.steps=4", "train.checkpoint_every=2",
                                                    f"warm_start.cache_dir={tmp_path / 'ws'}"])
    run = Run(half, tmp_path / "parts", progress=False)
    run.config.train.steps = 2
    run.run()
    run = Run(base, tmp_path / "parts", progress=False)
    resumed = record(run.run(resume=True))
    assert whole[0] == resumed[0]
    assert all(torch.equal(whole[1][k], resumed[1][k]) for k in whole[1])


# ---------------------------------------------------------------- refused by name
@pytest.mark.parametrize("overrides, named", [
    (["model.execution=fast"], "model.execution=aligned"),
    (["rollout.runtime=thread"], "rollout.runtime='thread'"),
    (["train.precision=bf16"], "train.precision"),
    (["model.kind=hf", "model.execution=fast"], "model.kind='hf'"),
])
def test_what_cannot_be_reproducible_is_refused_by_name(overrides, named):
    from driftless.train import load_config

    with pytest.raises(ValueError, match="train.reproducible=true") as err:
        load_config(None, ["train.reproducible=true", "model.execution=aligned", *overrides])
    assert named in str(err.value)


def test_an_operation_without_a_rule_is_refused_by_name():
    x = torch.randn(8)
    with Reproducible(), pytest.raises(NotReproducible, match="aten.cumsum"):
        torch.cumsum(x, 0)
    with Reproducible():
        assert torch.equal(torch.cumsum(torch.arange(5), 0), torch.tensor([0, 1, 3, 6, 10]))  # integers: exact


# ---------------------------------------------------------------- the rules, as properties
floats = st.floats(-1e6, 1e6, allow_nan=False, width=32)


@settings(max_examples=40, deadline=None)
@given(st.lists(floats, min_size=1, max_size=300), st.randoms(use_true_random=False))
def test_a_sum_is_the_same_bits_in_any_order_and_close_to_the_exact_sum(values, rnd):
    x = torch.tensor(values, dtype=torch.float32)
    order = list(range(len(values)))
    rnd.shuffle(order)
    with Reproducible():
        a, b = x.sum(), x[order].sum()
        mean = x.mean()
    assert torch.equal(a, b)
    assert float(a) == pytest.approx(math.fsum(float(v) for v in x), rel=1e-6, abs=1e-3)
    assert torch.equal(mean, (a.double() / len(values)).float()) or abs(float(mean) - float(a) / len(values)) <= \
        1e-6 * max(1.0, abs(float(mean)))


def _reductions(x):
    return {"sum": x.sum((0, 2), keepdim=True), "mean": x.mean(-1), "norm": torch.linalg.vector_norm(x, dim=1),
            "std": x.std(1), "var": x.var(0, correction=0), "lse": torch.logsumexp(x, -1),
            "softmax": torch.softmax(x, 1), "log_softmax": torch.log_softmax(x, -1), "sum64": x.sum(dtype=torch.float64)}


def test_reductions_keep_dims_and_dtypes_like_torch():
    x = torch.rand(3, 5, 7, generator=torch.Generator().manual_seed(0)) - 0.5
    with Reproducible():
        got = _reductions(x)
    for name, want in _reductions(x).items():
        assert got[name].shape == want.shape and got[name].dtype == want.dtype, name
        torch.testing.assert_close(got[name], want, rtol=2e-6, atol=1e-6, msg=name)


def _functions(x, pos):
    return {"exp": x.exp(), "sigmoid": torch.sigmoid(x), "expm1": torch.expm1(x / 30), "log": pos.log(),
            "log1p": torch.log1p(pos / 1e30), "rsqrt": pos.float().rsqrt(), "pow": x.abs() ** 1.7,
            "tanh": torch.tanh(x / 10), "sin": (x.double() * 3).sin(), "cos": (x.double() * 3).cos()}


def test_elementwise_functions_are_close_to_torch():
    x = torch.linspace(-30, 30, 2001)
    pos = torch.logspace(-40, 30, 2001, dtype=torch.float64)
    with Reproducible():
        got = _functions(x, pos)
    for name, want in _functions(x, pos).items():
        torch.testing.assert_close(got[name], want, rtol=3e-6 if want.dtype == torch.float32 else 1e-10,
                                   atol=1e-30 if name not in ("sin", "cos", "tanh") else 1e-12, msg=name)
    with Reproducible():
        special = torch.tensor([0.0, -1.0, float("inf"), float("nan"), 1e-310], dtype=torch.float64).log()
        big = torch.tensor([100.0, -200.0, float("nan")]).exp()
    assert special[0] == -math.inf and math.isnan(special[1]) and special[2] == math.inf and math.isnan(special[3])
    assert special[4] == pytest.approx(math.log(1e-310), rel=1e-12)
    assert big[0] == math.inf and big[1] == 0 and math.isnan(big[2])


def test_normal_draws_come_from_uniforms_and_are_standard_normal():
    g = torch.Generator().manual_seed(3)
    with Reproducible():
        z = torch.randn(200_000, generator=g)
        w = torch.empty(1000).normal_(2.0, 0.5, generator=torch.Generator().manual_seed(4))
    u = torch.rand(200_000, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    torch.testing.assert_close(z.double(), torch.special.ndtri(u + 2.0 ** -54), rtol=2e-7, atol=1e-8)
    assert abs(float(z.mean())) < 0.01 and abs(float(z.std()) - 1) < 0.01
    assert abs(float(w.mean()) - 2.0) < 0.05 and abs(float(w.std()) - 0.5) < 0.05


def test_categorical_draws_never_take_a_zero_probability_and_follow_the_weights():
    probs = torch.tensor([[0.0, 0.2, 0.0, 0.8], [1.0, 0.0, 0.0, 0.0]]).repeat(5000, 1)
    with Reproducible():
        draws = torch.multinomial(probs, 1, generator=torch.Generator().manual_seed(0))[:, 0]
    first, second = draws[0::2], draws[1::2]
    assert set(first.tolist()) <= {1, 3} and set(second.tolist()) == {0}
    assert abs(float((first == 3).float().mean()) - 0.8) < 0.02


def test_topk_and_sort_break_ties_by_index():
    x = torch.tensor([[1.0, 3.0, 3.0, 2.0, 3.0]])
    with Reproducible():
        values, ids = torch.topk(x, 3)
        _, order = torch.sort(x, descending=True)
    assert ids.tolist() == [[1, 2, 4]] and values.tolist() == [[3.0, 3.0, 3.0]]
    assert order.tolist() == [[1, 2, 4, 3, 0]]


def test_embedding_gradients_sum_repeated_tokens_exactly_in_any_order():
    g = torch.Generator().manual_seed(1)
    weight = torch.randn(10, 6, generator=g, requires_grad=True)
    ids = torch.randint(0, 10, (50,), generator=g)
    grad_out = torch.randn(50, 6, generator=g)
    order = torch.randperm(50, generator=g)
    with Reproducible():
        (a,) = torch.autograd.grad(torch.nn.functional.embedding(ids, weight), weight, grad_out)
        (b,) = torch.autograd.grad(torch.nn.functional.embedding(ids[order], weight), weight, grad_out[order])
    assert torch.equal(a, b)
    want = torch.zeros(10, 6, dtype=torch.float64).index_add_(0, ids, grad_out.double())
    torch.testing.assert_close(a.double(), want, rtol=1e-7, atol=1e-7)


def test_fused_multiply_adds_in_disguise_are_split():
    g = torch.Generator().manual_seed(2)
    a, b, c = (torch.randn(1000, generator=g) for _ in range(3))
    with Reproducible():
        got = {"add": torch.add(a, b, alpha=0.3), "addcmul": a.addcmul(b, c, value=0.7),
               "addcdiv": a.addcdiv(b, c.abs() + 1, value=0.7), "lerp": a.lerp(b, 0.25),
               "addmm": torch.addmm(a[:4], b[:8].reshape(4, 2), c[:8].reshape(2, 4), beta=0.5, alpha=2.0)}
    assert torch.equal(got["add"], a + b * 0.3)
    assert torch.equal(got["addcmul"], a + (b * c) * 0.7)
    assert torch.equal(got["addcdiv"], a + (b / (c.abs() + 1)) * 0.7)
    assert torch.equal(got["lerp"], a + (b - a) * 0.25)
    torch.testing.assert_close(got["addmm"], torch.addmm(a[:4], b[:8].reshape(4, 2), c[:8].reshape(2, 4), beta=0.5,
                                                          alpha=2.0))


# ---------------------------------------------------------------- the exact backward pieces
def _rows(n, d, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, d, generator=g)


@pytest.mark.parametrize("threads", [1, 2])
def test_rms_norm_and_silu_gradients_do_not_depend_on_batch_composition_or_threads(threads):
    x, grad = _rows(24, 32, 0), _rows(24, 32, 1)
    weight = 1 + 0.1 * _rows(1, 32, 2)[0]
    gate, up = _rows(24, 32, 3) * 3, _rows(24, 32, 4)
    order = torch.randperm(24, generator=torch.Generator().manual_seed(5))
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        gx, gw = exact.exact_rms_norm_grad.eager(x, weight, grad, 1e-5)
        gx2, gw2 = exact.exact_rms_norm_grad.eager(x[order], weight, grad[order], 1e-5)
        gx_one = torch.cat([exact.exact_rms_norm_grad.eager(x[i:i + 1], weight, grad[i:i + 1], 1e-5)[0]
                            for i in range(24)])
        sg, su = exact.exact_silu_mul_grad.eager(gate, up, grad)
        sg2, su2 = exact.exact_silu_mul_grad.eager(gate[order], up[order], grad[order])
    finally:
        torch.set_num_threads(before)
    assert torch.equal(gx[order], gx2) and torch.equal(gw, gw2) and torch.equal(gx, gx_one)
    assert torch.equal(sg[order], sg2) and torch.equal(su[order], su2)
    # close to float64 autograd
    x64, w64 = x.double().requires_grad_(), weight.double().requires_grad_()
    y = x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + 1e-5) * w64
    want_x, want_w = torch.autograd.grad(y, (x64, w64), grad.double())
    torch.testing.assert_close(gx.double(), want_x, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(gw.double(), want_w, rtol=1e-5, atol=1e-5)
    g64, u64 = gate.double().requires_grad_(), up.double().requires_grad_()
    want_g, want_u = torch.autograd.grad(torch.nn.functional.silu(g64) * u64, (g64, u64), grad.double())
    torch.testing.assert_close(sg.double(), want_g, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(su.double(), want_u, rtol=1e-5, atol=1e-5)


def test_attention_gradients_match_float64_and_do_not_depend_on_other_rows():
    g = torch.Generator().manual_seed(7)
    b, h, h_kv, t, d = 3, 4, 2, 9, 8
    q = torch.randn(b, h, t, d, generator=g) / math.sqrt(d)
    k, v = torch.randn(b, h_kv, t, d, generator=g), torch.randn(b, h_kv, t, d, generator=g)
    grad = torch.randn(b, h, t, d, generator=g)
    gq, gk, gv = exact.exact_causal_attention_grad(q, k, v, grad, max_len=32)
    one = exact.exact_causal_attention_grad(q[1:2], k[1:2], v[1:2], grad[1:2], max_len=32)
    assert torch.equal(gq[1:2], one[0]) and torch.equal(gk[1:2], one[1]) and torch.equal(gv[1:2], one[2])
    q64, k64, v64 = (x.double().requires_grad_() for x in (q, k, v))
    out = torch.nn.functional.scaled_dot_product_attention(q64, k64, v64, is_causal=True, scale=1.0, enable_gqa=True)
    want = torch.autograd.grad(out, (q64, k64, v64), grad.double())
    for got, ref in zip((gq, gk, gv), want):
        torch.testing.assert_close(got.double(), ref, rtol=1e-5, atol=1e-5)


def test_a_training_step_under_the_mode_is_close_to_float64_autograd():
    """The whole backward of an aligned TinyLM under the mode against float64 autograd of the same forward."""
    from driftless.models import TinyLM, TinyLMConfig

    cfg = TinyLMConfig(vocab_size=32, d_model=32, n_layer=2, n_head=2, n_kv_head=1, d_ff=64, max_seq_len=16)
    with Reproducible():
        model = TinyLM(cfg, execution="aligned")
        model.reset_parameters(seed=0)
        tokens = torch.randint(0, 32, (3, 12), generator=torch.Generator().manual_seed(1))
        loss = torch.log_softmax(model(tokens), -1)[..., 5].sum()
        grads = torch.autograd.grad(loss, list(model.parameters()))
    ref = TinyLM(cfg).double()
    ref.load_state_dict(model.state_dict())
    want = torch.autograd.grad(torch.log_softmax(ref(tokens), -1)[..., 5].sum(), list(ref.parameters()))
    for got, w in zip(grads, want):
        assert float((got.double() - w).norm() / w.norm()) < 1e-4


# ---------------------------------------------------------------- optimizers and schedules
def test_exact_adamw_and_sgd_follow_torchs_and_keep_its_state_layout():
    g = torch.Generator().manual_seed(0)
    start, grads = torch.randn(50, generator=g), [torch.randn(50, generator=g) for _ in range(5)]
    for exact_cls, torch_cls, kwargs in ((ExactAdamW, torch.optim.AdamW, {"betas": (0.9, 0.95), "weight_decay": 0.01}),
                                         (ExactSGD, torch.optim.SGD, {"weight_decay": 0.01})):
        mine, theirs = start.clone().requires_grad_(), start.clone().requires_grad_()
        opt_a, opt_b = exact_cls([mine], lr=1e-2, **kwargs), torch_cls([theirs], lr=1e-2, **kwargs)
        for grad in grads:
            mine.grad, theirs.grad = grad.clone(), grad.clone()
            with Reproducible():
                opt_a.step()
            opt_b.step()
        torch.testing.assert_close(mine, theirs, rtol=1e-6, atol=1e-7)
        if exact_cls is ExactAdamW:
            assert opt_a.state_dict()["state"][0].keys() == opt_b.state_dict()["state"][0].keys()
            opt_b.load_state_dict(opt_a.state_dict())


def test_one_cycle_is_torchs_learning_rate_schedule():
    param = torch.zeros(1, requires_grad=True)
    opt = torch.optim.SGD([param], lr=1.0)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=1.0, total_steps=300, pct_start=0.05, cycle_momentum=False)
    for step in range(300):
        assert opt.param_groups[0]["lr"] == pytest.approx(one_cycle(step, 300), rel=1e-12, abs=1e-15)
        opt.step()
        sched.step()


def test_the_mode_is_off_outside_its_block():
    with Reproducible():
        assert reproducible.active()
    assert not reproducible.active()
