"""The transformers adapter end to end on a tiny randomly initialised Qwen3 config (no downloads)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from driftless.models.hf import HFPolicy, tiny_qwen3_config
from driftless.objectives import make
from driftless.rollout import Sampler, SamplingParams, Snapshot, score_batch


def test_hf_policy_samples_scores_and_trains(tmp_path):
    torch.manual_seed(0)
    trainer = HFPolicy(tiny_qwen3_config())
    trainer.model.save_pretrained(tmp_path / "tiny")
    from_dir = HFPolicy(tmp_path / "tiny")  # a local causal-LM directory, local_files_only
    sampler = Sampler(from_dir, head_k=8, eos_id=None)
    sampler.load(Snapshot.of(trainer, 4))
    prompts = [[5, 6, 7], [8, 9, 10, 11, 12, 13], [4]]
    batch = sampler.generate(prompts, SamplingParams(temperature=0.9, top_p=0.95), 10, seed=0)
    m = batch.action_mask
    assert int(m.sum()) == 30 and (batch.version[m] == 4).all()
    view = score_batch(trainer, batch)
    # its decode path and its own full forward agree to float32 rounding (not bitwise)
    assert float((view.logp.detach()[m] - batch.sampler_logp[m]).abs().max()) < 1e-5
    batch = batch.replace(advantage=torch.tensor([1.0, -0.5, -0.5]))
    loss, metrics = make("sc+tis", top_k=8)(view, batch)
    loss.backward()
    grads = [p.grad for p in trainer.parameters() if p.grad is not None]
    assert grads and all(torch.isfinite(g).all() for g in grads)
    assert metrics["kl_k3"] < 1e-8


def test_hf_policy_refuses_bad_tokens():
    policy = HFPolicy(tiny_qwen3_config())
    with pytest.raises(ValueError, match="token ids must be in"):
        policy(torch.tensor([[64]]))
    with pytest.raises(ValueError, match="exceed the context"):
        policy(torch.zeros(1, 129, dtype=torch.long))
