"""The contracts every policy meets: what the sampler, the scorer and the learner may call.

``Policy``: an ``nn.Module`` with ``vocab_size``, ``max_seq_len``, a differentiable full
forward ``policy(tokens [B, T]) -> logits [B, T, V]``, ``new_cache(B)``,
``prefill(tokens, lengths, cache) -> [B, T, V]`` (right-padded prompts) and
``decode(tokens [B], positions [B], cache) -> [B, V]``. TinyLM and HFPolicy implement it.

``SupportsNumerics``: a policy whose forward numerics can be swapped (fake / native
quantization of its operands, ``driftless.ops.numerics``) through a ``numerics`` attribute.
``SupportsExecution``: a policy with an ``execution`` mode (``fast`` | ``aligned``).
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import torch


@runtime_checkable
class Policy(Protocol):
    vocab_size: int
    max_seq_len: int

    def __call__(self, tokens: torch.Tensor) -> torch.Tensor: ...

    def new_cache(self, batch_size: int) -> Any: ...

    def prefill(self, tokens: torch.Tensor, lengths: torch.Tensor, cache: Any) -> torch.Tensor: ...

    def decode(self, tokens: torch.Tensor, positions: torch.Tensor, cache: Any) -> torch.Tensor: ...


@runtime_checkable
class SupportsNumerics(Protocol):
    numerics: Any


@runtime_checkable
class SupportsExecution(Protocol):
    execution: str
