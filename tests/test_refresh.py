"""In-flight weight refresh: per-token versions across a refresh, kv_version, pin / recompute / retain."""

from __future__ import annotations

import pytest
import torch

from driftless.models import TinyLM, TinyLMConfig
from driftless.rollout import SamplingParams, Snapshot, score_batch
from driftless.rollout.sampler import Sampler

CONFIG = TinyLMConfig(vocab_size=64, d_model=64, n_layer=2, n_head=2, n_kv_head=1, d_ff=128, max_seq_len=48)


def snapshots():
    out = []
    for version, seed in ((3, 0), (4, 1)):
        m = TinyLM(CONFIG)
        m.reset_parameters(seed=seed)
        out.append(Snapshot.of(m, version))
    return out


def generate(refresh, execution="aligned"):
    old, new = snapshots()
    sampler = Sampler(TinyLM(CONFIG, execution=execution), head_k=4)
    sampler.load(old)
    calls = []

    def weights():  # new weights are published after the first chunk
        calls.append(len(calls))
        return new
    prompts = [[5, 6, 7], [8, 9], [10, 11, 12, 13]]
    batch = sampler.generate(prompts, SamplingParams(), 12, seed=3, weights=weights, refresh=refresh,
                             refresh_every=4)
    return batch, old, new, calls


@pytest.mark.parametrize("refresh", ["recompute", "retain"])
def test_versions_change_mid_response_at_the_refresh(refresh):
    batch, _, _, calls = generate(refresh)
    m = batch.action_mask
    assert calls and batch.meta["refreshes"][0] == {"step": 4, "from": 3, "to": 4, "policy": refresh}
    # recompute: the 5th token comes from logits recomputed under the new weights; retain: its logits
    # were computed by the old weights before the refresh, so it is labelled with the old version
    first_new = 4 if refresh == "recompute" else 5
    for row in range(batch.batch_size):
        versions = batch.version[row][m[row]].tolist()
        assert versions[:first_new] == [3] * first_new and set(versions[first_new:]) == {4}
    kv = batch.kv_version[m]
    if refresh == "recompute":
        assert torch.equal(kv, batch.version[m])  # a clean cache: the state of one snapshot
    else:
        assert bool((kv[batch.version[m] == 4] == 3).all())  # stale cache kept: hybrid, and recorded as such


def test_recompute_tokens_rescore_bitwise_with_the_snapshot_of_their_version():
    batch, old, new, _ = generate("recompute")
    m = batch.action_mask
    for snap in (old, new):
        trainer = TinyLM(CONFIG, execution="aligned")
        trainer.load_state_dict(snap.state)
        with torch.no_grad():
            logp = score_batch(trainer, batch).logp
        mine = m & (batch.version == snap.version)
        assert mine.any() and torch.equal(logp[mine], batch.sampler_logp[mine])


def test_retain_tokens_are_not_those_of_any_single_snapshot():
    batch, _, new, _ = generate("retain")
    m = batch.action_mask & (batch.version == 4)
    trainer = TinyLM(CONFIG, execution="aligned")
    trainer.load_state_dict(new.state)
    with torch.no_grad():
        logp = score_batch(trainer, batch).logp
    assert not torch.equal(logp[m], batch.sampler_logp[m])


def test_pin_never_refreshes_and_bad_policies_are_refused():
    batch, *_, calls = generate("pin")
    assert not calls and "refreshes" not in batch.meta
    assert bool((batch.version[batch.action_mask] == 3).all())
    sampler = Sampler(TinyLM(CONFIG), head_k=0)
    sampler.load(snapshots()[0])
    with pytest.raises(ValueError, match="rollout.refresh"):
        sampler.generate([[1, 2]], SamplingParams(), 4, seed=0, refresh="swap")


def test_decode_latency_slows_every_decode_step_and_changes_no_bit():
    """``decode_latency`` (a larger model's token time, for async experiments) sleeps once per decode
    step: sleep never returns early, so the wall time has a hard floor; the tokens are those of no latency."""
    import time

    old, _ = snapshots()
    prompts = [[5, 6, 7], [8, 9]]
    batches = []
    for latency in (0.0, 0.02):
        sampler = Sampler(TinyLM(CONFIG), head_k=4, decode_latency=latency)
        sampler.load(old)
        t0 = time.perf_counter()
        batches.append(sampler.generate(prompts, SamplingParams(), 10, seed=3))
        wall = time.perf_counter() - t0
    assert wall >= 10 * 0.02
    assert torch.equal(batches[0].tokens, batches[1].tokens) and torch.equal(batches[0].sampler_logp, batches[1].sampler_logp)
    with pytest.raises(ValueError, match="decode_latency must be >= 0"):
        Sampler(TinyLM(CONFIG), decode_latency=-1.0)
