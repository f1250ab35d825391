"""``task.name=dataset``: prompts from the user's file, scored by built-in verifiers or the user's own reward.

    task:
      name: dataset
      path: data/train.jsonl        # JSONL, JSON (a list of objects) or Parquet (read with Hugging Face datasets)
      eval_path: data/eval.jsonl    # or eval_fraction: a deterministic hash split of path
      prompt_key: prompt            # a string or a list of {role, content} messages
      answer_key: answer            # optional; what exact / math compare with
      reward: countdown             # a built-in (countdown, exact, math) or "module:function"
      # rewards: [{name: countdown, weight: 1.0}, {name: "my_rewards:length_penalty", weight: 0.1}]

Every file is read and checked when the task is made, before anything trains: a missing file,
a missing column, an empty split and a malformed prompt are refused naming the file, the row and
the column. At run time a reward that raises, returns the wrong count or a non-finite value fails
the step naming the row (file and row index) and the reward.

The held-out split from ``eval_fraction`` hashes each row's prompt: disjoint from training for any
seed, and a prompt that appears twice is on one side only.
"""

from __future__ import annotations

import hashlib
import json
import math
import random
from dataclasses import dataclass, field
from pathlib import Path

from driftless.tasks import rewards as reward_fns
from driftless.tasks.prompts import check_prompt

FORMATS = {".jsonl": "json", ".json": "json", ".parquet": "parquet"}
RESERVED = {"prompts", "completions", "answer_key"}  # the keywords a reward is called with


@dataclass(frozen=True)
class Row:
    """One row of a data file: its prompt, every other column, and where it came from."""

    prompt: str | list
    columns: dict = field(hash=False, compare=False)
    source: str = ""
    index: int = 0
    completion_key: str | None = None

    @property
    def completion(self) -> str:
        if self.completion_key is None:
            raise ValueError(f"{self.where}: no completion column (set task.completion_key)")
        return self.columns[self.completion_key]

    @property
    def where(self) -> str:
        return f"{self.source} row {self.index}"


def read_rows(path: str | Path, prompt_key: str, *, required: tuple[str, ...] = (),
              completion_key: str | None = None) -> list[Row]:
    """Every row of ``path`` (local files only), checked: the prompt's shape, the required columns."""
    path = Path(path)
    if not path.exists():
        raise ValueError(f"task data file {str(path)!r} does not exist")
    fmt = FORMATS.get(path.suffix.lower())
    if fmt is None:
        raise ValueError(f"task data file {str(path)!r}: unknown format {path.suffix!r}; use .jsonl, .json or .parquet")
    if path.stat().st_size == 0:
        raise ValueError(f"task data file {str(path)!r} has no rows")
    if path.suffix.lower() == ".json":
        records = _json_records(path)
    elif path.suffix.lower() == ".jsonl":
        records = _jsonl_records(path)
    else:
        try:
            from datasets import load_dataset
        except ImportError as err:  # pragma: no cover - exercised only without the extra
            raise ImportError("task.name=dataset needs the datasets package: pip install 'driftless[hf]'") from err
        try:
            records = load_dataset(fmt, data_files=str(path), split="train")
        except Exception as err:  # noqa: BLE001 - datasets / pyarrow raise many kinds; name the file either way
            raise ValueError(f"task data file {str(path)!r} could not be read as {fmt}: {err}") from None
        records = records.to_list()
    if not records:
        raise ValueError(f"task data file {str(path)!r} has no rows")
    names = dict.fromkeys(k for record in records if isinstance(record, dict) for k in record)
    records = [{k: record.get(k) for k in names} if isinstance(record, dict) else record for record in records]
    rows = []  # (every row has every column of the file, None where it has none: a table's columns, as a reward sees them)
    for i, record in enumerate(records):
        where = f"{path} row {i}"
        if not isinstance(record, dict):
            raise ValueError(f"{where}: a row must be an object with named columns, got {record!r}")
        for key in (prompt_key, *required, *([completion_key] if completion_key else [])):
            if key not in record or record[key] is None:
                raise ValueError(f"{where}: no column {key!r} (columns: {', '.join(sorted(record))})")
        clash = sorted(set(record) & RESERVED - {prompt_key})
        if clash:
            raise ValueError(f"{where}: column {clash[0]!r} clashes with a reward argument of that name "
                             f"({', '.join(sorted(RESERVED))}); rename it")
        prompt = check_prompt(record[prompt_key], f"{where} column {prompt_key!r}")
        columns = {k: v for k, v in record.items() if k != prompt_key}
        rows.append(Row(prompt, columns, str(path), i, completion_key))
    return rows


def _jsonl_records(path: Path) -> list:
    """A .jsonl file: one JSON value a line (blank lines skipped; a whole-file JSON list accepted too), each value
    as written (no types unified across rows, as a table loader such as ``datasets`` does), read without importing
    ``datasets`` with its pandas, pyarrow and scipy (about 150 MB resident in the learner's process)."""
    records = []
    with path.open(encoding="utf-8-sig") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError as err:
                if not records:  # a JSON document (a list of objects) under a .jsonl name
                    try:
                        return _json_records(path)
                    except ValueError:
                        pass
                raise ValueError(f"task data file {str(path)!r} line {number} (row {len(records)}) is not "
                                 f"JSON: {err}") from None
    return records


def _json_records(path: Path) -> list:
    """A .json file: a list of objects (or JSON Lines under a .json name)."""
    text = path.read_text(encoding="utf-8-sig")
    try:
        data = json.loads(text)
    except json.JSONDecodeError:
        try:
            return [json.loads(line) for line in text.splitlines() if line.strip()]
        except json.JSONDecodeError as err:
            raise ValueError(f"task data file {str(path)!r} is neither JSON nor JSON Lines: {err}") from None
    if isinstance(data, dict) and len(data) == 1 and isinstance(next(iter(data.values())), list):
        data = next(iter(data.values()))  # {"data": [...]}, the other common layout
    if not isinstance(data, list):
        raise ValueError(f"task data file {str(path)!r} must hold a list of objects")
    return data


def hash_split(prompt, eval_fraction: float) -> str:
    key = json.dumps(prompt, sort_keys=True, ensure_ascii=False).encode()
    u = int.from_bytes(hashlib.sha256(key).digest()[:8], "big") / 2**64
    return "eval" if u < eval_fraction else "train"


@dataclass(frozen=True)
class RewardSpec:
    name: str
    weight: float = 1.0


def reward_specs(reward: str | None, rewards: list | None) -> list[RewardSpec]:
    """``task.reward`` (one) or ``task.rewards`` (several, with weights) as a checked list."""
    if reward and rewards:
        raise ValueError("set task.reward (one) or task.rewards (several with weights), not both")
    if not reward and not rewards:
        raise ValueError("task.name=dataset needs a reward: task.reward (countdown, exact, math or "
                         "'module:function') or task.rewards: [{name, weight}]")
    if reward:
        return [RewardSpec(reward)]
    out = []
    for i, item in enumerate(rewards):
        if isinstance(item, str):
            item = {"name": item}
        if not isinstance(item, dict) or "name" not in item or set(item) - {"name", "weight"}:
            raise ValueError(f"task.rewards[{i}] must be {{name, weight}}, got {item!r}")
        weight = item.get("weight", 1.0)
        if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not math.isfinite(weight):
            raise ValueError(f"task.rewards[{i}].weight must be a finite number, got {weight!r}")
        out.append(RewardSpec(str(item["name"]), float(weight)))
    names = [r.name for r in out]
    if len(set(names)) != len(names):
        raise ValueError(f"task.rewards names a reward twice: {names}")
    return out


class DatasetTask:
    name = "dataset"

    def __init__(self, path: str, *, prompt_key: str = "prompt", answer_key: str | None = None,
                 eval_path: str | None = None, eval_fraction: float = 0.1, reward: str | None = None,
                 rewards: list | None = None, completion_key: str | None = None):
        if not path:
            raise ValueError("task.name=dataset needs task.path (a .jsonl, .json or .parquet file)")
        if not 0 < eval_fraction < 1:
            raise ValueError(f"task.eval_fraction must be in (0, 1), got {eval_fraction}")
        self.specs = reward_specs(reward, rewards)
        self.fns = {s.name: reward_fns.load(s.name) for s in self.specs}
        self.answer_key = answer_key
        needs_answer = [s.name for s in self.specs if s.name in ("exact", "math")]
        if needs_answer and not answer_key:
            raise ValueError(f"task.reward {needs_answer[0]!r} compares with a reference answer: set task.answer_key")
        required = tuple(c for s in self.specs if s.name == "countdown" for c in ("numbers", "target"))
        required += (answer_key,) if answer_key else ()
        rows = read_rows(path, prompt_key, required=required, completion_key=completion_key)
        if eval_path:
            self.train = rows
            self.eval = read_rows(eval_path, prompt_key, required=required, completion_key=completion_key)
        else:
            self.train = [r for r in rows if hash_split(r.prompt, eval_fraction) == "train"]
            self.eval = [r for r in rows if hash_split(r.prompt, eval_fraction) == "eval"]
            for split, part in (("training", self.train), ("held-out", self.eval)):
                if not part:
                    raise ValueError(f"task.path {path!r}: the {split} split of {len(rows)} rows is empty at "
                                     f"task.eval_fraction={eval_fraction}; change it or give task.eval_path")
        self.config = {"path": str(path), "eval_path": eval_path, "prompt_key": prompt_key, "answer_key": answer_key,
                       "eval_fraction": eval_fraction, "rewards": [vars(s) for s in self.specs],
                       "completion_key": completion_key}

    def rows(self, split: str) -> list[Row]:
        if split not in ("train", "eval"):
            raise ValueError(f"split must be 'train' or 'eval', got {split!r}")
        return self.train if split == "train" else self.eval

    def sample(self, n: int, rng: random.Random, split: str = "train") -> list[Row]:
        rows = self.rows(split)
        return [rows[rng.randrange(len(rows))] for _ in range(n)]

    def eval_set(self, n: int, seed: int = 1234) -> list[Row]:
        """Every held-out row when there are at most ``n``, else ``n`` of them drawn without replacement."""
        if n >= len(self.eval):
            return list(self.eval)
        return random.Random(seed).sample(self.eval, n)

    def score(self, row: Row, completion: str) -> float:
        return self.score_batch([row], [completion])[0][0]

    def score_batch(self, rows: list[Row], completions: list[str]) -> tuple[list[float], dict[str, list[float]]]:
        """(weighted total per row, each reward's own values); a failing reward names its row."""
        parts = {}
        for spec in self.specs:
            parts[spec.name] = self._call(spec.name, rows, completions)
        total = [sum(s.weight * parts[s.name][i] for s in self.specs) for i in range(len(rows))]
        return total, parts

    def _call(self, name: str, rows: list[Row], completions: list[str]) -> list[float]:
        fn = self.fns[name]
        kwargs = {"answer_key": self.answer_key} if name in ("exact", "math") else {}
        try:
            values = fn(prompts=[r.prompt for r in rows], completions=completions, **_columns(rows), **kwargs)
        except Exception as err:
            for row, completion in zip(rows, completions):  # find the row it fails on
                try:
                    fn(prompts=[row.prompt], completions=[completion], **_columns([row]), **kwargs)
                except Exception as row_err:
                    raise RuntimeError(f"reward {name!r} failed on {row.where} (completion {completion!r}): "
                                       f"{type(row_err).__name__}: {row_err}") from row_err
            raise RuntimeError(f"reward {name!r} failed on a batch of {len(rows)} rows (each alone passes): "
                               f"{type(err).__name__}: {err}") from err
        try:
            values = [float(v) for v in values]
        except (TypeError, ValueError) as err:
            raise RuntimeError(f"reward {name!r} must return a list of numbers, got {values!r:.200}") from err
        if len(values) != len(rows):
            raise RuntimeError(f"reward {name!r} returned {len(values)} values for {len(rows)} completions")
        for row, v in zip(rows, values):
            if not math.isfinite(v):
                raise RuntimeError(f"reward {name!r} returned {v} for {row.where}: rewards must be finite")
        return values


def _columns(rows: list[Row]) -> dict[str, list]:
    names = list(rows[0].columns) if rows else []
    return {k: [r.columns.get(k) for r in rows] for k in names}
