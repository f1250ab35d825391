"""task.name=dataset: the user's data file and reward code, on TinyLM (the HF checkpoint path: test_own_model.py)."""

from __future__ import annotations

import json
import math

import pytest
import torch

from driftless.rollout import Sampler, SamplingParams, Snapshot
from driftless.rollout.text import TextCodec, stop_lengths
from driftless.tasks import CharTokenizer
from driftless.tasks.dataset import DatasetTask, hash_split, read_rows
from driftless.tasks.rewards import exact, extract_answer
from driftless.tasks.rewards import math as math_reward
from driftless.train import Run, load_config

CALLS: list[dict] = []  # what user_reward saw (a reward defined in a test file, loaded as "test_dataset_task:...")


def user_reward(prompts, completions, **columns):
    CALLS.append({"prompts": prompts, "completions": completions, **columns})
    return [float(c.strip() == str(a)) for c, a in zip(completions, columns["answer"])]


def raising_reward(prompts, completions, **columns):
    return [1 / 0 if "bad" in str(b) else 0.0 for b in columns["tag"]]


def short_reward(prompts, completions, **columns):
    return [0.0] * (len(completions) - 1)


def nan_reward(prompts, completions, **columns):
    return [math.nan] * len(completions)


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def sums(n=40, offset=0):
    return [{"prompt": [{"role": "user", "content": f"{a}+{a + 1}="}], "answer": str(2 * a + 1), "tag": f"r{a}"}
            for a in range(offset, offset + n)]


# ---------------------------------------------------------------- reading and refusing files
def test_rows_and_columns_come_from_jsonl_json_and_parquet(tmp_path):
    rows = sums(5)
    write_jsonl(tmp_path / "d.jsonl", rows)
    (tmp_path / "d.json").write_text(json.dumps(rows))
    from datasets import Dataset

    Dataset.from_list(rows).to_parquet(str(tmp_path / "d.parquet"))
    for name in ("d.jsonl", "d.json", "d.parquet"):
        got = read_rows(tmp_path / name, "prompt", required=("answer",))
        assert [r.prompt for r in got] == [r["prompt"] for r in rows], name
        assert [r.columns for r in got] == [{"answer": r["answer"], "tag": r["tag"]} for r in rows], name
        assert got[3].where == f"{tmp_path / name} row 3"


def test_jsonl_rows_come_as_written_and_a_bad_line_is_named(tmp_path):
    """A .jsonl file is read line by line: each value as written (no int widened to float because another row has
    a float), every row given every column of the file (None where it has none, as a table has: a reward's keyword
    arguments do not depend on which row comes first), blank lines skipped, a byte-order mark and a JSON list under
    the .jsonl name accepted, and a line that is not JSON named by line and row."""
    path = tmp_path / "d.jsonl"
    path.write_text('\ufeff{"prompt": "1+2=", "answer": 3}\n\n{"prompt": "1.5+2=", "answer": 3.5, "hint": "h"}\n',
                    encoding="utf-8")
    got = read_rows(path, "prompt", required=("answer",))
    assert [r.columns for r in got] == [{"answer": 3, "hint": None}, {"answer": 3.5, "hint": "h"}]
    assert type(got[0].columns["answer"]) is int and got[1].where == f"{path} row 1"
    path.write_text(json.dumps(sums(3), indent=1))  # a JSON document, pretty-printed, under a .jsonl name
    assert [r.columns["answer"] for r in read_rows(path, "prompt")] == ["1", "3", "5"]
    path.write_text('{"prompt": "1+2=", "answer": 3}\n\n{"prompt": "2+2=", "answer": 4\n')
    with pytest.raises(ValueError, match=r"d.jsonl' line 3 \(row 1\) is not JSON"):
        read_rows(path, "prompt")
    path.write_text('{"prompt": "1+2=", "answer": 3\n{"prompt": "2+2=", "answer": 4}\n')
    with pytest.raises(ValueError, match=r"d.jsonl' line 1 \(row 0\) is not JSON"):
        read_rows(path, "prompt")


def test_reading_json_files_and_training_imports_neither_datasets_nor_matplotlib(tmp_path):
    """The learner's process stays lean: a .jsonl or .json task file is read without Hugging Face datasets (pandas,
    pyarrow, scipy: about 150 MB resident), and the train command's report module imports matplotlib only to plot."""
    import subprocess
    import sys

    write_jsonl(tmp_path / "d.jsonl", sums(3))
    (tmp_path / "d.json").write_text(json.dumps(sums(3)))
    code = ("import sys\nfrom driftless.tasks.dataset import read_rows\nimport driftless.train.commands, "
            "driftless.train.report\n"
            f"for name in ('d.jsonl', 'd.json'): assert len(read_rows({str(tmp_path)!r} + '/' + name, 'prompt')) == 3\n"
            "print(sorted(m for m in ('datasets', 'pandas', 'matplotlib', 'scipy') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


@pytest.mark.parametrize("content,match", [
    (None, "does not exist"),
    ("", "has no rows"),
    ('{"prompt": "1+2=", "answer": "3"}\n{"question": "x", "answer": "1"}\n', r"row 1: no column 'prompt'"),
    ('{"prompt": "1+2="}\n', r"row 0: no column 'answer'"),
    ('{"prompt": 7, "answer": "3"}\n', r"row 0 column 'prompt': a prompt must be a string or"),
    ('{"prompt": [{"role": "user"}], "answer": "3"}\n', r"row 0 column 'prompt': message 0 must be"),
    ('{"prompt": [{"role": "robot", "content": "hi"}], "answer": "3"}\n', r"has role 'robot'"),
    ('{"prompt": "", "answer": "3"}\n', "empty string"),
])
def test_bad_files_are_refused_naming_file_row_and_column(tmp_path, content, match):
    path = tmp_path / "data.jsonl"
    if content is not None:
        path.write_text(content)
    with pytest.raises(ValueError, match=match) as err:
        DatasetTask(str(path), answer_key="answer", reward="exact")
    assert "data.jsonl" in str(err.value)


def test_empty_split_and_unknown_format_are_refused(tmp_path):
    write_jsonl(tmp_path / "one.jsonl", sums(1))
    with pytest.raises(ValueError, match="split of 1 rows is empty at task.eval_fraction"):
        DatasetTask(str(tmp_path / "one.jsonl"), answer_key="answer", reward="exact")
    (tmp_path / "d.csv").write_text("prompt\n1+1=\n")
    with pytest.raises(ValueError, match="unknown format '.csv'"):
        DatasetTask(str(tmp_path / "d.csv"), reward="exact", answer_key="prompt")


def test_hash_split_is_disjoint_deterministic_and_keeps_duplicates_together(tmp_path):
    rows = sums(200) + sums(20)  # 20 prompts twice
    write_jsonl(tmp_path / "d.jsonl", rows)
    a = DatasetTask(str(tmp_path / "d.jsonl"), answer_key="answer", reward="exact", eval_fraction=0.2)
    b = DatasetTask(str(tmp_path / "d.jsonl"), answer_key="answer", reward="exact", eval_fraction=0.2)
    train = {json.dumps(r.prompt) for r in a.train}
    held = {json.dumps(r.prompt) for r in a.eval}
    assert not train & held and len(train | held) == 200
    assert [r.index for r in a.eval] == [r.index for r in b.eval]
    assert 20 < len(held) < 60  # about 0.2 of 200
    assert all(hash_split(r.prompt, 0.2) == "eval" for r in a.eval)


def test_reward_settings_are_checked_at_construction(tmp_path):
    write_jsonl(tmp_path / "d.jsonl", sums(30))
    path = str(tmp_path / "d.jsonl")
    with pytest.raises(ValueError, match="needs a reward"):
        DatasetTask(path)
    with pytest.raises(ValueError, match="set task.answer_key"):
        DatasetTask(path, reward="exact")
    with pytest.raises(ValueError, match="unknown reward 'exactly'"):
        DatasetTask(path, reward="exactly")
    with pytest.raises(ValueError, match="has no function 'nope'"):
        DatasetTask(path, reward="test_dataset_task:nope")
    with pytest.raises(ValueError, match="cannot import 'no_such_module_here'"):
        DatasetTask(path, reward="no_such_module_here:f")
    with pytest.raises(ValueError, match="reads the column 'numbers'|no column 'numbers'"):
        DatasetTask(path, reward="countdown")
    with pytest.raises(ValueError, match=r"task.rewards\[1\].weight must be a finite number"):
        DatasetTask(path, answer_key="answer", rewards=[{"name": "exact"}, {"name": "math", "weight": "x"}])


# ---------------------------------------------------------------- rewards
def test_builtin_verifiers():
    assert extract_answer("so <answer> 42 </answer>") == " 42 "
    assert extract_answer("thus \\boxed{\\frac{1}{2}} done") == "\\frac{1}{2}"
    assert exact([None] * 3, ["<answer>Paris.</answer>", "  paris ", "London"], answer=["paris"] * 3) == [1, 1, 0]
    assert math_reward([None] * 4, ["\\boxed{\\frac{1}{2}}", "<answer>0.5</answer>", "\\boxed{3}", "no answer"],
                       answer=["1/2", "1/2", "1/2", "1/2"]) == [1.0, 1.0, 0.0, 0.0]


def test_user_reward_is_called_in_batches_with_every_column(tmp_path):
    write_jsonl(tmp_path / "d.jsonl", sums(30))
    task = DatasetTask(str(tmp_path / "d.jsonl"), answer_key="answer", reward="test_dataset_task:user_reward",
                       eval_fraction=0.3)
    rows = task.train[:3]
    CALLS.clear()
    total, parts = task.score_batch(rows, [rows[0].columns["answer"], "x", " " + rows[2].columns["answer"]])
    assert total == [1.0, 0.0, 1.0] and parts == {"test_dataset_task:user_reward": [1.0, 0.0, 1.0]}
    assert len(CALLS) == 1  # one call for the batch
    assert CALLS[0]["prompts"] == [r.prompt for r in rows]
    assert CALLS[0]["tag"] == [r.columns["tag"] for r in rows]


def test_a_reward_from_a_file_and_weighted_rewards(tmp_path):
    (tmp_path / "my_rewards.py").write_text("def longer(prompts, completions, **kw):\n"
                                            "    return [len(c) / 10 for c in completions]\n")
    write_jsonl(tmp_path / "d.jsonl", sums(30))
    task = DatasetTask(str(tmp_path / "d.jsonl"), answer_key="answer", eval_fraction=0.3,
                       rewards=[{"name": "exact", "weight": 1.0}, {"name": f"{tmp_path}/my_rewards.py:longer",
                                                                    "weight": 0.5}])
    row = task.train[0]
    total, parts = task.score_batch([row, row], [row.columns["answer"], "abcd"])
    longer = [len(row.columns["answer"]) / 10, 0.4]
    assert parts["exact"] == [1.0, 0.0] and parts[f"{tmp_path}/my_rewards.py:longer"] == longer
    assert total == [1.0 + 0.5 * longer[0], 0.5 * 0.4]


@pytest.mark.parametrize("reward,match", [
    ("raising_reward", r"failed on .*d.jsonl row 7 \(completion 'c7'\): ZeroDivisionError"),
    ("short_reward", "returned 2 values for 3 completions"),
    ("nan_reward", r"returned nan for .*row \d+: rewards must be finite"),
])
def test_a_failing_reward_names_the_row(tmp_path, reward, match):
    rows = sums(30)
    rows[7]["tag"] = "bad"
    write_jsonl(tmp_path / "d.jsonl", rows)
    task = DatasetTask(str(tmp_path / "d.jsonl"), eval_path=str(tmp_path / "d.jsonl"),
                       reward=f"test_dataset_task:{reward}")
    with pytest.raises(RuntimeError, match=match):
        task.score_batch(task.train[5:8], ["c5", "c6", "c7"])


# ---------------------------------------------------------------- the text interface
def test_codec_renders_messages_without_a_template_and_refuses_long_prompts():
    system = TextCodec(CharTokenizer(), system_prompt="1=1", context=12, max_new_tokens=4)
    assert system.render([{"role": "user", "content": "2+3="}]) == "1=1\n2+3="
    with pytest.raises(ValueError, match="row 2: task.system_prompt applies to chat-message prompts"):
        system.encode("2+3=", where="row 2")
    with pytest.raises(ValueError, match=r"row 3: characters not in the tokenizer: .*'x'"):
        system.encode([{"role": "user", "content": "x"}], where="row 3")
    codec = TextCodec(CharTokenizer(), context=12, max_new_tokens=4)
    assert codec.encode("2+3=") == CharTokenizer().encode("2+3=")
    assert len(codec.encode("1234567890")) == 11  # fits: the response is cut by the context
    with pytest.raises(ValueError, match=r"row 4: 12 prompt tokens leave no room to generate in the context of 12"):
        codec.encode("12345678901", where="row 4")
    cut = TextCodec(CharTokenizer(), context=12, max_new_tokens=4, truncate=True).encode("12345678901")
    assert cut == CharTokenizer().encode("12345678901")[4:]  # left-truncated to 8, room for 4: the end is kept


def test_several_eos_ids_end_responses_and_stop_strings_cut_them():
    from driftless.models import TinyLM, TinyLMConfig

    model = TinyLM(TinyLMConfig(vocab_size=64, d_model=32, n_layer=1, n_head=1, n_kv_head=1, d_ff=64, max_seq_len=32))
    model.reset_parameters(seed=0)
    prompts = [[1, 5, 6]] * 16
    free = Sampler(model, head_k=4, eos_id=None)
    free.load(Snapshot.of(model, 0))
    batch = free.generate(prompts, SamplingParams(), 12, seed=3)
    seen = [t for row in batch.completions() for t in row]
    two = sorted({seen[0], seen[1]})  # two ids the model does sample
    stopped = Sampler(model, head_k=4, eos_id=two)
    stopped.load(Snapshot.of(model, 0))
    cut = stopped.generate(prompts, SamplingParams(), 12, seed=3)
    for full, row in zip(batch.completions(), cut.completions()):
        first = next((i for i, t in enumerate(full) if t in two), None)  # same seed: the same draws up to it
        assert row == (full if first is None else full[:first + 1])
    codec = TextCodec(CharTokenizer())
    stop = codec.decode([seen[0]])
    lengths = stop_lengths(batch, codec, (stop,))
    short = batch.shorten(lengths)
    for full, row in zip(batch.completions(), short.completions()):
        first = next((i for i, t in enumerate(full) if t == seen[0]), None)
        assert row == (full if first is None else full[:first + 1])
    assert int(short.action_mask.sum()) == int((lengths - batch.prompt_len).sum())
    assert bool((short.version[~short.action_mask] == -1).all())


# ---------------------------------------------------------------- the loop on a data file
TINY = ["model.d_model=32", "model.n_head=1", "model.n_kv_head=1", "model.d_ff=64", "model.n_layer=1",
        "model.max_seq_len=24", "model.warm_start=false", "rollout.prompts_per_step=3", "rollout.group_size=2",
        "rollout.max_new_tokens=4", "rollout.head_k=4", "train.eval_problems=6", "train.progress=false",
        "train.steps=2", "train.eval_every=1", "train.checkpoint_every=1"]


def data_config(tmp_path, *extra):
    write_jsonl(tmp_path / "train.jsonl", sums(30))
    write_jsonl(tmp_path / "eval.jsonl", sums(5, offset=30))
    return load_config(None, [*TINY, "task.name=dataset", f"task.path={tmp_path}/train.jsonl",
                              f"task.eval_path={tmp_path}/eval.jsonl", "task.answer_key=answer", *extra])


def test_a_run_on_a_data_file_calls_the_users_reward_and_shows_what_the_model_saw(tmp_path):
    CALLS.clear()
    cfg = data_config(tmp_path, "task.reward=test_dataset_task:user_reward", "train.trace=true")
    Run(cfg, tmp_path / "run").run()
    lines = [json.loads(x) for x in (tmp_path / "run/metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines] == [0, 1] and all("eval_reward" in r for r in lines)
    train_calls = [c for c in CALLS if len(c["completions"]) == 6]  # 3 prompts x 2 per step
    assert len(train_calls) == 2 and all(set(c) == {"prompts", "completions", "answer", "tag"} for c in train_calls)
    samples = [json.loads(x) for x in (tmp_path / "run/samples.jsonl").read_text().splitlines()]
    assert [s["step"] for s in samples] == [0] * 4 + [1] * 4 + [2] * 4
    assert samples[0]["prompt"] == "30+31="  # no chat template for TinyLM's characters: the content
    from safetensors import safe_open

    with safe_open(str(tmp_path / "run/trace/step_000000.safetensors"), "pt") as f:
        shown = json.loads(f.metadata()["prompts"])
    assert len(shown) == 3 and all(s.endswith("=") and "+" in s for s in shown)


def test_several_rewards_are_logged_each_on_its_own(tmp_path):
    cfg = data_config(tmp_path, "task.rewards=[{name: exact, weight: 1.0}, "
                      "{name: 'test_dataset_task:user_reward', weight: 2.0}]", "train.steps=1")
    Run(cfg, tmp_path / "run").run()
    line = json.loads((tmp_path / "run/metrics.jsonl").read_text().splitlines()[0])
    assert line["reward"] == pytest.approx(line["reward/exact"] + 2 * line["reward/test_dataset_task:user_reward"])


def test_a_reward_failing_mid_run_leaves_nothing_half_written(tmp_path):
    rows = sums(30)
    for r in rows:
        r["tag"] = "bad"
    write_jsonl(tmp_path / "train.jsonl", rows)
    cfg = data_config(tmp_path, "task.reward=test_dataset_task:raising_reward")
    write_jsonl(tmp_path / "train.jsonl", rows)  # data_config rewrote it
    run = Run(cfg, tmp_path / "run")
    with pytest.raises(RuntimeError, match=r"reward 'test_dataset_task:raising_reward' failed on .*train.jsonl row"):
        run.run()
    assert not (tmp_path / "run/metrics.jsonl").read_text().strip()
    assert not (tmp_path / "run/checkpoints").exists() or not any((tmp_path / "run/checkpoints").iterdir())


@pytest.mark.parametrize("extra,match", [
    (["model.warm_start=true"], "TinyLM's warm start trains on the built-in tasks"),
    (["rollout.max_new_tokens=24"], "leaves no room for a prompt"),
    (["task.name=countdown", "task.path=null", "task.eval_path=null", "task.answer_key=null", "task.reward=null"],
     None),
    (["task.name=countdown", "task.eval_path=null", "task.answer_key=null", "task.reward=null"],
     "task.path needs task.name=dataset"),
])
def test_settings_that_cannot_work_together_are_refused_by_name(tmp_path, extra, match):
    cfg = data_config(tmp_path, "task.reward=exact", *extra)
    if match is None:
        Run(cfg, tmp_path / "run")  # builds
        return
    with pytest.raises(ValueError, match=match):
        Run(cfg, tmp_path / "run")


def test_a_prompt_too_long_for_the_context_is_refused_with_its_row_or_truncated(tmp_path):
    rows = sums(30)
    rows[11]["prompt"] = [{"role": "user", "content": "1" * 30}]
    write_jsonl(tmp_path / "train.jsonl", rows)
    cfg = data_config(tmp_path, "task.reward=exact")
    write_jsonl(tmp_path / "train.jsonl", rows)
    with pytest.raises(ValueError, match=r"train.jsonl row 11: 31 prompt tokens leave no room to generate"):
        Run(cfg, tmp_path / "run")
    Run(load_config(None, [*_overrides(cfg), "task.truncate_prompts=true"]), tmp_path / "run")


def _overrides(cfg):
    t = cfg.task
    return [*TINY, "task.name=dataset", f"task.path={t.path}", f"task.eval_path={t.eval_path}",
            "task.answer_key=answer", "task.reward=exact"]


def test_builtin_task_rewards_stay_float32():
    """Rewards arrive as Python floats; the worker's reward tensor is float32 as before (metric lines unchanged)."""
    from driftless.rollout.worker import score_completions
    from driftless.tasks import Arithmetic

    task = Arithmetic(9)
    problems = task.eval_set(3)
    total, parts = score_completions(task, problems, [p.completion for p in problems])
    assert total.dtype == torch.float32 and total.tolist() == [1.0, 1.0, 1.0] and parts == {}


@pytest.mark.parametrize("runtime", ["sync", "thread"])
def test_a_run_reads_the_users_file_once_and_builds_one_tokenizer_and_learner(tmp_path, monkeypatch, runtime):
    """The run builds its parts once (build.Parts) and owns its learner; the source builds neither again."""
    from driftless.train import build
    from driftless.train import sources as sources_module

    counts = {"task": 0, "tokenizer": 0, "learner": 0}

    def counted(name, real):
        def call(*args, **kwargs):
            counts[name] += 1
            return real(*args, **kwargs)
        return call
    for name in counts:
        monkeypatch.setattr(build, name, counted(name, getattr(build, name)))
    cfg = data_config(tmp_path, f"rollout.runtime={runtime}", "task.reward=exact", "train.steps=1")
    run = Run(cfg, tmp_path / "run")
    run.run()
    # the thread runtime's worker samples on its own thread: its own tokenizer, the same task
    assert counts == {"task": 1, "tokenizer": 1 if runtime == "sync" else 2, "learner": 1}
    assert run.source.learner is run.learner and run.source.worker.task is run.task
    assert set(sources_module.SOURCES) == {"sync", "thread", "process", "ray"}
