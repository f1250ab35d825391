"""Micro-batches with exact aggregation: the accumulated update is the whole batch's, for every reduction and preset.

In float64 the gradient step and every logged metric of one update agree to 1e-12 (relative) between one
forward and micro-batches of uneven token counts; the per-micro-batch-mean bug (a mean per piece, then a mean
of means) would differ at the percent level, which the same comparison catches."""

from __future__ import annotations

import copy
import math

import pytest
import torch

from driftless.mismatch import parse_view
from driftless.models import TinyLM, TinyLMConfig
from driftless.objectives import REDUCTIONS, make
from driftless.objectives.reductions import Totals, reduce_loss
from driftless.rollout import Sampler, SamplingParams, Snapshot
from driftless.train.learner import Learner, make_optimizer, micro_batches
from driftless.train.parallel import full_state, fully_shard_policy

PRESETS = ["pg", "tis", "sc+tis", "gspo", "reinforce-zero"]


@pytest.fixture(scope="module")
def setup():
    return mismatched_batch()


def mismatched_batch():
    """A float64 TinyLM and a batch sampled from a noisy float32 copy: uneven lengths, a real head."""
    torch.manual_seed(0)
    model = TinyLM(TinyLMConfig(vocab_size=64, d_model=32, n_layer=1, n_head=2, n_kv_head=1, d_ff=64, max_seq_len=40))
    model.reset_parameters(seed=1)
    sampler_copy = copy.deepcopy(model)
    sampler = Sampler(sampler_copy, head_k=8, eos_id=2, view=parse_view("noise:0.05"))
    sampler.load(Snapshot.of(model, 0))
    generator = torch.Generator().manual_seed(3)
    prompts = [[1, *torch.randint(3, 40, (int(n),), generator=generator).tolist()]
               for n in torch.randint(1, 9, (12,), generator=generator)]
    batch = sampler.generate(prompts, SamplingParams(temperature=1.0), 20, seed=5, group=[i // 3 for i in range(12)])
    advantage = torch.randn(12, generator=generator, dtype=torch.float64).float()
    batch = batch.replace(advantage=advantage, reward=advantage)
    assert len(set((batch.length - batch.prompt_len).tolist())) > 3  # uneven response lengths
    return model.double(), batch


def update(model, batch, preset, reduction, micro, epochs=1, minibatches=1, ranks=None, parallel="ddp"):
    policy = copy.deepcopy(model)
    if parallel == "fsdp":
        fully_shard_policy(policy, ranks)
    params = {"reduction": reduction} if preset != "sc+tis" else {"reduction": reduction, "top_k": 8}
    learner = Learner(policy, make(preset, **params), make_optimizer(list(policy.parameters()), "sgd", 0.1),
                      grad_clip=0.0, head_k=8, decomposition=False, micro_batch_tokens=micro, ppo_epochs=epochs,
                      minibatches=minibatches, ranks=ranks)
    metrics = learner.update(batch)
    after = full_state(policy)
    step = {k: (after[k] - model.state_dict()[k]) for k in model.state_dict()}
    return step, metrics


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp(min=1e-300))


@pytest.mark.parametrize("preset", PRESETS)
@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_micro_batches_give_the_whole_batch_update_and_metrics(setup, preset, reduction):
    model, batch = setup
    whole_step, whole = update(model, batch, preset, reduction, None)
    budget = int(batch.length.sum()) // 4 + 1
    assert len(micro_batches(batch.length, budget)) >= 4
    step, metrics = update(model, batch, preset, reduction, budget)
    worst = max(relative(step[k], whole_step[k]) for k in step if whole_step[k].abs().max() > 0)
    assert worst < 1e-12, worst
    for key, value in whole.items():
        if key.endswith("_s") or not isinstance(value, float) or not math.isfinite(value):
            continue
        assert metrics[key] == pytest.approx(value, rel=1e-12, abs=1e-14), key


def test_ppo_epochs_and_minibatches_compose_with_micro_batches(setup):
    model, batch = setup
    whole_step, whole = update(model, batch, "ppo+tis", "token-mean", None, epochs=2, minibatches=2)
    step, metrics = update(model, batch, "ppo+tis", "token-mean", 40, epochs=2, minibatches=2)
    assert max(relative(step[k], whole_step[k]) for k in step if whole_step[k].abs().max() > 0) < 1e-12
    assert metrics["optimizer_steps"] == whole["optimizer_steps"] == 4
    assert metrics["clip_fraction"] == pytest.approx(whole["clip_fraction"], rel=1e-12, abs=1e-14)


@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_pieces_with_the_whole_batchs_totals_sum_to_the_whole_loss(reduction):
    generator = torch.Generator().manual_seed(0)
    loss = torch.randn(9, 7, generator=generator, dtype=torch.float64)
    mask = torch.rand(9, 7, generator=generator) < 0.6
    mask[4] = False  # a response with no action token
    whole = reduce_loss(loss, mask, reduction)
    totals = Totals.of(mask)
    rows = [torch.tensor(r) for r in ([0, 1], [2, 3, 4, 5], [6], [7, 8])]

    def trimmed(r):  # a micro-batch is trimmed to its own rows' width (RolloutBatch.select)
        used = mask[r].any(0).nonzero()
        width = int(used.max()) + 1 if len(used) else 1
        return loss[r][:, :width], mask[r][:, :width]
    pieces = sum(reduce_loss(*trimmed(r), reduction, totals=totals) for r in rows)
    assert float(pieces) == pytest.approx(float(whole), rel=1e-14)
    naive = sum(reduce_loss(loss[r], mask[r], reduction) for r in rows) / len(rows)
    if reduction != "token-sum":  # the mean of per-piece means is another number (the bug class)
        assert abs(float(naive) - float(whole)) > 1e-6


def test_micro_batches_split_by_tokens():
    lengths = torch.tensor([5, 5, 12, 3, 3, 3, 20])
    assert [g.tolist() for g in micro_batches(lengths, 10)] == [[0, 1], [2], [3, 4, 5], [6]]
    assert [g.tolist() for g in micro_batches(lengths, None)] == [list(range(7))]
    with pytest.raises(ValueError, match="train.micro_batch_tokens must be a positive integer"):
        Learner(TinyLM(TinyLMConfig(vocab_size=64, d_model=16, n_layer=1, n_head=1, n_kv_head=1, d_ff=16,
                                    max_seq_len=8)), make("pg"), None, micro_batch_tokens=0)


def test_bf16_trains_with_float32_master_weights_and_log_probs(setup):
    model, batch = setup
    policy = copy.deepcopy(model).float()
    optimizer = make_optimizer(list(policy.parameters()), "adamw", 1e-3)
    learner = Learner(policy, make("sc+tis", top_k=8), optimizer, head_k=8, decomposition=False, precision="bf16")
    view = learner._forward(policy, batch)
    plain = copy.deepcopy(policy)
    full = Learner(plain, make("pg"), make_optimizer(list(plain.parameters()), "sgd", 0.1), head_k=8)._forward(
        policy, batch)
    assert view.logp.dtype == torch.float32 and view.head_logp.dtype == torch.float32
    gap = float((view.logp - full.logp)[batch.action_mask].abs().max())
    assert 1e-4 < gap < 0.1  # bf16 products: near float32, not equal to it
    metrics = learner.update(batch)
    assert math.isfinite(metrics["loss"]) and learner.version == 1
    assert all(p.dtype == torch.float32 for p in policy.parameters())
    assert all(v.dtype == torch.float32 for state in optimizer.state.values() for v in state.values()
               if torch.is_tensor(v) and v.is_floating_point())
    aligned = copy.deepcopy(policy)
    aligned.execution = "aligned"
    with pytest.raises(ValueError, match="aligned is float32 by construction"):
        Learner(aligned, make("pg"), make_optimizer(list(aligned.parameters()), "sgd", 0.1), precision="bf16")
    from driftless.train import load_config

    with pytest.raises(ValueError, match="train.precision=bf16 with model.execution=aligned"):
        load_config(None, ["train.precision=bf16", "model.execution=aligned"])



def test_the_mmap_threshold_is_handed_to_glibc_in_the_learners_process_and_refused_where_it_cannot_be(monkeypatch):
    """train.malloc_mmap_threshold reaches glibc's mallopt(M_MMAP_THRESHOLD, value) when the learner is built (a
    recording stand-in for the C library here; the real one accepts the value in a child process, the setting being
    process-wide), and a value glibc cannot take, or a process without glibc, is refused at start by name."""
    import subprocess
    import sys

    from driftless.train import allocator, build, load_config

    with pytest.raises(ValueError, match=r"train.malloc_mmap_threshold=40000000: glibc takes 0 to 33554432 bytes"):
        build.check(load_config(None, ["train.malloc_mmap_threshold=40000000"]))
    calls = []

    class C:
        def mallopt(self, option, value):
            calls.append((option.value, value.value))
            return 1

    monkeypatch.setattr(allocator, "_glibc", lambda: C())
    config = load_config(None, ["train.malloc_mmap_threshold=65536", "model.warm_start=false"])
    build.learner(config, build.initial_state(config, progress=False)[0])
    assert calls == [(allocator.M_MMAP_THRESHOLD, 65536)]
    monkeypatch.setattr(allocator, "_glibc", lambda: None)
    with pytest.raises(ValueError, match=r"train.malloc_mmap_threshold=65536 sets glibc's allocator .* leave it unset"):
        build.check(config)
    monkeypatch.undo()
    if allocator._glibc() is not None:
        code = "from driftless.train.allocator import set_mmap_threshold as s; s(65536)"
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
        assert done.returncode == 0, done.stderr[-2000:]
