"""Supervised fine-tuning, the one loop: the warm start (``train/warmstart.py``) and ``driftless make-model`` both
train with it. Masked next-token cross-entropy on the learned positions (the completion and its end token), the
gradient clipped at norm 1, one optimizer and scheduler step per batch."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from tqdm import tqdm


def sft(model, optimizer, scheduler, next_batch: Callable[[], tuple[torch.Tensor, torch.Tensor]], steps: int, *,
        desc: str = "SFT", progress: bool = True, clip_foreach: bool | None = None) -> float:
    """``steps`` steps on ``next_batch()`` (tokens ``[B, T]`` and the mask of the positions whose tokens are learned);
    the last step's loss. ``clip_foreach``: torch's ``clip_grad_norm_`` choice of kernel (the warm start pins
    False: its bits are recorded)."""
    bar = tqdm(range(steps), desc=desc, disable=not progress, leave=False)
    loss_value = float("nan")
    for _ in bar:
        tokens, mask = next_batch()
        logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1), reduction="none")
        m = mask[:, 1:].reshape(-1).float()
        loss = (loss * m).sum() / m.sum()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, foreach=clip_foreach)
        optimizer.step()
        scheduler.step()
        loss_value = float(loss.detach())
        bar.set_postfix(loss=f"{loss_value:.3f}")
    return loss_value
