"""TRL's colocated vLLM engine on the real checkpoint (SmolLM2-135M-Instruct, `make real`): driftless's sc+tis in
`DriftlessGRPOTrainer` with `use_vllm=True, vllm_mode="colocate"`. Runs under ``make test-vllm`` in a process of its
own (vLLM's process-wide parallel groups outlive an engine); elsewhere skipped, and with DRIFTLESS_REQUIRE_VLLM=1 a
missing package or model is a failure."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch

if os.environ.get("DRIFTLESS_REQUIRE_VLLM") != "1":
    pytest.importorskip("vllm", reason="vLLM is not installed here: `make test-vllm` runs these")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

from test_trl import capture, rescore

from driftless.objectives import make

MODEL = Path(os.environ.get("DRIFTLESS_REAL_MODEL", "runs/models/smollm2-135m-instruct"))
DATA = Path("runs/data/arithmetic-question")
HEAD = 20  # vLLM's default max_logprobs, which TRL's colocated engine keeps


@pytest.fixture(scope="module")
def brought():
    if not (MODEL / "import.json").exists() or not (DATA / "train.jsonl").exists():
        if os.environ.get("DRIFTLESS_REQUIRE_VLLM") == "1":
            pytest.fail(f"{MODEL} or {DATA} missing: run `make real` first (make test-vllm does)")
        pytest.skip(f"{MODEL} missing: `make real` imports it")
    from datasets import Dataset
    from transformers import AutoTokenizer

    sys.path.insert(0, str(Path("examples").resolve()))
    from arithmetic_reward import final_number

    rows = [json.loads(x) for x in (DATA / "train.jsonl").read_text().splitlines()[:8]]
    data = Dataset.from_list([{"prompt": r["prompt"], "answer": r["answer"]} for r in rows])

    def reward(prompts, completions, answer, **_):
        return final_number(prompts, [c[0]["content"] if isinstance(c, list) else c for c in completions], answer)

    return data, reward, AutoTokenizer.from_pretrained(MODEL, local_files_only=True)


def config(tmp_path, head_k):
    from driftless.integrations.trl import DriftlessGRPOConfig

    return DriftlessGRPOConfig(
        output_dir=str(tmp_path / "trl"), use_cpu=True, report_to="none", bf16=False, fp16=False,
        gradient_checkpointing=False, per_device_train_batch_size=8, num_generations=4, max_completion_length=8,
        max_steps=2, logging_steps=1, save_strategy="no", learning_rate=1e-5, seed=0, dataloader_num_workers=0,
        objective="sc+tis", objective_params={"top_k": head_k}, head_k=head_k, use_vllm=True, vllm_mode="colocate",
        vllm_max_model_length=512, vllm_gpu_memory_utilization=0.1)


def test_a_head_wider_than_the_colocated_engine_returns_is_refused_by_name(brought, tmp_path):
    from driftless.integrations.trl import DriftlessGRPOTrainer

    data, reward, tok = brought
    with pytest.raises(ValueError, match=r"head_k=32 exceeds the 20 log-probs .* use head_k <= 20"):
        DriftlessGRPOTrainer(model=str(MODEL), reward_funcs=reward, args=config(tmp_path, 32), train_dataset=data,
                             processing_class=tok)


def test_sc_tis_in_trl_with_colocated_vllm_trains_the_tied_real_checkpoint(brought, tmp_path):
    """Two steps: the tied matrix trains and stays tied; the head is the engine's top-20 of 49,152 (sorted, the
    sampled token's log q read by its id); q is the bfloat16 engine's, close to the float32 trainer's p; the loss is
    the objective on the captured tensors; step 2 was sampled from step 1's weights (the sync reached the engine)."""
    from driftless.integrations.trl import DriftlessGRPOTrainer

    data, reward, tok = brought
    trainer = DriftlessGRPOTrainer(model=str(MODEL), reward_funcs=reward, args=config(tmp_path, HEAD),
                                   train_dataset=data, processing_class=tok)
    assert trainer.vllm_generation.logprobs == HEAD
    # TRL builds the engine with vLLM's dtype "auto": the checkpoint's bfloat16, against the float32 trainer
    assert trainer.vllm_generation.llm.llm_engine.model_config.dtype == torch.bfloat16
    model = trainer.model
    before = model.get_input_embeddings().weight.detach().clone()
    seen = capture(trainer)
    trainer.train()
    assert trainer.state.global_step == 2
    assert model.get_output_embeddings().weight is model.get_input_embeddings().weight
    assert not torch.equal(before, model.get_input_embeddings().weight)
    logged = [e for e in trainer.state.log_history if "driftless/sampler_head_mass" in e]
    assert len(logged) == 2 and all(0.5 < e["driftless/sampler_head_mass"] < 1 for e in logged)
    # measured on a 2-core AMD EPYC: k3 9.3e-4 and 3.5e-3 (the bfloat16 engine's disagreement)
    assert all(0 < e["driftless/kl_k3"] < 0.05 for e in logged)

    inputs = seen["inputs"]
    mask = inputs["completion_mask"].bool()
    ids, head, logq = inputs["sampler_topk_ids"], inputs["sampler_topk_logp"], inputs["sampling_per_token_logps"]
    assert ids.shape == (*mask.shape, HEAD) and int(ids.max()) < 49152
    assert bool((head[mask][:, :-1] >= head[mask][:, 1:]).all())
    in_head = (ids == inputs["completion_ids"][..., None]) & mask[..., None]
    assert bool(in_head.any())
    assert torch.equal(head[in_head], logq[..., None].expand_as(head)[in_head])
    view, batch = rescore(trainer, seen)
    gap = (view["logp"] - logq)[mask].abs()
    assert float(gap.mean()) < 0.1 and float(gap.max()) < 0.5, (float(gap.mean()), float(gap.max()))  # 0.030, 0.14
    expected, _ = make("sc+tis", top_k=HEAD)(view, batch)
    # rel 1e-4: the rescoring forward is another float32 forward of 30 layers (measured 1.6e-5 apart)
    assert seen["loss"] == pytest.approx(float(expected), rel=1e-4)

    last = seen["last"]
    mask, logq = last["inputs"]["completion_mask"].bool(), last["inputs"]["sampling_per_token_logps"]
    synced, _ = rescore(trainer, last)
    stale, _ = rescore(trainer, {**last, "state": seen["state"]})
    gap_synced = float((synced["logp"] - logq)[mask].abs().mean())
    gap_stale = float((stale["logp"] - logq)[mask].abs().mean())
    print(f"step 2: mean |log p - log q| {gap_synced:.4f} at the synced weights, {gap_stale:.4f} at the old ones")
    assert gap_stale > 1.5 * gap_synced, (gap_synced, gap_stale)
