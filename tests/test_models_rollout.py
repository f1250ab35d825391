"""TinyLM, the sampler and trainer–inference invariance (torch.equal for every bitwise claim)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest
import torch

from driftless.models import TinyLM, TinyLMConfig, load_model, save_model
from driftless.models.selftest import AlignmentError, ensure_aligned, invariance_failures
from driftless.ops.cpu import describe_profile, kernel_pairs, runnable_kernel_sets
from driftless.rollout import RolloutBatch, Sampler, SamplingParams, Snapshot, sampling_logprobs, score_batch

SMALL = TinyLMConfig(vocab_size=64, d_model=64, n_layer=2, n_head=1, n_kv_head=1, d_ff=128, max_seq_len=64)


def make_model(execution="aligned", config=SMALL, seed=0):
    m = TinyLM(config, execution=execution)
    m.reset_parameters(seed=seed)
    return m


def pad(seqs, width):
    out = torch.zeros(len(seqs), width, dtype=torch.long)
    for i, s in enumerate(seqs):
        out[i, : len(s)] = torch.as_tensor(s)
    return out


def random_seqs(n, vocab=64, seed=0, lo=1, hi=30):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (int(k),), generator=g) for k in torch.randint(lo, hi, (n,), generator=g)]


# ---------------------------------------------------------------- aligned forward: bitwise
@pytest.mark.parametrize("config", [SMALL, TinyLMConfig()], ids=["small", "default"])
def test_aligned_full_forward_is_batch_and_padding_invariant(config):
    model = make_model(config=config)
    seqs = random_seqs(6, seed=1)
    with torch.no_grad():
        alone = [model(s[None])[0] for s in seqs]
        width = max(len(s) for s in seqs)
        for extra in (0, 5):
            together = model(pad(seqs, width + extra))
            for i, s in enumerate(seqs):
                assert torch.equal(together[i, : len(s)], alone[i])
        # a different batch composition: reversed order, duplicated rows
        mixed = seqs[::-1] + seqs[:2]
        out = model(pad(mixed, width))
        for i, s in enumerate(mixed):
            assert torch.equal(out[i, : len(s)], model(s[None])[0])


def test_aligned_prefill_plus_decode_equals_one_full_forward():
    model = make_model()
    seqs = random_seqs(4, seed=2, lo=14, hi=20)
    split = torch.tensor([1, 3, 5, 7])
    with torch.no_grad():
        full = [model(s[None])[0] for s in seqs]
        cache = model.new_cache(len(seqs))
        pre = model.prefill(pad([s[:k] for s, k in zip(seqs, split)], int(split.max())), split, cache)
        for i, k in enumerate(split):
            assert torch.equal(pre[i, :k], full[i][:k])
        pos = split.clone()
        for _ in range(6):
            feed = torch.stack([s[p] for s, p in zip(seqs, pos)])
            step = model.decode(feed, pos, cache)
            for i, s in enumerate(seqs):
                assert torch.equal(step[i], full[i][pos[i]])
            pos = pos + 1


def test_fast_mode_shows_the_real_mismatch():
    """The plain path differs by batch shape: this is what aligned mode removes."""
    model = make_model("fast", TinyLMConfig())
    seqs = random_seqs(6, seed=1)
    with torch.no_grad():
        together = model(pad(seqs, max(len(s) for s in seqs)))
        diffs = [float((together[i, : len(s)] - model(s[None])[0]).abs().max()) for i, s in enumerate(seqs)]
    assert max(diffs) > 0


THREAD_SCRIPT = textwrap.dedent("""
    import sys, torch
    torch.set_num_threads(int(sys.argv[1]))
    from driftless.models import TinyLM, TinyLMConfig
    m = TinyLM(TinyLMConfig(), execution="aligned"); m.reset_parameters(seed=5)
    g = torch.Generator().manual_seed(3)
    x = torch.randint(0, 64, (5, 40), generator=g)
    with torch.no_grad():
        full = m(x)
        cache = m.new_cache(5)
        m.prefill(x[:, :10], torch.full((5,), 10), cache)
        steps = torch.stack([m.decode(x[:, t], torch.full((5,), t), cache) for t in range(10, 40)], 1)
    torch.save({"full": full, "steps": steps}, sys.argv[2])
""")


def test_aligned_is_invariant_to_thread_count(tmp_path):
    outs = []
    for threads in (1, 2, 4):  # 4 oversubscribes a 2-core machine
        path = tmp_path / f"t{threads}.pt"
        subprocess.run([sys.executable, "-c", THREAD_SCRIPT, str(threads), str(path)], check=True)
        outs.append(torch.load(path))
    for other in outs[1:]:
        assert torch.equal(outs[0]["full"], other["full"])
        assert torch.equal(outs[0]["steps"], other["steps"])
    assert torch.equal(outs[0]["steps"], outs[0]["full"][:, 10:40])


# Pairs of (sampler, trainer) process profiles taken from what this CPU reports: never a kernel set it lacks.
KERNEL_PAIRS = kernel_pairs()
PAIR_IDS = [f"{s['ATEN_CPU_CAPABILITY']}-vs-{t['ATEN_CPU_CAPABILITY']}" for s, t in KERNEL_PAIRS]
needs_two_kernel_sets = pytest.mark.skipif(not KERNEL_PAIRS, reason=f"this CPU runs one kernel set only "
                                           f"({runnable_kernel_sets()}): no pair of kernels to compare")


def test_kernel_pairs_are_runnable_here_and_differ():
    sets = runnable_kernel_sets()
    assert sets[0] == "default"
    for sampler, trainer in KERNEL_PAIRS:
        assert sampler["ATEN_CPU_CAPABILITY"] in sets and trainer["ATEN_CPU_CAPABILITY"] in sets
        assert sampler["ATEN_CPU_CAPABILITY"] != trainer["ATEN_CPU_CAPABILITY"]
        assert sampler["OMP_NUM_THREADS"] != trainer["OMP_NUM_THREADS"]
    if "avx512" not in sets:
        assert all("avx512" not in (s["ATEN_CPU_CAPABILITY"], t["ATEN_CPU_CAPABILITY"]) for s, t in KERNEL_PAIRS)


def test_a_kernel_set_the_cpu_lacks_is_refused_before_any_process(tmp_path, monkeypatch):
    from driftless.ops import cpu
    from driftless.recipes.alignment import cross_process_check

    monkeypatch.setattr(cpu, "reported_kernel_set", lambda: "avx2")  # as on an AVX2-only machine
    model = make_model("fast", TinyLMConfig(), seed=4)
    envs = ({"ATEN_CPU_CAPABILITY": "avx2"}, {"ATEN_CPU_CAPABILITY": "avx512"})
    with pytest.raises(ValueError, match="ATEN_CPU_CAPABILITY='avx512' cannot run on this CPU"):
        cross_process_check(model, [[3, 4]], params=SamplingParams(), max_new_tokens=2, seed=1, envs=envs,
                            workdir=tmp_path)
    assert [p[1]["ATEN_CPU_CAPABILITY"] for p in cpu.kernel_pairs()] == ["avx2"]  # scalar vs AVX2 only


@needs_two_kernel_sets
@pytest.mark.parametrize("pair", KERNEL_PAIRS, ids=PAIR_IDS)
@pytest.mark.parametrize("params", [SamplingParams(), SamplingParams(temperature=0.8, top_k=20, top_p=0.9)],
                         ids=["plain", "filtered"])
def test_aligned_sampler_and_trainer_agree_across_processes_and_cpu_kernels(tmp_path, params, pair):
    """Sampler and trainer in two processes with other kernel sets (each one this CPU reports), MKL
    branches and thread counts. Bit for bit."""
    from driftless.recipes.alignment import cross_process_check

    model = make_model("fast", TinyLMConfig(), seed=4)
    prompts = [s.tolist() for s in random_seqs(5, seed=2, lo=2, hi=9)]
    r = cross_process_check(model, prompts, params=params, max_new_tokens=12, seed=1, envs=pair, workdir=tmp_path)
    assert r["tokens"] > 40
    assert r["bitwise_equal_fraction"] == 1.0 and r["max_abs_logp_diff"] == 0.0
    # the processes really ran the kernels asked for
    assert r["sampler_process"]["cpu_capability"].lower() == pair[0]["ATEN_CPU_CAPABILITY"]
    assert r["trainer_process"]["cpu_capability"].lower() == pair[1]["ATEN_CPU_CAPABILITY"]
    assert r["sampler_process"]["threads"] == 1 and r["trainer_process"]["threads"] == 2


@needs_two_kernel_sets
def test_fast_mode_differs_across_cpu_kernels(tmp_path):
    """Control for the test above: without aligned execution, other kernels give other bits
    (the first pair: scalar kernels against the best set this CPU runs)."""
    from driftless.recipes.alignment import cross_process_check

    model = make_model("fast", TinyLMConfig(), seed=4)
    prompts = [s.tolist() for s in random_seqs(5, seed=2, lo=2, hi=9)]
    r = cross_process_check(model, prompts, params=SamplingParams(), max_new_tokens=12, seed=1,
                            execution="fast", envs=KERNEL_PAIRS[0], workdir=tmp_path)
    assert r["bitwise_equal_fraction"] < 1.0


@needs_two_kernel_sets
def test_check_alignment_names_the_kernel_pairs_it_compared(capsys):
    from driftless.cli import main

    assert main(["check-alignment", "--modes", "aligned-xproc", "--prompts", "3", "rollout.max_new_tokens=4"]) == 0
    out = capsys.readouterr().out
    for sampler, trainer in KERNEL_PAIRS:
        assert f"sampler ({describe_profile(sampler)}) vs trainer ({describe_profile(trainer)})" in out
    assert "bitwise equal 1.0000" in out


# ---------------------------------------------------------------- sampler records q honestly
@pytest.mark.parametrize("params", [SamplingParams(), SamplingParams(temperature=0.7, top_k=10),
                                    SamplingParams(top_p=0.8), SamplingParams(temperature=1.3, top_k=20, top_p=0.9),
                                    SamplingParams(greedy=True)], ids=["plain", "topk", "topp", "all", "greedy"])
def test_sampler_and_trainer_agree_bitwise_in_aligned_mode(params):
    trainer = make_model()
    sampler = Sampler(make_model(seed=9), head_k=8, eos_id=1)
    sampler.load(Snapshot.of(trainer, 7))
    prompts = [s.tolist() for s in random_seqs(5, seed=4, hi=12)]
    batch = sampler.generate(prompts, params, 16, seed=0)
    assert (batch.version[batch.action_mask] == 7).all()
    for rows in (list(range(5)), [0], [3, 1]):  # trainer groupings differ from the sampler's
        sub = batch.select(rows)
        with torch.no_grad():
            view = score_batch(trainer, sub)
        m = sub.action_mask
        assert torch.equal(view.logp[m], sub.sampler_logp[m])
        assert torch.equal(view.head_logp[m], sub.sampler_topk_logp[m])


def manual_filtered(logits, params):
    """The renormalised filtered distribution, written out independently (top-k, then top-p on the rest)."""
    x = logits.double() / params.temperature
    keep = torch.ones_like(x, dtype=torch.bool)
    if params.top_k:
        kth = torch.sort(x, descending=True).values[params.top_k - 1]
        keep &= x >= kth
    p = torch.where(keep, torch.exp(x - x.max()), torch.zeros_like(x))
    p = p / p.sum()
    if params.top_p < 1:
        order = torch.argsort(x, descending=True)
        mass, chosen = 0.0, torch.zeros_like(keep)
        for j in order.tolist():
            chosen[j] = True
            mass += float(p[j])
            if mass >= params.top_p:
                break
        keep &= chosen
    q = torch.where(keep, torch.exp(x), torch.zeros_like(x))
    return q / q.sum()


@pytest.mark.parametrize("params", [SamplingParams(temperature=0.7, top_k=5), SamplingParams(top_p=0.6),
                                    SamplingParams(temperature=2.0, top_k=12, top_p=0.5)])
def test_recorded_q_is_the_renormalised_filtered_distribution(params):
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(20, 64, generator=g) * 3
    logq = sampling_logprobs(logits, params)
    for row in range(20):
        want = manual_filtered(logits[row], params)
        got = logq[row].double().exp()
        assert torch.allclose(got, want, atol=1e-6)
        assert torch.equal(got > 0, want > 0)


def test_recorded_tokens_come_from_the_filtered_support():
    model = make_model("fast")
    sampler = Sampler(model, head_k=64)
    sampler.load(Snapshot.of(model, 0))
    params = SamplingParams(top_k=3)
    batch = sampler.generate([[5, 6], [7]], params, 20, seed=2)
    m = batch.action_mask
    # the recorded token is always inside the head of 3 non-zero entries, whose q sum to 1
    head_q = batch.sampler_topk_logp[m].exp()
    assert torch.allclose(head_q[:, :3].sum(-1), torch.ones(int(m.sum())), atol=1e-5)
    assert (head_q[:, 3:] == 0).all()
    tok = batch.tokens[m]
    assert (batch.sampler_topk_ids[m][:, :3] == tok[:, None]).any(-1).all()


def test_generation_is_seeded_and_reproducible():
    model = make_model("fast")
    sampler = Sampler(model, head_k=4)
    sampler.load(Snapshot.of(model, 0))
    prompts = [[3, 4, 5], [6]]
    a = sampler.generate(prompts, SamplingParams(), 20, seed=11)
    b = sampler.generate(prompts, SamplingParams(), 20, seed=11)
    c = sampler.generate(prompts, SamplingParams(), 20, seed=12)
    assert torch.equal(a.tokens, b.tokens) and torch.equal(a.sampler_logp, b.sampler_logp)
    assert not torch.equal(a.tokens, c.tokens)


@pytest.mark.parametrize("params", [SamplingParams(), SamplingParams(temperature=0.7, top_p=0.9)], ids=["plain", "top-p"])
def test_row_draws_give_each_row_the_same_bits_whatever_rows_are_generated_beside_it(params):
    """rollout.draws=row (what sharded generation needs): in aligned execution a share of the rows, generated
    alone and widened by concat_batches, is bit for bit the whole batch's; the batch-wide generator is not."""
    from driftless.rollout.batch import concat_batches

    sampler = Sampler(make_model("aligned"), head_k=4, eos_id=0)
    sampler.load(Snapshot.of(sampler.policy, 0))
    prompts = [s.tolist() for s in random_seqs(10, seed=3, hi=12)]
    seeds = [1000 + i for i in range(len(prompts))]
    whole = sampler.generate(prompts, params, 16, seed=5, row_seeds=seeds)
    shares = [sampler.generate(prompts[a:b], params, 16, seed=5, row_seeds=seeds[a:b]) for a, b in ((0, 3), (3, 10))]
    gathered = concat_batches(shares, pad_id=0)
    for field in ("tokens", "length", "action_mask", "sampler_logp", "version", "sampler_topk_ids", "sampler_topk_logp"):
        assert torch.equal(getattr(whole, field), getattr(gathered, field)), field
    assert min(b.tokens.shape[1] for b in shares) < whole.tokens.shape[1]  # a share was widened
    batchwide = [sampler.generate(prompts[a:b], params, 16, seed=5) for a, b in ((0, 3), (3, 10))]
    assert not torch.equal(concat_batches(batchwide, pad_id=0).tokens, sampler.generate(prompts, params, 16, seed=5).tokens)


def test_row_draws_follow_q_and_never_draw_a_token_outside_its_support():
    from driftless.rollout.sampling import draw_rows

    q = torch.tensor([0.5, 0.0, 0.3, 0.15, 0.05])
    n = 40_000
    u = torch.rand(n, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    tokens = draw_rows(q.log().expand(n, -1), u)
    counts = torch.bincount(tokens, minlength=5).double() / n
    assert counts[1] == 0
    assert torch.allclose(counts, q.double(), atol=4 * (0.25 / n) ** 0.5)  # four standard errors at most
    u = torch.tensor([0.0, 0.49, 0.51, 0.79, 0.81, 0.96, 1 - 1e-12], dtype=torch.float64)  # the inverse CDF's steps
    assert draw_rows(q.log().expand(7, -1), u).tolist() == [0, 0, 2, 2, 3, 4, 4]


class FavouritePolicy(torch.nn.Module):
    """A stand-in Policy whose next-token logits always favour one token: any Policy plugs in."""

    vocab_size, max_seq_len = 8, 16

    def __init__(self, favourite):
        super().__init__()
        self.favourite = favourite
        self.scale = torch.nn.Parameter(torch.tensor(5.0))

    def _logits(self, *shape):
        out = torch.zeros(*shape, self.vocab_size)
        out[..., self.favourite] = self.scale
        return out

    def forward(self, tokens):
        return self._logits(*tokens.shape)

    def new_cache(self, batch_size):
        return None

    def prefill(self, tokens, lengths, cache):
        return self._logits(*tokens.shape)

    def decode(self, tokens, positions, cache):
        return self._logits(tokens.shape[0])


def test_eos_stops_a_row_and_is_an_action():
    policy = FavouritePolicy(favourite=1)
    sampler = Sampler(policy, eos_id=1, head_k=2)
    sampler.load(Snapshot.of(policy, 0))
    batch = sampler.generate([[3, 4], [5, 6, 7]], SamplingParams(greedy=True), 10, seed=0)
    assert batch.length.tolist() == [3, 4]
    assert batch.completions() == [[1], [1]]
    assert batch.sampler_logp[batch.action_mask].eq(0).all()  # greedy: q is a point mass
    # without an EOS id, generation runs to the budget (and never past the context)
    sampler.eos_id = None
    batch = sampler.generate([[3, 4], [5] * 10], SamplingParams(), 10, seed=0)
    assert batch.length.tolist() == [12, 16]


# ---------------------------------------------------------------- gradients of the aligned path
def test_aligned_gradients_match_fast_and_float64():
    seqs = pad(random_seqs(3, seed=6, lo=5, hi=15), 14)
    w = torch.randn(3, 14, 64, generator=torch.Generator().manual_seed(0))

    def grads(model):
        loss = (torch.log_softmax(model(seqs), -1) * w).sum()
        return torch.autograd.grad(loss, list(model.parameters()))

    aligned, fast = make_model("aligned"), make_model("fast")
    fast.load_state_dict(aligned.state_dict())
    ref = make_model("fast").double()
    ref.load_state_dict({k: v.double() for k, v in aligned.state_dict().items()})
    ref.rope_cos, ref.rope_sin = ref.rope_cos.double(), ref.rope_sin.double()
    for ga, gf, gr in zip(grads(aligned), grads(fast), grads(ref)):
        assert float((ga - gf).norm() / gf.norm()) < 1e-5  # the fast path's backward (at aligned logits)
        # fp32 vs float64: elementwise tolerances fail on entries that cancel to ~0 (seen with
        # torch's AVX2 kernels), so compare each parameter's gradient as a whole
        assert float((ga.double() - gr).norm() / gr.norm()) < 1e-4


@pytest.mark.parametrize("quantized", [False, True], ids=["plain", "w8a8-fake-quant"])
@pytest.mark.parametrize("config", [SMALL, TinyLMConfig()], ids=["small", "default-gqa"])
def test_a_training_forward_keeps_the_aligned_bits_and_takes_the_fast_gradient(config, quantized):
    from driftless.ops.numerics import Numerics
    from driftless.ops.quant import QuantSpec

    seqs = pad(random_seqs(3, seed=7, lo=4, hi=16), 15)
    w = torch.randn(3, 15, 64, generator=torch.Generator().manual_seed(1))
    aligned, fast = make_model("aligned", config), make_model("fast", config)
    fast.load_state_dict(aligned.state_dict())
    if quantized:
        aligned.numerics = fast.numerics = Numerics(weight=QuantSpec("int8", "row"), act=QuantSpec("int8", "row"))
    with torch.no_grad():
        values = aligned(seqs)
    logits = aligned(seqs)  # each aligned piece an autograd node: the same values
    assert logits.requires_grad and torch.equal(logits, values)
    grads_a = torch.autograd.grad((torch.log_softmax(logits, -1) * w).sum(), list(aligned.parameters()))
    grads_f = torch.autograd.grad((torch.log_softmax(fast(seqs), -1) * w).sum(), list(fast.parameters()))
    for name, ga, gf in zip(dict(aligned.named_parameters()), grads_a, grads_f):
        assert float(gf.norm()) > 0, name
        # the fast backward at the aligned activations; fake quantization rounds a few of those to the
        # neighbouring level of the fast activations' (seen: 1.4e-3 for final_norm under w8a8)
        assert float((ga - gf).norm() / gf.norm()) < (1e-2 if quantized else 1e-4), name
    # a decode step with a cache under gradients: values only (gradients are defined for full forwards)
    cache = aligned.new_cache(3)
    aligned.prefill(seqs[:, :4], torch.full((3,), 4), cache)
    step = aligned.decode(seqs[:, 4], torch.full((3,), 4), cache)
    assert not step.requires_grad and torch.equal(step, values[:, 4])


# ---------------------------------------------------------------- self-test, persistence
def test_selftest_catches_a_non_invariant_kernel(monkeypatch):
    import torch.nn.functional as F

    assert invariance_failures(SMALL, TinyLM) == []
    failures = invariance_failures(TinyLMConfig(), TinyLM, gemm=lambda x, w: F.linear(x, w))  # plain fp32 GEMMs
    assert failures  # caught, and the first differing operation is named with its shape
    assert "first at layer 0 wq|wk|wv (output shape" in failures[0]
    import driftless.models.selftest as st

    monkeypatch.setattr(st, "_CACHE", {})
    monkeypatch.setattr(st, "invariance_failures", lambda config, cls: ["decode differs"])
    with pytest.raises(AlignmentError, match="not bitwise invariant"):
        ensure_aligned(SMALL, TinyLM)
    with pytest.raises(AlignmentError):
        TinyLM(SMALL, execution="aligned")


def test_the_selftest_runs_the_eager_definitions_and_restores_the_choice(monkeypatch):
    # compiling the self-test's own shapes cost every aligned process 18-71 s; the compiled pieces equal the eager
    # ones by construction (tests/test_fuse.py)
    import driftless.models.selftest as st
    from driftless.ops import fuse

    seen = []
    monkeypatch.setattr(st, "_CACHE", {})
    monkeypatch.setattr(st, "invariance_failures",
                        lambda config, cls: seen.append((fuse.fused_enabled(), fuse._local.off)) or [])
    for choice in (True, None):
        fuse.set_fused(choice)
        try:
            st._CACHE.clear()
            ensure_aligned(SMALL, TinyLM)
            assert fuse._choice is choice and not fuse._local.off  # restored
        finally:
            fuse.set_fused(None)
    assert seen == [(False, True), (False, True)]


def test_save_load_roundtrip(tmp_path):
    model = make_model("aligned")
    save_model(model, tmp_path / "m.safetensors", version=3)
    loaded, version = load_model(tmp_path / "m.safetensors", execution="aligned")
    x = pad(random_seqs(2, seed=3), 30)
    with torch.no_grad():
        assert torch.equal(model(x), loaded(x))
    assert version == 3


# ---------------------------------------------------------------- bad input
def test_bad_inputs_are_refused_by_name():
    model = make_model("fast")
    sampler = Sampler(model)
    with pytest.raises(ValueError, match="no weight version"):
        sampler.generate([[1]], SamplingParams(), 4)
    with pytest.raises(ValueError, match="version"):
        Snapshot(model.state_dict(), None)
    with pytest.raises(ValueError, match="version"):
        sampler.load(model.state_dict())
    sampler.load(Snapshot.of(model, 0))
    with pytest.raises(ValueError, match="prompt 0 has 64 tokens"):
        sampler.generate([[1] * 64], SamplingParams(), 4)
    with pytest.raises(ValueError, match="prompt 1 is empty"):
        sampler.generate([[1], []], SamplingParams(), 4)
    with pytest.raises(ValueError, match=r"prompt 0 holds token ids outside \[0, 64\)"):
        sampler.generate([[70]], SamplingParams(), 4)
    with pytest.raises(ValueError, match="temperature must be > 0"):
        SamplingParams(temperature=0.0)
    with pytest.raises(ValueError, match="top_p must be in"):
        SamplingParams(top_p=1.5)
    with pytest.raises(ValueError, match="top_p must be in"):
        SamplingParams(top_p=0.0)
    with pytest.raises(ValueError, match="top_k must be"):
        SamplingParams(top_k=-1)
    with pytest.raises(ValueError, match="larger than the vocabulary"):
        sampler.generate([[1]], SamplingParams(top_k=65), 4)
    with pytest.raises(ValueError, match="token ids must be in"):
        model(torch.tensor([[64]]))
    with pytest.raises(ValueError, match="exceed the context"):
        model(torch.zeros(1, 65, dtype=torch.long))
    SamplingParams(temperature=0.0, greedy=True)  # explicit greedy is fine


def test_rollout_batch_validation_names_the_field():
    model = make_model("fast")
    sampler = Sampler(model, head_k=4)
    sampler.load(Snapshot.of(model, 0))
    batch = sampler.generate([[3, 4]], SamplingParams(), 5, seed=0)
    bad_lq = batch.sampler_logp.clone()
    bad_lq[batch.action_mask] = float("-inf")
    with pytest.raises(ValueError, match="RolloutBatch.sampler_logp"):
        batch.replace(sampler_logp=bad_lq)
    bad_v = batch.version.clone()
    bad_v[batch.action_mask] = -1
    with pytest.raises(ValueError, match="RolloutBatch.version"):
        batch.replace(version=bad_v)
    with pytest.raises(ValueError, match="RolloutBatch.action_mask"):
        batch.replace(action_mask=torch.ones_like(batch.action_mask))
    with pytest.raises(ValueError, match="RolloutBatch.reward"):
        batch.replace(reward=torch.tensor([float("nan")]))
    assert isinstance(batch, RolloutBatch)


# ---------------------------------------------------------------- check-alignment
def test_check_alignment_json(capsys):
    from driftless.cli import main

    assert main(["check-alignment", "--json", "--modes", "fast", "aligned", "--prompts", "5",
                 "rollout.max_new_tokens=8"]) == 0
    result = json.loads(capsys.readouterr().out)
    for mode in ("fast", "aligned"):
        assert set(result["modes"][mode]) == {"tokens", "bitwise_equal_fraction", "max_abs_logp_diff", "kl_k3"}
    assert result["modes"]["aligned"]["bitwise_equal_fraction"] == 1.0
    assert result["modes"]["aligned"]["max_abs_logp_diff"] == 0.0
    assert result["modes"]["fast"]["max_abs_logp_diff"] > 0.0


@pytest.mark.parametrize("execution", ["fast", "aligned"])
def test_a_sampler_adopts_a_shared_snapshot_samples_its_updates_and_never_writes_into_it(execution):
    trainer, sampler_policy = make_model(execution), make_model(execution, seed=1)
    sampler = Sampler(sampler_policy, head_k=4)
    sampler.load(Snapshot.sharing(trainer, 0))
    assert sampler.adopted
    assert all(p.data_ptr() == trainer.state_dict()[k].data_ptr() for k, p in sampler_policy.state_dict().items())
    prompts = [[1, 2, 3], [4, 5]]
    with torch.no_grad():  # an optimizer step on the trainer: the sampler samples from it as it is
        for p in trainer.parameters():
            p.add_(0.01 * torch.randn_like(p))
    fresh = Sampler(make_model(execution, seed=2), head_k=4)
    fresh.load(Snapshot.of(trainer, 1))  # copies: what a sampler loading version 1 holds
    got = sampler.generate(prompts, max_new_tokens=6, seed=3)
    want = fresh.generate(prompts, max_new_tokens=6, seed=3)
    assert torch.equal(got.tokens, want.tokens) and torch.equal(got.sampler_logp, want.sampler_logp)
    before = {k: v.clone() for k, v in trainer.state_dict().items()}
    sampler.load(Snapshot.of(make_model(execution, seed=3), 2))  # a plain load (a resume's): copies of its own
    assert not sampler.adopted
    assert all(torch.equal(v, before[k]) for k, v in trainer.state_dict().items())  # the trainer untouched

    class View:  # any mismatch view may change the weights it is applied to: the sampler copies
        def apply(self, policy):
            pass
    viewed = Sampler(make_model(execution, seed=1), head_k=4, view=View())
    viewed.load(Snapshot.sharing(trainer, 0))
    assert not viewed.adopted
