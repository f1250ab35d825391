"""driftless's objectives inside the real TRL GRPO trainer, on CPU, on a checkpoint in the real format."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("trl")

from datasets import Dataset

from driftless.objectives import make
from driftless.recipes.make_model import make_model
from driftless.tasks import Countdown, CountdownConfig
from driftless.tasks.export import task_rows


@pytest.fixture(scope="module")
def brought(tmp_path_factory):
    root = tmp_path_factory.mktemp("trl")
    task = Countdown(CountdownConfig(2, 1, 12, 100))
    train, held = task_rows(task, "train", draws=1000), task_rows(task, "eval", draws=2000)
    make_model(root / "model", rows_train=train, rows_eval=held, vocab_size=300, hidden=32, layers=1, heads=2,
               kv_heads=1, intermediate=64, max_positions=64, sft_steps=20, sft_batch=16, progress=False)
    data = Dataset.from_list([{"prompt": r["prompt"], "numbers": r["numbers"], "target": r["target"]}
                              for r in train[:32]])
    return root, data


def length_reward(prompts, completions, **columns):
    """A reward with spread before anything is solved (TRL hands conversational completions as messages)."""
    return [len(c[0]["content"] if isinstance(c, list) else c) / 10 for c in completions]


def trainer_for(brought, tmp_path, preset, **extra):
    from transformers import AutoTokenizer

    from driftless.integrations.trl import DriftlessGRPOConfig, DriftlessGRPOTrainer

    root, data = brought
    params = {"top_k": 8} if preset.startswith("sc") else {}
    args = DriftlessGRPOConfig(
        output_dir=str(tmp_path / "out"), use_cpu=True, report_to="none", bf16=False, fp16=False,
        gradient_checkpointing=False, per_device_train_batch_size=8, num_generations=4, max_completion_length=10,
        max_steps=3, logging_steps=1, save_strategy="no", learning_rate=1e-3, seed=0, dataloader_num_workers=0,
        objective=preset, objective_params=params, head_k=8, **extra)
    tok = AutoTokenizer.from_pretrained(root / "model", local_files_only=True)
    return DriftlessGRPOTrainer(model=str(root / "model"), reward_funcs=length_reward, args=args,
                                train_dataset=data, processing_class=tok)


def capture(trainer):
    """Record the first _compute_loss call's inputs, loss and weights (and the last call's as ``seen["last"]``)."""
    seen = {}
    real = trainer._compute_loss

    def wrapped(model, inputs):
        loss = real(model, inputs)
        call = {"inputs": {k: (v.detach().clone() if torch.is_tensor(v) else v) for k, v in inputs.items()},
                "loss": float(loss.detach()), "state": {k: v.detach().clone() for k, v in model.state_dict().items()}}
        if "inputs" not in seen:
            seen.update(call)
        seen["last"] = call
        return loss
    trainer._compute_loss = wrapped
    return seen


def rescore(trainer, seen):
    """The captured batch scored independently at the captured weights: the trainer's forward, log p of the sampled
    tokens and of the sampler's head ids (``view``), and the objective's batch from what TRL recorded."""
    inputs = seen["inputs"]
    model = trainer.model
    model.load_state_dict(seen["state"])
    t = inputs["completion_ids"].shape[1]
    ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1)
    attention = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], 1)
    with torch.no_grad():
        logp_all = model(input_ids=ids, attention_mask=attention).logits[:, -t - 1:-1].float().log_softmax(-1)
    view = {"logp": logp_all.gather(-1, inputs["completion_ids"][..., None]).squeeze(-1),
            "head_logp": logp_all.gather(-1, inputs["sampler_topk_ids"])}
    mask = inputs["completion_mask"].bool()
    batch = {"sampler_logp": torch.where(mask, inputs["sampling_per_token_logps"], 0.0), "action_mask": mask,
             "advantage": inputs["advantages"], "sampler_topk_logp": inputs["sampler_topk_logp"]}
    return view, batch


@pytest.mark.parametrize("preset", ["pg", "tis", "sc", "sc+tis", "reinforce-zero"])
def test_each_objective_trains_in_trl_and_its_loss_is_the_objectives(brought, tmp_path, preset):
    trainer = trainer_for(brought, tmp_path, preset)
    seen = capture(trainer)
    before = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    trainer.train()
    assert trainer.state.global_step == 3
    assert any(not torch.equal(v, before[k]) for k, v in trainer.model.state_dict().items())
    logged = {k for entry in trainer.state.log_history for k in entry}
    assert {"driftless/kl_k3", "driftless/ratio_max", "driftless/ratio_ess", "driftless/loss"} <= logged
    if preset.startswith("sc"):
        assert "driftless/sampler_head_mass" in logged
    # the loss of one captured batch, computed independently: the trainer's forward, log p, the objective
    view, batch = rescore(trainer, seen)
    expected, _ = make(preset, **({"top_k": 8} if preset.startswith("sc") else {}))(view, batch)
    assert seen["loss"] == pytest.approx(float(expected), rel=1e-5, abs=1e-6)
    # q was recorded from the generation's own scores: at the same weights it is the trainer's p
    on = batch["action_mask"]
    assert float((view["logp"] - batch["sampler_logp"])[on].abs().max()) < 1e-4


def test_a_sampler_view_makes_kl_positive_and_centering_differ_from_pg(brought, tmp_path):
    losses = {}
    for preset in ("pg", "sc"):
        trainer = trainer_for(brought, tmp_path / preset, preset, sampler_view="noise:0.3")
        seen = capture(trainer)
        trainer.train()
        kl = [entry["driftless/kl_k3"] for entry in trainer.state.log_history if "driftless/kl_k3" in entry]
        assert kl and all(v > 1e-4 for v in kl), kl
        losses[preset] = seen["loss"]
    assert losses["pg"] != pytest.approx(losses["sc"], rel=1e-3)


def test_a_sampling_transform_is_recorded_and_scored_alike(brought, tmp_path):
    trainer = trainer_for(brought, tmp_path, "tis", temperature=0.7, top_k=20)
    seen = capture(trainer)
    trainer.train()
    kl = [entry["driftless/kl_k3"] for entry in trainer.state.log_history if "driftless/kl_k3" in entry]
    assert max(kl) < 1e-5  # q (the generation's processed scores) and p (the same transform on the trainer's logits)
    inputs = seen["inputs"]
    head_mass = inputs["sampler_topk_logp"].exp().sum(-1)[inputs["completion_mask"].bool()]
    assert float(head_mass.max()) <= 1 + 1e-5 and float(head_mass.min()) > 0


@pytest.mark.parametrize("extra,match", [
    ({"objective": "no-such-preset"}, "unknown|no-such-preset"),
    ({"use_vllm": True, "sampler_view": "noise:0.1"}, "with use_vllm=True the engine holds TRL's synced weights"),
    ({"use_vllm": True, "vllm_mode": "colocate", "head_k": 32}, "head_k=32 exceeds the 20 log-probs a token"),
    ({"beta": 0.1}, "beta=0.1 is TRL's reference KL"),
    ({"repetition_penalty": 1.2}, "repetition_penalty / min_p"),
    ({"objective": "sc", "head_k": 4, "objective_params": {"top_k": 8}}, "reads 8 head ids but head_k=4"),
])
def test_settings_it_cannot_honour_are_refused_by_name(brought, tmp_path, extra, match):
    from driftless.integrations.trl import DriftlessGRPOConfig, DriftlessGRPOTrainer

    root, data = brought
    base = {"output_dir": str(tmp_path), "use_cpu": True, "report_to": "none", "bf16": False, "max_steps": 1,
            "per_device_train_batch_size": 4, "num_generations": 4, "objective": "pg"}
    with pytest.raises(ValueError, match=match):
        DriftlessGRPOTrainer(model=str(root / "model"), reward_funcs=length_reward,
                             args=DriftlessGRPOConfig(**{**base, **extra}), train_dataset=data)
