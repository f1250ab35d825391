"""driftless make-model / export-task: a real-format Hugging Face checkpoint built locally, and the task as JSONL."""

from __future__ import annotations

import json
import random

import pytest

pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

from driftless.cli import main
from driftless.recipes.make_model import (
    INFO_FILE,
    greedy_reward,
    make_model,
    read_jsonl,
    render_chatml,
)
from driftless.tasks import Countdown, CountdownConfig, score
from driftless.tasks.export import task_rows

TINY = {"vocab_size": 300, "hidden": 32, "layers": 1, "heads": 2, "kv_heads": 1, "intermediate": 64,
        "sft_steps": 60, "sft_batch": 16, "lr": 1e-2, "progress": False}
FILES = {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
         INFO_FILE}


def _rows():
    task = Countdown(CountdownConfig(n_numbers=2, min_number=1, max_number=12, max_target=100))
    return task_rows(task, "train", draws=2000, limit=8), task_rows(task, "eval", draws=2000, limit=8)


def _mtimes(path):
    return {p.name: p.stat().st_mtime_ns for p in path.iterdir()}


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    train, held_out = _rows()
    out = tmp_path_factory.mktemp("mm") / "model"
    info = make_model(out, rows_train=train, rows_eval=held_out, **TINY)
    return out, info, train, held_out


def test_the_directory_is_a_real_format_checkpoint(built):
    out, info, _, _ = built
    assert FILES <= {p.name for p in out.iterdir()}
    assert not [p for p in out.parent.iterdir() if p.name != "model"]  # the temporary build directory is gone
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "qwen3" and config["architectures"] == ["Qwen3ForCausalLM"]
    assert (config["hidden_size"], config["num_hidden_layers"], config["num_attention_heads"],
            config["num_key_value_heads"], config["head_dim"], config["intermediate_size"]) == (32, 1, 2, 1, 16, 64)
    assert config["eos_token_id"] == [2, 0] and config["pad_token_id"] == 0 and config["tie_word_embeddings"] is False
    generation = json.loads((out / "generation_config.json").read_text())
    assert generation["eos_token_id"] == [2, 0] and generation["pad_token_id"] == 0
    stored = json.loads((out / INFO_FILE).read_text())
    assert stored == info and len(info["key"]) == 64
    assert info["train_rows"] == 8 and info["eval_rows"] == 8 and info["eos_token_id"] == [2, 0]
    assert info["vocab_size"] == config["vocab_size"]
    assert info["train_reward"] == 1.0  # 8 rows, 60 steps: memorised (so the reload check below means something)


def test_transformers_loads_it_and_the_tokenizer_speaks_chatml(built):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out, info, train, held_out = built
    tok = AutoTokenizer.from_pretrained(str(out), local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(str(out), local_files_only=True)
    assert type(model).__name__ == "Qwen3ForCausalLM"
    assert sum(p.numel() for p in model.parameters()) == info["parameters"]
    assert len(tok) == info["vocab_size"] == model.config.vocab_size
    assert tok.convert_tokens_to_ids(["<|endoftext|>", "<|im_start|>", "<|im_end|>"]) == [0, 1, 2]
    assert (tok.eos_token, tok.eos_token_id, tok.pad_token, tok.pad_token_id) == ("<|im_end|>", 2, "<|endoftext|>", 0)
    messages = [{"role": "user", "content": "3 7=21:"}]
    assert tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == \
        "<|im_start|>user\n3 7=21:<|im_end|>\n<|im_start|>assistant\n"
    assert tok.apply_chat_template(messages, tokenize=False) == "<|im_start|>user\n3 7=21:<|im_end|>\n"
    with_system = [{"role": "system", "content": "Be brief."}, *messages]
    assert tok.apply_chat_template(with_system, tokenize=False, add_generation_prompt=True) == \
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n3 7=21:<|im_end|>\n<|im_start|>assistant\n"
    rendered = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    ids = tok(rendered, add_special_tokens=False).input_ids
    assert ids[0] == 1 and ids.count(1) == 2 and ids.count(2) == 1  # the special tokens are single ids
    assert tok.convert_ids_to_tokens(tok("12 7=84:", add_special_tokens=False).input_ids)[:2] == ["1", "2"]
    for row in train + held_out:  # every task text round-trips
        for text in (render_chatml(row["prompt"]), row["completion"], "<answer>(12-3)*10/5</answer>"):
            assert tok.decode(tok(text, add_special_tokens=False).input_ids) == text
    assert tok.decode(tok("<answer>3*7</answer>").input_ids + [2], skip_special_tokens=True) == "<answer>3*7</answer>"


def test_the_saved_weights_are_the_trained_ones(built):
    from transformers import AutoTokenizer

    from driftless.models.hf import HFPolicy

    out, info, train, held_out = built
    policy, tok = HFPolicy(out), AutoTokenizer.from_pretrained(str(out), local_files_only=True)
    assert greedy_reward(policy, tok, train) == info["train_reward"] == 1.0
    assert greedy_reward(policy, tok, held_out) == info["eval_reward"]


def test_a_second_call_reuses_and_force_rebuilds(built, capsys):
    out, info, train, held_out = built
    before = _mtimes(out)
    kwargs = {**TINY, "progress": True}
    assert make_model(out, rows_train=train, rows_eval=held_out, **kwargs) == info
    assert "reusing" in capsys.readouterr().out
    assert _mtimes(out) == before
    weights = (out / "model.safetensors").read_bytes()
    rebuilt = make_model(out, rows_train=train, rows_eval=held_out, force=True, **TINY)
    after = _mtimes(out)
    assert set(after) == set(before) and all(after[name] != before[name] for name in FILES)
    assert rebuilt["key"] == info["key"] and rebuilt["train_reward"] == info["train_reward"]
    assert (out / "model.safetensors").read_bytes() == weights  # deterministic: same seed, same weights


def test_other_settings_rebuild_and_a_foreign_directory_is_kept(tmp_path, capsys):
    train, held_out = _rows()
    small = {**TINY, "sft_steps": 3}
    out = tmp_path / "m"
    first = make_model(out, rows_train=train, rows_eval=held_out, **small)
    second = make_model(out, rows_train=train, rows_eval=held_out, **{**small, "progress": True, "seed": 1})
    assert "rebuilding" in capsys.readouterr().out
    assert second["key"] != first["key"] and json.loads((out / INFO_FILE).read_text())["settings"]["seed"] == 1
    foreign = tmp_path / "theirs"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match="holds no make-model checkpoint"):
        make_model(foreign, rows_train=train, rows_eval=held_out, **small)
    assert [p.name for p in foreign.iterdir()] == ["notes.txt"]
    make_model(foreign, rows_train=train, rows_eval=held_out, force=True, **small)
    assert FILES <= {p.name for p in foreign.iterdir()} and not (foreign / "notes.txt").exists()
    with pytest.raises(ValueError, match="both rows_train and rows_eval"):
        make_model(tmp_path / "x", rows_train=train, **small)
    with pytest.raises(ValueError, match="hidden % heads"):
        make_model(tmp_path / "x", rows_train=train, rows_eval=held_out, **{**small, "hidden": 33})
    assert not (tmp_path / "x").exists()


def _printed_counts(text: str) -> dict:
    counts = {}
    for line in text.splitlines():
        split, rest = line.split(": ", 1)
        n, path = rest.split(" rows -> ")
        counts[split] = (int(n), path)
    return counts


def test_export_task_writes_the_splits_it_prints(tmp_path, capsys):
    assert main(["export-task", str(tmp_path / "cd"), "--draws", "5000"]) == 0
    counts = _printed_counts(capsys.readouterr().out)
    assert set(counts) == {"train", "eval"}
    rows = {split: read_jsonl(path) for split, (_, path) in counts.items()}
    assert counts["train"][1] == str(tmp_path / "cd" / "train.jsonl")
    assert {split: len(r) for split, r in rows.items()} == {split: n for split, (n, _) in counts.items()}
    assert counts["train"][0] == 393 and counts["eval"][0] == 49  # the repository's defaults: every problem
    for r in rows["train"] + rows["eval"]:
        assert set(r) == {"prompt", "completion", "answer", "numbers", "target"}
        assert r["prompt"][0]["role"] == "user" and score(r["numbers"], r["target"], r["completion"]) == 1.0
    assert not {r["prompt"][0]["content"] for r in rows["train"]} & {r["prompt"][0]["content"] for r in rows["eval"]}

    assert main(["export-task", str(tmp_path / "ar"), "task.name=arithmetic", "--limit", "7"]) == 0
    counts = _printed_counts(capsys.readouterr().out)
    assert {split: n for split, (n, _) in counts.items()} == {"train": 7, "eval": 7}
    first = read_jsonl(tmp_path / "ar" / "train.jsonl")[0]
    a, b = map(int, first["prompt"][0]["content"].rstrip("=").split("+"))
    assert first["completion"] == first["answer"] == str(a + b)


def test_make_model_cli_trains_on_exported_files(tmp_path, capsys):
    assert main(["export-task", str(tmp_path / "data"), "--limit", "8"]) == 0
    capsys.readouterr()
    args = ["make-model", str(tmp_path / "m"), "model.d_model=32", "model.n_layer=1", "model.n_head=2", "model.d_ff=64",
            "--data", str(tmp_path / "data" / "train.jsonl"), "--eval-data", str(tmp_path / "data" / "eval.jsonl"),
            "--steps", "3", "--vocab-size", "300", "--seed", "3", "--no-progress"]
    assert main(args) == 0
    printed = json.loads(capsys.readouterr().out.splitlines()[0])
    stored = json.loads((tmp_path / "m" / INFO_FILE).read_text())
    assert printed == {k: v for k, v in stored.items() if k != "settings"}
    assert stored["settings"]["sft_steps"] == 3 and stored["settings"]["seed"] == 3 and stored["train_rows"] == 8
    assert main(args[:8] + ["--no-progress"]) == 2  # --data without --eval-data
    assert "--eval-data" in capsys.readouterr().err
    assert main([*args[:2], "rollout.lag=1", *args[2:]]) == 2  # train's keys, the architecture's only
    assert "make-model: rollout.lag is a config key this command does not take; it takes model.d_model" in capsys.readouterr().err
    assert main([*args[:2], "model.d_modl=32", *args[2:]]) == 2
    assert "did you mean model.d_model" in capsys.readouterr().err


def test_rows_of_other_shapes(tmp_path):
    """String prompts are user messages; rows without numbers/target are scored by their answer."""
    rng = random.Random(0)
    rows = [{"prompt": f"{a}+{b}=", "completion": str(a + b)} for a, b in
            ((rng.randint(0, 9), rng.randint(0, 9)) for _ in range(6))]
    info = make_model(tmp_path / "m", rows_train=rows, rows_eval=rows, **TINY)
    assert info["train_reward"] == info["eval_reward"] == 1.0
    with pytest.raises(ValueError, match="'prompt'"):
        make_model(tmp_path / "n", rows_train=[{"completion": "1"}], rows_eval=rows, **TINY)


def test_the_stand_in_is_built_where_configs_hf_yaml_reads_it_and_the_bpe_study_loads(tmp_path, monkeypatch):
    from driftless.recipes.make_model import build_stand_in, countdown_rows, read_jsonl
    from driftless.recipes.study import CLAIMS, STUDY_DIR
    from driftless.recipes.sweep import load_experiment

    small = {**TINY, "sft_steps": 2}  # the build and its paths are under test, not what SFT teaches
    info = build_stand_in(tmp_path / "runs", **small)
    assert read_jsonl(tmp_path / "runs/data/countdown/train.jsonl") == countdown_rows("train")
    assert read_jsonl(tmp_path / "runs/data/countdown/eval.jsonl") == countdown_rows("eval")
    assert build_stand_in(tmp_path / "runs", **small) == info  # the same build: reused
    monkeypatch.chdir(tmp_path)  # configs/hf.yaml's paths are relative to where driftless runs
    for claim in [c for c in CLAIMS if c.stand_in]:
        exp = load_experiment(STUDY_DIR / f"{claim.name}.yaml")  # checks every trial against the checkpoint
        cfg = exp.config(exp.trials()[0])
        assert cfg.model.kind == "hf" and cfg.model.hf_path == "runs/models/countdown-qwen3"
        # what test_every_study_experiment_loads asks of every other claim
        assert len(exp.grid["train.seed"]) >= 3 and exp.reference is not None
        assert set(claim.by) <= {"variant", *exp.grid}
