"""Policies from a config: the initial weights are made once (warm start), then handed to every part.

``initial_state(config, tokenizer)`` produces the starting weights once: the cached supervised
warm start for TinyLM, a seeded random initialisation otherwise. ``make_policy(config,
tokenizer, state)`` builds a policy from a state dict or a saved file: the learner's and each
rollout worker's own copy. No part ever launches a warm start of its own.
"""

from __future__ import annotations

from pathlib import Path

import torch

from driftless.train.config import RunConfig


def tiny_config(config: RunConfig, vocab_size: int):
    from driftless.models import TinyLMConfig

    m = config.model
    return TinyLMConfig(vocab_size=vocab_size, d_model=m.d_model, n_layer=m.n_layer, n_head=m.n_head,
                        n_kv_head=m.n_kv_head, d_ff=m.d_ff, max_seq_len=m.max_seq_len)


def _hf_source(config: RunConfig, tokenizer):
    from driftless.models.hf import tiny_qwen3_config

    m = config.model
    return m.hf_path or tiny_qwen3_config(vocab_size=tokenizer.vocab_size, max_positions=m.max_seq_len)


def initial_state(config: RunConfig, tokenizer, progress: bool = True) -> tuple[dict, dict | None]:
    """(starting weights, warm-start info or None)."""
    if config.model.kind == "hf":
        from driftless.models.hf import HFPolicy

        torch.manual_seed(config.train.seed)
        return HFPolicy(_hf_source(config, tokenizer)).state_dict(), None
    from driftless.models import TinyLM

    model_config = tiny_config(config, tokenizer.vocab_size)
    if config.model.warm_start:
        from driftless.train.warmstart import warm_start

        ws = config.warm_start
        base, info = warm_start(model_config, config.task.build(), tokenizer, ws.settings(),
                                max_new_tokens=config.rollout.max_new_tokens, cache_dir=ws.cache_dir,
                                progress=progress)
        return base.state_dict(), info
    base = TinyLM(model_config)
    base.reset_parameters(seed=config.train.seed)
    return base.state_dict(), None


def make_policy(config: RunConfig, tokenizer, state: dict | str | Path):
    """A policy of ``config.model`` holding ``state`` (a state dict or a safetensors file)."""
    if isinstance(state, (str, Path)):
        from safetensors.torch import load_file

        state = load_file(str(state))
    if config.model.kind == "hf":
        from driftless.models.hf import HFPolicy

        policy = HFPolicy(_hf_source(config, tokenizer))
    else:
        from driftless.models import TinyLM

        policy = TinyLM(tiny_config(config, tokenizer.vocab_size), execution=config.model.execution)
    policy.load_state_dict(state)
    return policy
