"""A small checkpoint in the real Hugging Face format, built locally: ``driftless make-model DIR``.

A stand-in for "a checkpoint the user brings": a Qwen3 model (``transformers.Qwen3Config``,
about 1.7M parameters at the defaults), a byte-level BPE tokenizer trained here with the
``tokenizers`` package on the task's text (Qwen's pre-tokenizer: one piece per digit, then bytes;
special tokens ``<|endoftext|>`` = pad, ``<|im_start|>``, ``<|im_end|>`` = eos), a ChatML chat
template and ``generation_config.json`` (eos: both ids, as Qwen3's),
warm-started by supervised training on the task's rows so its held-out greedy reward leaves the
RL loop headroom (neither 0 nor near 1). Nothing is downloaded.

    from driftless.recipes.make_model import make_model, countdown_rows
    info = make_model("runs/models/countdown-qwen3")             # built-in Countdown rows
    info = make_model(d, rows_train=rows, rows_eval=held_out)     # rows as driftless.tasks.export writes them

DIR then holds config.json, generation_config.json, model.safetensors, tokenizer.json,
tokenizer_config.json (+ chat_template.jinja where the installed transformers writes the template
there) and ``driftless_make_model.json``: the build's info and ``key``, a SHA-256 of every setting
and of the rows. A second call with the same key reuses DIR untouched; ``force=True`` rebuilds.
The build goes to a temporary sibling directory renamed into place at the end, so a crash never
leaves a half checkpoint.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import random
import shutil
import time
from pathlib import Path

import torch

from driftless.models.hf import HFPolicy
from driftless.rollout import SamplingParams
from driftless.rollout.sampler import Sampler
from driftless.tasks.countdown import Countdown, CountdownConfig, score
from driftless.tasks.export import task_rows
from driftless.train.sft import sft
from driftless.train.warmstart import weights_digest

PAD, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = (PAD, IM_START, IM_END)  # ids 0, 1, 2

# ChatML, as Qwen writes it: every message (a system message only when given) between <|im_start|>ROLE\n and
# <|im_end|>\n; the generation prompt opens the assistant's turn.
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

# Qwen2/3's split (tokenizer.json of Qwen/Qwen3-*): letters, single digits, punctuation, newlines, spaces.
QWEN_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
              r"\s*[\r\n]+|\s+(?!\S)|\s+")
INFO_FILE = "driftless_make_model.json"
CHECKPOINT_FILES = ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
                    "tokenizer_config.json")
# The repository's Countdown defaults (configs/default.yaml): 393 training / 49 held-out distinct prompts.
COUNTDOWN_DEFAULTS = {"n_numbers": 2, "min_number": 1, "max_number": 12, "max_target": 100, "ops": "+-*/"}
# Calibrated on the built-in Countdown rows (2 CPU cores, about 25 s of SFT when the cores are free), held-out
# greedy reward / training-split reward over seeds 0, 1, 2: 0.37 / 0.75, 0.47 / 0.82, 0.37 / 0.68. Longer memorises
# the 393 training prompts (300 steps: train 0.98, 600: 1.00) and leaves RL nothing to learn on them. With
# whole-number tokens (split_digits=False) held-out is lower: 0.22 at 150 steps, 0.29 at 300 and 600.
DEFAULT_STEPS = 150
DEFAULT_LR = 3e-3
# Bump when a build with the same settings would produce other files (tokenizer training, init, loss).
FORMAT_VERSION = 1


def countdown_rows(split: str, *, draws: int = 20_000, seed: int = 0, **task_settings) -> list[dict]:
    """The built-in Countdown problems of ``split`` as rows (the repository's defaults unless overridden)."""
    task = Countdown(CountdownConfig(**{**COUNTDOWN_DEFAULTS, **task_settings}))
    return task_rows(task, split, draws=draws, seed=seed)


def read_jsonl(path: str | Path) -> list[dict]:
    """Rows of a JSONL file (driftless export-task's format); each needs ``prompt`` and ``completion``."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"data file {str(path)!r} does not exist")
    rows = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError as err:
            raise ValueError(f"{path}:{n} is not valid JSON: {err}") from None
    if not rows:
        raise ValueError(f"data file {str(path)!r} holds no rows")
    return rows


def _messages(row: dict, where: str) -> list[dict]:
    if not isinstance(row, dict) or "prompt" not in row or "completion" not in row:
        raise ValueError(f"{where}: a row needs 'prompt' (chat messages or a string) and 'completion', got {row!r:.200}")
    prompt = row["prompt"]
    if isinstance(prompt, str):
        return [{"role": "user", "content": prompt}]
    if not (isinstance(prompt, list) and prompt
            and all(isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                    for m in prompt)):
        raise ValueError(f"{where}: 'prompt' must be a string or a non-empty list of {{role, content}} messages, "
                         f"got {prompt!r:.200}")
    return prompt


def render_chatml(messages: list[dict], add_generation_prompt: bool = True) -> str:
    """What CHAT_TEMPLATE renders (used to train the tokenizer before a tokenizer exists)."""
    text = "".join(f"{IM_START}{m['role']}\n{m['content']}{IM_END}\n" for m in messages)
    return text + (f"{IM_START}assistant\n" if add_generation_prompt else "")


def train_tokenizer(texts: list[str], vocab_size: int, model_max_length: int = 128, *, split_digits: bool = True):
    """A byte-level BPE tokenizer trained on ``texts``, wrapped as a transformers fast tokenizer with
    CHAT_TEMPLATE. The vocabulary stops below ``vocab_size`` when the text has no more pairs to merge."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    if vocab_size < len(alphabet) + len(SPECIAL_TOKENS):
        raise ValueError(f"vocab_size must be >= {len(alphabet) + len(SPECIAL_TOKENS)} (the 256 bytes and the "
                         f"special tokens), got {vocab_size}")
    tok = Tokenizer(models.BPE())
    if split_digits:  # Qwen2/3's own pre-tokenizer: every digit its own piece, then bytes
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(QWEN_SPLIT), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    else:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS),
                                  initial_alphabet=alphabet, show_progress=False)
    # the special tokens are in the vocabulary from the start; train on the text between them
    pieces = []
    for text in texts:
        for special in SPECIAL_TOKENS:
            text = text.replace(special, "\x00")
        pieces.extend(p for p in text.split("\x00") if p)
    tok.train_from_iterator(pieces, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=IM_END, pad_token=PAD,
                                   additional_special_tokens=[IM_START], chat_template=CHAT_TEMPLATE,
                                   clean_up_tokenization_spaces=False, model_max_length=model_max_length)


def _check_tokenizer(tokenizer, texts: list[str]) -> None:
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS}
    if list(ids.values()) != [0, 1, 2]:
        raise RuntimeError(f"special token ids {ids}, expected 0, 1, 2")
    for text in texts:
        back = tokenizer.decode(tokenizer(text, add_special_tokens=False).input_ids)
        if back != text:
            raise RuntimeError(f"the tokenizer does not round-trip {text!r} (decodes to {back!r})")


def _check_saved(path: Path, texts: list[str], messages: list[dict]) -> None:
    """The saved tokenizer reloads with AutoTokenizer, renders ChatML and round-trips the text."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    rendered = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    if rendered != render_chatml(messages):
        raise RuntimeError(f"the saved chat template renders {rendered!r}, expected {render_chatml(messages)!r}")
    if (tok.eos_token, tok.pad_token) != (IM_END, PAD):
        raise RuntimeError(f"the saved tokenizer's eos / pad are {tok.eos_token!r} / {tok.pad_token!r}")
    _check_tokenizer(tok, texts)


def _row_score(row: dict, text: str) -> float:
    """Countdown rows: the task's verifier; other rows (arithmetic): the stripped text equals the answer."""
    if "numbers" in row and "target" in row:
        return score(row["numbers"], row["target"], text)
    return 1.0 if text.strip() == str(row.get("answer", row["completion"])).strip() else 0.0


def _digest(obj) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()


def build_key(settings: dict, rows_train: list[dict], rows_eval: list[dict]) -> str:
    return _digest({"settings": settings, "train": _digest(rows_train), "eval": _digest(rows_eval),
                    "v": FORMAT_VERSION})


def stored_info(out_dir: str | Path) -> dict | None:
    """The info of a complete make-model checkpoint in ``out_dir``; None if it is not one."""
    out_dir = Path(out_dir)
    path = out_dir / INFO_FILE
    if not path.is_file() or not all((out_dir / f).is_file() for f in CHECKPOINT_FILES):
        return None
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError:
        return None


@torch.no_grad()
def greedy_reward(policy, tokenizer, rows: list[dict], *, max_new_tokens: int = 24, batch: int = 256) -> float:
    """Mean reward of greedy completions through driftless's Sampler (prompts rendered with the chat
    template, no special tokens added; stops at <|im_end|>)."""
    if not rows:
        return float("nan")
    eos, pad = tokenizer.convert_tokens_to_ids(IM_END), tokenizer.convert_tokens_to_ids(PAD)
    sampler = Sampler(policy, head_k=0, eos_id=eos, pad_id=pad, version=0)
    total = 0.0
    for start in range(0, len(rows), batch):
        chunk = rows[start:start + batch]
        prompts = [tokenizer(tokenizer.apply_chat_template(_messages(r, "eval rows"), tokenize=False,
                                                           add_generation_prompt=True),
                             add_special_tokens=False).input_ids for r in chunk]
        out = sampler.generate(prompts, SamplingParams(greedy=True), max_new_tokens, seed=0)
        for row, ids in zip(chunk, out.completions()):
            total += _row_score(row, tokenizer.decode(ids, skip_special_tokens=True))
    return total / len(rows)


def _examples(tokenizer, rows: list[dict], max_positions: int) -> list[tuple[list[int], int]]:
    eos = tokenizer.convert_tokens_to_ids(IM_END)
    out = []
    for n, row in enumerate(rows):
        rendered = tokenizer.apply_chat_template(_messages(row, f"training row {n}"), tokenize=False,
                                                 add_generation_prompt=True)
        prompt = tokenizer(rendered, add_special_tokens=False).input_ids
        seq = prompt + tokenizer(row["completion"], add_special_tokens=False).input_ids + [eos]
        if len(seq) > max_positions:
            raise ValueError(f"training row {n} is {len(seq)} tokens; max_positions is {max_positions}")
        out.append((seq, len(prompt)))
    return out


def _batch(examples, pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(s) for s, _ in examples)
    tokens = torch.full((len(examples), width), pad_id, dtype=torch.long)
    mask = torch.zeros(len(examples), width, dtype=torch.bool)  # completion + eos tokens
    for i, (seq, start) in enumerate(examples):
        tokens[i, : len(seq)] = torch.tensor(seq)
        mask[i, start:len(seq)] = True
    return tokens, mask


def _write_atomically(out_dir: Path, write) -> None:
    """``write(tmp_dir)``, then swap tmp_dir in for out_dir (the old one removed only after the swap)."""
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_dir.with_name(f".{out_dir.name}.tmp-{os.getpid()}")
    old = out_dir.with_name(f".{out_dir.name}.old-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        write(tmp)
        if out_dir.exists():
            out_dir.rename(old)
        tmp.rename(out_dir)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    shutil.rmtree(old, ignore_errors=True)


def make_model(
    out_dir: str | Path,
    *,
    rows_train: list[dict] | None = None,
    rows_eval: list[dict] | None = None,
    vocab_size: int = 512,
    hidden: int = 192,
    layers: int = 4,
    heads: int = 3,
    kv_heads: int = 1,
    intermediate: int = 512,
    max_positions: int = 128,
    sft_steps: int = DEFAULT_STEPS,
    sft_batch: int = 64,
    lr: float = DEFAULT_LR,
    weight_decay: float = 0.01,
    max_new_tokens: int = 24,
    seed: int = 0,
    split_digits: bool = True,
    tie_embeddings: bool = False,
    force: bool = False,
    progress: bool = True,
) -> dict:
    """Build (or reuse) the checkpoint in ``out_dir``; returns its info (eval_reward: greedy on rows_eval;
    train_reward: greedy on the first 256 training rows; final_loss, seconds, parameters, vocab_size, key, ...). ``rows_train`` / ``rows_eval``: rows with ``prompt`` and
    ``completion`` (driftless.tasks.export's format); both None: the built-in Countdown rows.
    ``split_digits``: Qwen's pre-tokenizer (each digit a token); False: GPT-2's (whole numbers).
    ``tie_embeddings``: one matrix for the input and output embeddings, as most small real checkpoints (SmolLM2,
    Qwen2.5-0.5B, Qwen3-0.6B, Llama-3.2-1B); off by default (the committed records' stand-in is untied).
    ``force``: rebuild even when ``out_dir`` holds this very build; a directory holding files that no
    make-model build wrote is replaced only with ``force``."""
    import transformers

    if (rows_train is None) != (rows_eval is None):
        raise ValueError("make_model: give both rows_train and rows_eval, or neither (the built-in Countdown rows)")
    if rows_train is None:
        rows_train, rows_eval = countdown_rows("train"), countdown_rows("eval")
    if not rows_train or not rows_eval:
        raise ValueError(f"make_model: rows_train ({len(rows_train)} rows) and rows_eval ({len(rows_eval)} rows) "
                         "must both be non-empty")
    for name, value in (("hidden", hidden), ("layers", layers), ("heads", heads), ("kv_heads", kv_heads),
                        ("intermediate", intermediate), ("max_positions", max_positions), ("sft_steps", sft_steps),
                        ("sft_batch", sft_batch), ("max_new_tokens", max_new_tokens)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"make_model: {name} must be a positive integer, got {value!r}")
    if hidden % heads or heads % kv_heads:
        raise ValueError(f"make_model: need hidden % heads == 0 and heads % kv_heads == 0, got hidden={hidden}, "
                         f"heads={heads}, kv_heads={kv_heads}")
    if not lr > 0:
        raise ValueError(f"make_model: lr must be > 0, got {lr}")
    settings = {"vocab_size": vocab_size, "hidden": hidden, "layers": layers, "heads": heads, "kv_heads": kv_heads,
                "intermediate": intermediate, "max_positions": max_positions, "sft_steps": sft_steps,
                "sft_batch": sft_batch, "lr": lr, "weight_decay": weight_decay, "max_new_tokens": max_new_tokens,
                "seed": seed, "split_digits": split_digits}
    if tie_embeddings:  # only when set: the untied stand-in keeps the key (and so the cache) of the committed records
        settings["tie_embeddings"] = True
    key = build_key(settings, rows_train, rows_eval)
    out_dir = Path(out_dir)
    existing = stored_info(out_dir)
    if not force:
        if existing is not None and existing.get("key") == key:
            if progress:
                print(f"make-model: reusing {out_dir} (same settings and rows; force=True / --force rebuilds)")
            return existing
        if existing is None and out_dir.exists() and any(out_dir.iterdir()):
            raise ValueError(f"{out_dir} is not empty and holds no make-model checkpoint; choose another "
                             "directory or pass --force to replace it")
        if existing is not None and progress:
            print(f"make-model: {out_dir} was built with other settings or rows; rebuilding")

    t0 = time.time()
    train_messages = [_messages(r, f"training row {n}") for n, r in enumerate(rows_train)]
    texts = [render_chatml(m) for m in train_messages] + [r["completion"] for r in rows_train]
    tokenizer = train_tokenizer(texts, vocab_size, max_positions, split_digits=split_digits)
    _check_tokenizer(tokenizer, texts + [render_chatml(_messages(r, "eval row")) for r in rows_eval])
    pad_id, im_end_id = tokenizer.convert_tokens_to_ids(PAD), tokenizer.convert_tokens_to_ids(IM_END)
    examples = _examples(tokenizer, rows_train, max_positions)

    config = transformers.Qwen3Config(
        vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=hidden // heads,
        max_position_embeddings=max_positions, tie_word_embeddings=tie_embeddings, eos_token_id=[im_end_id, pad_id],
        pad_token_id=pad_id, bos_token_id=None,
    )
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    model.generation_config = transformers.GenerationConfig(eos_token_id=[im_end_id, pad_id], pad_token_id=pad_id,
                                                            bos_token_id=None)
    policy = HFPolicy(model)
    n_params = sum(p.numel() for p in policy.parameters())

    opt = torch.optim.AdamW(policy.parameters(), lr=lr, weight_decay=weight_decay, betas=(0.9, 0.95))
    if sft_steps >= 3:  # a 5% warm-up, at least two steps (OneCycleLR divides by the warm-up's length)
        sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=lr, total_steps=sft_steps,
                                                    pct_start=max(0.05, 2 / sft_steps))
    else:
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda _: 1.0)
    rng = random.Random(seed)
    loss_value = sft(policy, opt, sched, lambda: _batch(rng.choices(examples, k=sft_batch), pad_id), sft_steps,
                     desc="make-model SFT", progress=progress)
    if not math.isfinite(loss_value):
        raise RuntimeError(f"make-model: the SFT loss is {loss_value}; lower lr ({lr})")
    train_seconds = time.time() - t0
    eval_reward = greedy_reward(policy, tokenizer, rows_eval, max_new_tokens=max_new_tokens)
    train_reward = greedy_reward(policy, tokenizer, rows_train[:256], max_new_tokens=max_new_tokens)
    info = {
        "key": key, "eval_reward": eval_reward, "train_reward": train_reward, "final_loss": loss_value,
        "seconds": time.time() - t0, "train_seconds": train_seconds, "parameters": n_params,
        "vocab_size": len(tokenizer), "eos_token_id": [im_end_id, pad_id], "pad_token_id": pad_id,
        "train_rows": len(rows_train), "eval_rows": len(rows_eval), "settings": settings,
        "weights_sha256": weights_digest(model), "torch": torch.__version__, "transformers": transformers.__version__, "threads": torch.get_num_threads(),
    }

    def write(tmp: Path) -> None:
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        _check_saved(tmp, texts, train_messages[0])
        (tmp / INFO_FILE).write_text(json.dumps(info, indent=2) + "\n")

    _write_atomically(out_dir, write)
    return info


def build_stand_in(root: str | Path = "runs", *, progress: bool = True, **settings) -> dict:
    """What ``make hf`` builds before training, in ``root``: the built-in Countdown rows as data files
    (``data/countdown/{train,eval}.jsonl``, ``driftless export-task``'s) and the checkpoint made from them
    (``models/countdown-qwen3``, ``driftless make-model``'s defaults; reused when already built). Experiments on
    ``configs/hf.yaml`` (the study's ``drift-bpe-*``) call it first; returns the checkpoint's info."""
    from driftless.tasks.export import write_jsonl

    root = Path(root)
    data = root / "data" / "countdown"
    rows = {}
    for split in ("train", "eval"):
        rows[split] = countdown_rows(split)
        path = data / f"{split}.jsonl"
        if not path.exists() or read_jsonl(path) != rows[split]:
            write_jsonl(rows[split], path)
    return make_model(root / "models" / "countdown-qwen3", rows_train=rows["train"], rows_eval=rows["eval"],
                      progress=progress, **settings)
