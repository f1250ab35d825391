"""The contracts of an objective's parts, so that new ones compose with the built-in ones.

``Surrogate``: ``(inputs, weight) -> (loss per token [B, L], metrics)``; ``uses_anchor`` says
whether it reads π0 (``inputs.anchor_logp``, the PPO family). ``Penalty``: ``(inputs, head) ->
(loss per token, metrics)``; ``needs_head`` says whether it reads the sampler's top-k head.
Both ``describe()`` their formula. Weights and score centering are single classes
(``Weight``, ``ScoreCentering``) with modes, not protocols.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import torch


@runtime_checkable
class Surrogate(Protocol):
    uses_anchor: bool

    def __call__(self, inp: Any, weight: torch.Tensor) -> tuple[torch.Tensor, dict]: ...

    def describe(self) -> str: ...


@runtime_checkable
class Penalty(Protocol):
    needs_head: bool

    def __call__(self, inp: Any, head: Any) -> tuple[torch.Tensor, dict]: ...

    def describe(self) -> str: ...
