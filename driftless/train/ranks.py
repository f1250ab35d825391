"""Learner ranks: data-parallel training on torch.distributed (``train.learner_ranks``, launched by torchrun).

    torchrun --nproc-per-node 2 -m driftless train configs/default.yaml train.learner_ranks=2

Every rank holds the whole model and the whole batch (each rank samples it with the same seeds,
so the batches are the same bits: checked every step by an all-reduced digest) and trains on its
share of the rows, balanced by tokens. The gradient is summed across ranks (``SUM``, never gloo's
``AVG``: FSDP2 summed instead of averaging on gloo, pytorch #162338) with every denominator the whole
batch's (``Totals``), so the summed gradient is the one-process gradient. The metrics come from
every rank's detached log-probabilities, gathered. Rank 0 evaluates, logs and checkpoints.

The process group's backend is ``cpu:gloo,cuda:nccl`` (``gloo`` on a build without NCCL); every rank issues the same collectives in
the same order (a rank with no rows still all-reduces a zero gradient).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch


@dataclass
class Ranks:
    rank: int = 0
    world: int = 1

    @property
    def distributed(self) -> bool:
        return self.world > 1

    @classmethod
    def from_env(cls, expected: int) -> Ranks:
        """The ranks torchrun started (WORLD_SIZE / RANK), checked against ``train.learner_ranks``."""
        world = int(os.environ.get("WORLD_SIZE", "1"))
        if world != expected:
            raise ValueError(f"train.learner_ranks={expected} but this process was started with WORLD_SIZE={world}: "
                             f"launch with torchrun --nproc-per-node {expected} -m driftless train ...")
        if world == 1:
            return cls()
        import torch.distributed as dist

        if not dist.is_initialized():
            cuda = torch.cuda.is_available() and dist.is_nccl_available()
            dist.init_process_group(backend="cpu:gloo,cuda:nccl" if cuda else "gloo")
        return cls(dist.get_rank(), dist.get_world_size())

    # ------------------------------------------------------------------ collectives
    def sum_(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.distributed:
            import torch.distributed as dist

            dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
        return tensor

    def gather(self, obj) -> list:
        if not self.distributed:
            return [obj]
        import torch.distributed as dist

        out = [None] * self.world
        dist.all_gather_object(out, obj)
        return out

    def any(self, flag: bool) -> bool:
        return bool(self.sum_(torch.tensor([float(flag)])).item() > 0)

    def sum_gradients(self, params) -> None:
        """Sum every parameter's gradient over the ranks, as one flat buffer (a missing one counts as zero)."""
        if not self.distributed:
            return
        params = list(params)
        present = self.sum_(torch.tensor([float(p.grad is not None) for p in params]))
        params = [p for p, n in zip(params, present.tolist()) if n > 0]  # untouched on every rank: left as None
        for p in params:
            if p.grad is None:  # this rank had no rows for it: a zero share
                p.grad = torch.zeros_like(p)
        if not params:
            return
        flat = torch.cat([p.grad.reshape(-1) for p in params])
        self.sum_(flat)
        offset = 0
        for p in params:
            n = p.grad.numel()
            p.grad.copy_(flat[offset:offset + n].view_as(p.grad))
            offset += n

    def check_same(self, tensor: torch.Tensor, what: str) -> None:
        """Refuse to go on if the ranks hold different ``tensor`` (its bytes' digest, gathered)."""
        if not self.distributed:
            return
        import hashlib

        digest = hashlib.sha256(tensor.detach().contiguous().cpu().numpy().tobytes()).hexdigest()
        if len(set(self.gather(digest))) > 1:
            raise RuntimeError(f"rank {self.rank}: the ranks hold different {what}; every rank must sample the same "
                               "batch (same seeds, settings and thread count)")

    def close(self) -> None:
        if self.distributed:
            import torch.distributed as dist

            if dist.is_initialized():
                dist.destroy_process_group()


def shard_rows(lengths: torch.Tensor, world: int, rank: int) -> torch.Tensor:
    """This rank's rows: longest first to the rank with the fewest tokens so far (ties: the lower rank), in order."""
    load = [0] * world
    owner = [0] * int(lengths.shape[0])
    for row in sorted(range(len(owner)), key=lambda r: (-int(lengths[r]), r)):
        target = min(range(world), key=lambda k: (load[k], k))
        owner[row] = target
        load[target] += int(lengths[row])
    return torch.tensor([r for r, k in enumerate(owner) if k == rank], dtype=torch.long)
