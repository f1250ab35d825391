"""Fused aligned pieces (ops.fuse): compiled by inductor, bitwise the eager definitions (torch.equal).

The rest of the suite runs aligned execution eager (tests/conftest.py); this file runs it compiled
and compares: each piece on random inputs, the model's forward / prefill / decode, the sampler,
and the cross-process check across the kernel sets this CPU reports (each process compiles for its
own ISA: inductor follows ATEN_CPU_CAPABILITY). A machine where compiling fails fails here.

Those comparisons compile for minutes with a cold inductor cache, so they carry the ``compiled``
marker: ``make test`` leaves them out, ``make test-compiled`` runs them, and CI (.ci/run) runs both.
The switch, fallback and cache-folder tests below run in ``make test``.
"""

from __future__ import annotations

import math
import platform
import warnings

import pytest
import torch
import torch._dynamo
from hypothesis import given, settings
from hypothesis import strategies as st

from driftless.models import TinyLM, TinyLMConfig
from driftless.ops import exact, fuse
from driftless.ops.cpu import describe_profile, kernel_pairs
from driftless.rollout import Sampler, SamplingParams, Snapshot


@pytest.fixture(autouse=True)
def fused():
    """Fusion on; a recompile limit hit raises (so a silent eager fallback cannot pass for the compiled path)."""
    fuse.set_fused(True)
    with torch._dynamo.config.patch(fail_on_recompile_limit_hit=True):
        yield
    fuse.set_fused(None)
    assert fuse.fusion_failure() is None, f"compiling the aligned pieces failed here: {fuse.fusion_failure()}"


def same(fn, *args, **kwargs):
    compiled, eager = fn(*args, **kwargs), fn.eager(*args, **kwargs)
    if isinstance(eager, tuple):
        return all(torch.equal(c, e) and c.dtype == e.dtype for c, e in zip(compiled, eager))
    return torch.equal(compiled, eager) and compiled.dtype == eager.dtype


def spread(shape, g, scale):
    """Values over many magnitudes, with zeros, ties and extremes in each row."""
    x = torch.randn(shape, generator=g) * torch.logspace(-3, 3, shape[-1]) * scale
    x[..., 0] = 0.0
    x[..., 1] = -x[..., 2]
    return x


@pytest.mark.compiled
@settings(max_examples=6, deadline=None)
@given(seed=st.integers(0, 10_000), rows=st.integers(1, 40), k=st.sampled_from([3, 64, 192]),
       scale=st.sampled_from([1e-20, 1.0, 1e4]))
def test_fused_linear_norm_silu_equal_eager(seed, rows, k, scale):
    g = torch.Generator().manual_seed(seed)
    x, w = spread((rows, k), g, scale), torch.randn(24, k, generator=g)
    # exact_linear runs eager (the kernel directly); inside a compiled graph it is the op: the same bits
    in_graph = torch.compile(lambda x, wt: exact.exact_linear(x, wt=wt) * 1.0, dynamic=True,
                             options=fuse.INDUCTOR_OPTIONS)
    assert torch.equal(in_graph(x, exact.linear_weight(w)), exact.exact_linear(x, w))
    assert same(exact.exact_rms_norm, x, torch.rand(k, generator=g) + 0.5, 1e-5)
    gate = spread((rows, k), g, scale * 30)  # SiLU's far tails: e^(−gate) under- and overflows
    assert same(exact.exact_silu_mul, gate, x)


@pytest.mark.compiled
@settings(max_examples=6, deadline=None)
@given(seed=st.integers(0, 10_000), b=st.integers(1, 4), t=st.integers(1, 12), span_extra=st.integers(0, 6),
       scale=st.sampled_from([1e-3, 1.0, 30.0]))
def test_fused_attention_equals_eager(seed, b, t, span_extra, scale):
    g = torch.Generator().manual_seed(seed)
    h, h_kv, d, max_len = 2, 1, 16, 64
    start = torch.randint(0, 8, (b,), generator=g)
    positions = start[:, None] + torch.arange(t)[None]
    span = int(positions.max()) + 1 + span_extra
    k, v = (torch.randn(b, h_kv, span, d, generator=g) * scale for _ in range(2))
    q = torch.randn(b, h, t, d, generator=g) * scale
    hidden = exact.hidden_slots(positions, span, h // h_kv)
    assert same(exact.exact_attention, q, k, v, hidden, max_len)


@pytest.mark.compiled
@settings(max_examples=6, deadline=None)
@given(seed=st.integers(0, 10_000), rows=st.integers(1, 30), v=st.sampled_from([2, 64, 151]),
       scale=st.sampled_from([1e-6, 1.0, 50.0]))
def test_fused_log_softmax_equals_eager(seed, rows, v, scale):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, v, generator=g) * scale
    x[0, : v // 2] = -math.inf  # filtered entries stay −inf
    assert same(exact._log_softmax_rows, x)
    # the public function runs any leading shape as rows of one 2-D matrix: a [B, L, V] gives its rows' values
    with fuse.unfused():
        eager = exact.exact_log_softmax_values(x)
    assert torch.equal(exact.exact_log_softmax_values(x), eager)
    batched = torch.stack([x, x.flip(0)]).transpose(0, 1)  # [rows, 2, V], not contiguous
    want = torch.stack([eager, eager.flip(0)]).transpose(0, 1)
    assert torch.equal(exact.exact_log_softmax_values(batched), want)


def pad(seqs, width):
    out = torch.zeros(len(seqs), width, dtype=torch.long)
    for i, s in enumerate(seqs):
        out[i, : len(s)] = torch.as_tensor(s)
    return out


@pytest.mark.compiled
def test_fused_model_equals_eager_in_forward_prefill_and_decode():
    config = TinyLMConfig()  # the size the cross-process checks compile for too (one set of graphs)
    model = TinyLM(config, execution="aligned")
    model.reset_parameters(seed=3)
    g = torch.Generator().manual_seed(5)
    seqs = [torch.randint(0, config.vocab_size, (int(n),), generator=g) for n in (9, 17, 4, 12)]
    width = max(len(s) for s in seqs)

    def run():
        with torch.no_grad():
            full = model(pad(seqs, width))
            cache = model.new_cache(len(seqs))
            split = torch.tensor([2, 5, 1, 3])
            pre = model.prefill(pad([s[:k] for s, k in zip(seqs, split)], int(split.max())), split, cache)
            steps = [model.decode(torch.stack([s[p] for s, p in zip(seqs, split + j)]), split + j, cache)
                     for j in range(3)]
        # the decode graphs write K/V into the cache in place: the slots themselves must agree too
        return full, pre, torch.stack(steps), torch.stack(cache.k), torch.stack(cache.v)

    compiled = run()
    fuse.set_fused(False)
    eager = run()
    fuse.set_fused(True)
    for c, e in zip(compiled, eager):
        assert torch.equal(c, e)


@pytest.mark.compiled
def test_fused_sampler_records_the_eager_batch():
    model = TinyLM(TinyLMConfig(), execution="aligned")
    model.reset_parameters(seed=1)
    params = SamplingParams(temperature=0.8, top_k=20, top_p=0.9)
    prompts = [[3, 4, 5], [7], [9, 10, 11, 12, 13]]

    def sample():
        sampler = Sampler(model, head_k=8)
        sampler.load(Snapshot.of(model, 0))
        return sampler.generate(prompts, params, 10, seed=2)

    compiled = sample()
    fuse.set_fused(False)
    eager = sample()
    fuse.set_fused(True)
    for name in ("tokens", "sampler_logp", "sampler_topk_ids", "sampler_topk_logp", "action_mask"):
        assert torch.equal(getattr(compiled, name), getattr(eager, name)), name


# One pair: two compiled ISAs where this CPU has two vector kernel sets (avx2 vs avx512), else the first
# pair (eager scalar kernels vs compiled vector code). Each side compiles in a fresh process: ~1 min.
PAIRS = [p for p in kernel_pairs() if "default" not in (p[0]["ATEN_CPU_CAPABILITY"], p[1]["ATEN_CPU_CAPABILITY"])][:1] \
    or list(kernel_pairs()[:1])


@pytest.mark.compiled
@pytest.mark.skipif(not PAIRS, reason="this CPU runs one kernel set only: no pair to compare")
@pytest.mark.parametrize("pair", PAIRS, ids=[f"{s['ATEN_CPU_CAPABILITY']}-vs-{t['ATEN_CPU_CAPABILITY']}"
                                             for s, t in PAIRS])
def test_fused_sampler_and_trainer_agree_across_processes_and_kernel_sets(tmp_path, pair):
    """Sampler and trainer processes each run the fused pieces for the ISA their kernel set names; bit for bit."""
    from driftless.recipes.alignment import cross_process_check

    model = TinyLM(TinyLMConfig())
    model.reset_parameters(seed=4)
    envs = tuple({**env, fuse.ENV: "1"} for env in pair)
    prompts = [[3, 4, 5], [6, 7], [8, 9, 10, 11], [12], [13, 14, 15]]
    r = cross_process_check(model, prompts, params=SamplingParams(), max_new_tokens=10, seed=1, envs=envs,
                            workdir=tmp_path)
    assert r["tokens"] > 30
    assert r["bitwise_equal_fraction"] == 1.0 and r["max_abs_logp_diff"] == 0.0
    # scalar kernels ("default") run eager (inductor cannot build without a vector ISA): that pair compares
    # eager scalar code with compiled vector code; avx2 vs avx512 compares two compiled ISAs
    sides = ("sampler_process", "trainer_process")
    for side, env in zip(sides, pair):
        wanted = env["ATEN_CPU_CAPABILITY"] != "default"
        assert r[side]["fused"] is wanted, f"{side} ({describe_profile(r[side])}): fused {r[side]['fused']}"
    if all(r[side]["fused"] for side in sides):
        assert r["sampler_process"]["inductor_isa"] != r["trainer_process"]["inductor_isa"]


def test_a_failed_build_falls_back_to_eager_with_one_warning(monkeypatch):
    calls = []

    def broken_compile(fn, **kwargs):
        def run(*args, **kw):
            calls.append(1)
            raise RuntimeError("no C++ compiler\nmore detail")
        return run

    monkeypatch.setattr(torch, "compile", broken_compile)
    fn = fuse.fused(lambda x: x * 3.0 + 1.0)
    x = torch.randn(5)
    with pytest.warns(RuntimeWarning, match=r"fused aligned kernels unavailable here \(RuntimeError: no C\+\+ compiler\)"):
        out = fn(x)
    assert torch.equal(out, x * 3.0 + 1.0)
    assert fuse.fusion_failure() == "RuntimeError: no C++ compiler" and not fuse.fused_enabled()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once only: later calls run eager silently
        assert torch.equal(fn(x), x * 3.0 + 1.0)
    assert calls == [1]
    fuse._broken = None  # leave the module as other tests expect it


def test_the_first_compiled_call_is_checked_against_the_definition(monkeypatch):
    # the start-up self-test runs eager: the compiled code this machine's compiler built is compared here, once per
    # function, and a difference means eager from then on (warned once), the definition's bits returned
    eager_calls = []

    def definition(x):
        eager_calls.append(1)
        return x * 3.0 + 1.0

    monkeypatch.setattr(torch, "compile", lambda fn, **kwargs: lambda x: x * 3.0 + 1.0)  # a correct build
    fn = fuse.fused(definition)
    x = torch.randn(5)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert torch.equal(fn(x), x * 3.0 + 1.0) and torch.equal(fn(x), x * 3.0 + 1.0)
    assert eager_calls == [1]  # the first call only
    monkeypatch.setattr(torch, "compile", lambda fn, **kwargs: lambda x: x * 3.0 + 1.0 + 1e-6)  # a wrong one
    fn = fuse.fused(definition)
    with pytest.warns(RuntimeWarning, match="definition: its compiled output differs from its eager definition"):
        assert torch.equal(fn(x), x * 3.0 + 1.0)
    assert not fuse.fused_enabled()
    fuse._broken = None  # leave the module as other tests expect it


def test_unfused_is_this_threads_alone(monkeypatch):
    import threading

    fuse.set_fused(True)
    seen = {}
    with fuse.unfused():
        other = threading.Thread(target=lambda: seen.update(other=fuse.fused_enabled()))
        other.start()
        other.join()
        seen["here"] = fuse.fused_enabled()
        with fuse.unfused():
            pass
        seen["nested"] = fuse.fused_enabled()
    assert seen == {"other": True, "here": False, "nested": False} and fuse.fused_enabled()


def test_an_input_error_propagates_and_does_not_disable_fusion(monkeypatch):
    fn = fuse.fused(lambda a, b: a @ b)
    with pytest.raises(RuntimeError, match="cannot be multiplied|size mismatch|shapes"):
        fn(torch.randn(2, 3), torch.randn(4, 5))
    assert fuse.fusion_failure() is None and fuse.fused_enabled()


def test_the_switch_is_checked_by_name(monkeypatch):
    fuse.set_fused(None)
    monkeypatch.setenv(fuse.ENV, "yes")
    with pytest.raises(ValueError, match="DRIFTLESS_FUSED_ALIGNED must be 0 or 1, got 'yes'"):
        fuse.fused_enabled()
    monkeypatch.setenv(fuse.ENV, "0")
    assert not fuse.fused_enabled()
    with pytest.raises(ValueError, match="set_fused takes True, False or None"):
        fuse.set_fused("on")
    fuse.set_fused(True)


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="the folder's name reads x86 extensions")
def test_each_kernel_set_gets_its_own_inductor_cache(monkeypatch, tmp_path):
    """Inductor's cache key does not tell kernel sets apart: a library built for one ISA, loaded under
    another, gave wrong values here. Each kernel set (and set of vector extensions) compiles into a folder of its
    own under the user's, named without building inductor's ISA probes (those then land in the folder, where the
    processes started from this one find them: about 8 s of each demo worker's start when cold)."""
    import os

    import torch._inductor.cpu_vec_isa as vec_isa

    def no_probe():
        raise AssertionError("the folder was named by building inductor's ISA probes")

    monkeypatch.setattr(vec_isa, "pick_vec_isa", no_probe)
    dirs = set()
    for capability, extensions in (("AVX2", ["avx2"]), ("AVX512", ["avx2", "avx512"]), ("AVX2", ["avx2", "avx512"])):
        monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
        monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda c=capability: c)
        monkeypatch.setattr(vec_isa, "x86_isa_checker", lambda e=extensions: e)
        fuse._cache_per_kernel_set()
        path = os.environ["TORCHINDUCTOR_CACHE_DIR"]
        assert os.path.dirname(path) == str(tmp_path) and capability.lower() in os.path.basename(path)
        fuse._cache_per_kernel_set()  # idempotent: no folder inside the folder
        assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == path
        dirs.add(path)
    assert len(dirs) == 3


@pytest.mark.compiled
def test_a_piece_compiles_one_graph_for_flagged_plain_and_unequal_inputs():
    """A piece called where grad is off with inputs that require grad (a custom Function's forward) compiles the graph
    that plain inputs (evaluation) use, and sizes equal at the first call (a batch of 64 rows, a head of 64) are not
    assumed equal after: each of these compiled the piece again, a cold compile of seconds in every demo process."""
    from torch._dynamo.utils import counters

    def scaled_exp(x, y):
        return exact.exp32(x) * y

    piece = fuse.fused(scaled_exp)
    before = counters["stats"]["unique_graphs"]
    a, b = torch.randn(64, 64, requires_grad=True), torch.randn(64, 64, requires_grad=True)
    with torch.no_grad():
        out = piece(a, b)
    assert not out.requires_grad and torch.equal(out, scaled_exp(a.detach(), b.detach()))
    for rows in (64, 40):
        x, y = torch.randn(rows, 64), torch.randn(rows, 64)
        assert torch.equal(piece(x, y), scaled_exp(x, y))
    assert counters["stats"]["unique_graphs"] - before == 1


@pytest.mark.compiled
def test_a_library_compiled_at_one_thread_count_serves_every_other(tmp_path):
    """Inductor's kernels read the thread count when they run (``cpp.dynamic_threads``): the demo's warm start
    (2 threads) compiles what its 1-thread runs then load from the cache instead of compiling it again; the
    values are the same at both counts (elementwise chains and reductions exact in any order)."""
    import os
    import subprocess
    import sys

    script = (
        "import sys, torch\n"
        "torch.set_num_threads(int(sys.argv[1]))\n"
        "from torch._dynamo.utils import counters\n"
        "from driftless.ops import exact\n"
        "g = torch.Generator().manual_seed(0)\n"
        "x = torch.randn(4000, 151, generator=g) * 30\n"
        "w, grad = torch.randn(8, generator=g), torch.randn(20000, 8, generator=g)\n"
        "y = (exact.exact_log_softmax_values(x), *exact.exact_rms_norm_grad(torch.randn(20000, 8, generator=g), w, grad, 1e-5))\n"
        "torch.save(y, sys.argv[2])\n"
        "print(counters['inductor']['fxgraph_cache_miss'], counters['inductor']['fxgraph_cache_hit'])\n"
    )
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor")}
    env.pop("DRIFTLESS_FUSED_ALIGNED", None)
    counts = []
    for threads in (2, 1):
        done = subprocess.run([sys.executable, "-c", script, str(threads), str(tmp_path / f"y{threads}.pt")],
                              env=env, capture_output=True, text=True, check=True)
        counts.append([int(v) for v in done.stdout.split()[-2:]])
    assert counts[0][0] >= 2  # compiled at 2 threads
    assert counts[1] == [0, counts[0][0] + counts[0][1]]  # every graph found in the cache at 1 thread
    # ... and the same values: rms_norm_grad's weight gradient is a sum over 20 000 rows, split by thread
    assert all(torch.equal(a, b) for a, b in zip(torch.load(tmp_path / "y1.pt"), torch.load(tmp_path / "y2.pt"), strict=True))
