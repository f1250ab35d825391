"""Policies: the built-in TinyLM (fast and aligned execution) and the transformers adapter.

A policy is an ``nn.Module`` with ``vocab_size``, ``max_seq_len``, ``forward(tokens)`` (full
forward, logits ``[B, T, V]``, differentiable), ``new_cache(B)``, ``prefill(tokens, lengths,
cache)`` and ``decode(tokens, positions, cache)``. The sampler and the trainer use only these.
"""

from driftless.models.io import load_model, save_model
from driftless.models.tiny import EXECUTIONS, KVCache, TinyLM, TinyLMConfig

__all__ = ["EXECUTIONS", "KVCache", "TinyLM", "TinyLMConfig", "load_model", "save_model"]
