"""The loop on what a user brings: a checkpoint directory in the real format (its own BPE tokenizer, chat
template, generation config) and a data file, through model.kind=hf + task.name=dataset."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

pytest.importorskip("transformers")

from driftless.models.hf_tokenizer import HFTokenizer
from driftless.recipes.make_model import make_model
from driftless.tasks import Countdown, CountdownConfig
from driftless.tasks.export import task_rows, write_jsonl
from driftless.train import Run, build, load_config

SMALL = {"vocab_size": 300, "hidden": 32, "layers": 1, "heads": 2, "kv_heads": 1, "intermediate": 64,
         "max_positions": 64, "sft_steps": 30, "sft_batch": 16, "progress": False}


def length_reward(prompts, completions, **columns):
    """A user reward with spread even before the model solves anything (so every update moves the weights)."""
    assert set(columns) >= {"numbers", "target", "answer", "completion"}
    return [len(c) / 10 for c in completions]


@pytest.fixture(scope="module")
def brought(tmp_path_factory):
    """(checkpoint dir, data dir): what `driftless make-model` and `driftless export-task` write, small."""
    root = tmp_path_factory.mktemp("own")
    task = Countdown(CountdownConfig(2, 1, 12, 100))
    train, held = task_rows(task, "train", draws=2000), task_rows(task, "eval", draws=2000)
    write_jsonl(train, root / "data/train.jsonl")
    write_jsonl(held, root / "data/eval.jsonl")
    make_model(root / "model", rows_train=train, rows_eval=held, **SMALL)
    return root / "model", root / "data"


def config(brought, *extra):
    model, data = brought
    return load_config(None, [
        "model.kind=hf", f"model.hf_path={model}", "model.max_seq_len=64", "task.name=dataset",
        f"task.path={data}/train.jsonl", f"task.eval_path={data}/eval.jsonl", "task.reward=countdown",
        "rollout.prompts_per_step=3", "rollout.group_size=4", "rollout.max_new_tokens=12", "rollout.head_k=8",
        "train.eval_problems=8", "train.progress=false", "train.steps=2", "train.eval_every=2",
        "train.checkpoint_every=2", *extra])


def test_the_checkpoints_own_tokenizer_eos_ids_and_pad(brought):
    model, _ = brought
    tok = HFTokenizer(model)
    generation = json.loads((model / "generation_config.json").read_text())
    assert set(tok.eos_ids) == set(generation["eos_token_id"]) and len(tok.eos_ids) == 2
    assert tok.eos_ids[0] == tok.tok.convert_tokens_to_ids("<|im_end|>")
    assert tok.pad_id == tok.tok.convert_tokens_to_ids("<|endoftext|>")
    cfg = load_config(None, ["model.kind=hf", f"model.hf_path={model}"])
    assert isinstance(build.tokenizer(cfg), HFTokenizer)  # never the character tokenizer for a checkpoint
    text = build.codec(cfg).render([{"role": "user", "content": "3 7=21:"}])
    assert text == "<|im_start|>user\n3 7=21:<|im_end|>\n<|im_start|>assistant\n"
    plain = build.codec(load_config(None, ["model.kind=hf", f"model.hf_path={model}", "task.chat_template=none"]))
    assert plain.render([{"role": "user", "content": "3 7=21:"}]) == "3 7=21:"
    assert tok.decode(tok.encode("<answer>3*7</answer>", bos=False) + [tok.eos_ids[1], 5, 6]) == "<answer>3*7</answer>"


def test_a_run_samples_through_the_chat_template_and_stops_at_the_tokenizers_eos(brought, tmp_path):
    cfg = config(brought, "objective.name=sc+tis", "objective.params={top_k: 8}", "train.trace=true")
    run = Run(cfg, tmp_path / "run")
    run.source.worker.load(run.learner.publish())
    batch, _ = run.source.worker.produce(0)
    eos = set(run.text.eos_ids)
    for ids in batch.completions():
        ends = [i for i, t in enumerate(ids) if t in eos]
        assert ends in ([], [len(ids) - 1])  # an eos id ends the response; nothing after it
        assert ends or len(ids) == cfg.rollout.max_new_tokens
    assert any(batch.completions()[i][-1] in eos for i in range(batch.batch_size))  # the SFT taught it to stop
    prompt = run.text.show(batch.prompts()[0])
    assert prompt.startswith("<|im_start|>user\n") and prompt.endswith("<|im_end|>\n<|im_start|>assistant\n")
    run.run()
    lines = [json.loads(x) for x in (tmp_path / "run/metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines] == [0, 1] and lines[-1]["version"] == 2 and "eval_reward" in lines[-1]
    assert 0 < lines[0]["sampler_head_mass"] < 1  # 8 of 300 tokens: a real approximation
    samples = [json.loads(x) for x in (tmp_path / "run/samples.jsonl").read_text().splitlines()]
    assert len(samples) == 8 and all(s["prompt"].startswith("<|im_start|>user\n") for s in samples)
    from safetensors import safe_open

    with safe_open(str(tmp_path / "run/trace/step_000001.safetensors"), "pt") as f:
        assert all("<|im_start|>assistant\n" in p for p in json.loads(f.metadata()["prompts"]))


@pytest.mark.parametrize("extra", [["objective.name=reinforce-zero"],
                                   ["objective.name=tis", "rollout.runtime=thread", "mismatch.view=noise:0.05"]])
def test_reinforce_zero_and_an_asynchronous_runtime_train_the_checkpoint(brought, tmp_path, extra):
    cfg = config(brought, *extra, "task.reward=test_own_model:length_reward")
    run = Run(cfg, tmp_path / "run")
    before = {k: v.clone() for k, v in run.policy.state_dict().items()}
    run.run()
    lines = [json.loads(x) for x in (tmp_path / "run/metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines] == [0, 1]
    changed = [k for k, v in run.policy.state_dict().items() if not torch.equal(v, before[k])]
    assert changed  # it trained the checkpoint's weights


def test_a_checkpoint_without_a_tokenizer_and_a_context_too_long_are_refused(brought, tmp_path):
    model, _ = brought
    bare = tmp_path / "bare"
    shutil.copytree(model, bare)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (bare / name).unlink()
    with pytest.raises(ValueError, match="has no tokenizer"):
        Run(config((bare, brought[1])), tmp_path / "a")
    with pytest.raises(ValueError, match=r"model.max_seq_len=65 exceeds the checkpoint's context"):
        Run(config(brought, "model.max_seq_len=65"), tmp_path / "b")
    with pytest.raises(ValueError, match=r"row \d+: \d+ prompt tokens leave no room to generate in the context of 8"):
        Run(config(brought, "model.max_seq_len=8", "rollout.max_new_tokens=4"), tmp_path / "c")
    with pytest.raises(ValueError, match="task.name=dataset with model.kind=hf needs model.hf_path"):
        Run(config(brought, "model.hf_path=null"), tmp_path / "d")
