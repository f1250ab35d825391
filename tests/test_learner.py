"""The learner on its own: PPO epochs and minibatches, the fixed anchor, and metric sinks."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import run_until_killed

from driftless.objectives import make
from driftless.rollout import score_batch
from driftless.train import Run, load_config
from driftless.train.learner import Learner, make_optimizer

TINY = ["task.name=first-token", "model.d_model=64", "model.n_head=1", "model.n_kv_head=1", "model.d_ff=128",
        "model.n_layer=1", "model.max_seq_len=16", "model.warm_start=false", "rollout.prompts_per_step=4",
        "rollout.group_size=4", "rollout.max_new_tokens=3", "rollout.head_k=8", "train.eval_problems=8",
        "train.progress=false", "optim.name=adamw", "optim.schedule=constant", "optim.lr=1e-2"]


def batch_and_policy(tmp_path, *extra):
    run = Run(load_config(None, [*TINY, *extra]), tmp_path)
    run.source.worker.load(run.learner.publish())
    batch, _ = run.source.worker.produce(0)
    return run, batch


def test_one_epoch_one_minibatch_is_the_plain_update_bit_for_bit(tmp_path):
    run, batch = batch_and_policy(tmp_path, "objective.name=ppo+tis")
    reference = {k: v.clone() for k, v in run.policy.state_dict().items()}
    # the plain algorithm, written out: score, anchor = detached log p, objective, one optimizer step
    import copy
    policy = copy.deepcopy(run.policy)
    opt = make_optimizer(list(policy.parameters()), "adamw", 1e-2)
    view = score_batch(policy, batch, head_k=8)
    loss, _ = make("ppo+tis")(view, batch.replace(anchor_logp=view.logp.detach()))
    loss.backward()
    norm = float(torch.stack([p.grad.norm() for p in policy.parameters() if p.grad is not None]).norm())
    if norm > 1.0:
        for p in policy.parameters():
            if p.grad is not None:
                p.grad.mul_(1.0 / norm)
    opt.step()
    m = run.learner.update(batch)
    assert m["version"] == 1 and "optimizer_steps" not in m and m["clip_fraction"] == 0.0  # π0 = p: no clipping
    for k, v in run.policy.state_dict().items():
        assert torch.equal(v, policy.state_dict()[k]), k
        assert not torch.equal(v, reference[k]) or v.dim() == 1


def test_several_epochs_and_minibatches_clip_against_a_fixed_anchor(tmp_path):
    run, batch = batch_and_policy(tmp_path, "objective.name=ppo", "train.ppo_epochs=3", "train.minibatches=2")
    with torch.no_grad():
        anchor_before = score_batch(run.policy, batch, head_k=8).logp
    seen = []
    objective = run.learner.objective

    def spy(view, sub, **kwargs):
        if "totals" in kwargs:  # the loss each step back-propagates (one call a micro-batch)
            seen.append((sub.anchor_logp.clone(), view.logp.detach().clone(), sub.tokens.shape[0]))
        return objective(view, sub, **kwargs)
    run.learner.objective = spy
    m = run.learner.update(batch)
    assert m["version"] == 6 and m["optimizer_steps"] == 6 and len(seen) == 6
    assert [n for *_, n in seen] == [8, 8] * 3  # two minibatches of 8 rows, three times
    half = batch.batch_size // 2
    for i, (anchor, logp, _) in enumerate(seen):
        rows = slice(0, half) if i % 2 == 0 else slice(half, None)
        assert torch.equal(anchor, anchor_before[rows])  # π0 never moves within the batch
    assert not torch.equal(seen[-1][1], seen[-1][0])  # while p does
    assert m["clip_fraction"] > 0
    assert m["objective_age_max"] == 5  # the last step sees tokens 5 versions old


def test_learner_rejects_bad_settings():
    policy = torch.nn.Linear(2, 2)
    with pytest.raises(ValueError, match="train.ppo_epochs"):
        Learner(policy, make("pg"), make_optimizer(policy.parameters(), "sgd", 0.1), ppo_epochs=0)
    with pytest.raises(ValueError, match="optim.name"):
        make_optimizer(policy.parameters(), "lion", 0.1)
    with pytest.raises(ValueError, match="train.loggers"):
        load_config(None, ["train.loggers=jsonl,csv"])


def test_tensorboard_and_wandb_sinks_receive_the_same_metrics(tmp_path, monkeypatch):
    pytest.importorskip("tensorboard")
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    cfg = load_config(None, [*TINY, "train.steps=3", "train.eval_every=3", "train.loggers=jsonl,tensorboard,wandb"])
    Run(cfg, tmp_path).run()
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tmp_path / "tb"))
    acc.Reload()
    rewards = [e.value for e in acc.Scalars("rollout/reward")]
    assert rewards == pytest.approx([r["reward"] for r in rows])
    assert [e.step for e in acc.Scalars("learner/loss")] == [0, 1, 2]
    assert [e.value for e in acc.Scalars("eval/eval_reward")] == pytest.approx([rows[-1]["eval_reward"]])
    assert list((tmp_path / "wandb").glob("offline-run-*/run-*.wandb"))  # W&B's offline run file


def test_linear_schedule_decays_and_resumes_exactly(tmp_path):
    extra = ["train.steps=4", "train.checkpoint_every=2", "train.eval_every=4", "optim.schedule=linear"]
    Run(load_config(None, [*TINY, *extra]), tmp_path / "a").run()
    run_until_killed(Run(load_config(None, [*TINY, *extra]), tmp_path / "b"), 2)  # after the checkpoint of step 2
    Run(load_config(None, [*TINY, *extra]), tmp_path / "b").run(resume=True)
    from driftless.train.loop import TIMING_KEYS

    a, b = ([json.loads(x) for x in (tmp_path / d / "metrics.jsonl").read_text().splitlines()] for d in "ab")
    assert [r["lr"] for r in a] == pytest.approx([1e-2, 0.75e-2, 0.5e-2, 0.25e-2])
    assert [{k: v for k, v in r.items() if k not in TIMING_KEYS} for r in a] == \
        [{k: v for k, v in r.items() if k not in TIMING_KEYS} for r in b]
    with pytest.raises(ValueError, match="optim.schedule"):
        load_config(None, ["optim.schedule=step"])
