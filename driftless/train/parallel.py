"""Parallelism as parts applied to an unchanged model and learner (as torchtitan applies ``fully_shard`` and a DCP
checkpointer): learner ranks on torch.distributed and their collectives, rows shared by tokens, FSDP2 sharding,
and the state dicts torch.distributed.checkpoint saves and loads. Nothing here imports the rest of driftless.

Learner ranks: data-parallel training on torch.distributed (``train.learner_ranks``, launched by torchrun).

    torchrun --nproc-per-node 2 -m driftless train configs/default.yaml train.learner_ranks=2

Every rank holds the whole model and the whole batch (each rank samples it with the same seeds,
so the batches are the same bits: checked every step by an all-reduced digest) and trains on its
share of the rows, balanced by tokens. The gradient is summed across ranks (``SUM``, never gloo's
``AVG``: FSDP2 summed instead of averaging on gloo, pytorch #162338) with every denominator the whole
batch's (``Totals``), so the summed gradient is the one-process gradient. The metrics come from
every rank's detached log-probabilities, gathered. Rank 0 evaluates, logs and checkpoints.

``train.parallel=fsdp`` shards the learner's parameters, gradients and optimizer state over the ranks
with FSDP2 (``fully_shard``: one unit per decoder layer of a transformers model, whose layers are modules
with their own forward, then the model; TinyLM's layers are read by its own forward, so it is one unit).
FSDP reduce-scatters the gradient in the backward, summed (``set_force_sum_reduction_for_comms`` and a
divide factor of 1: never a mean over ranks) since the loss already carries the whole batch's denominators.
Its collectives run inside every forward and backward, so under fsdp every rank runs the same number of
them: a rank with fewer micro-batches runs empty ones (a row's forward, its loss times zero), and every
rank evaluates (rank 0 writes).

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

    def barrier(self) -> None:
        if self.distributed:
            import torch.distributed as dist

            dist.barrier()

    def max_(self, value: int) -> int:
        if not self.distributed:
            return value
        import torch.distributed as dist

        out = torch.tensor([value], dtype=torch.long)
        dist.all_reduce(out, op=dist.ReduceOp.MAX)
        return int(out)

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


def sharded(module) -> bool:
    """Whether ``module`` is FSDP2-sharded (``fully_shard_policy``) anywhere in it."""
    from torch.distributed.fsdp import FSDPModule

    return any(isinstance(m, FSDPModule) for m in module.modules())


def decoder_layers(policy) -> list:
    """The decoder layers FSDP wraps one by one: a transformers model's (``model.model.layers``); none for TinyLM."""
    inner = getattr(policy, "model", None)
    layers = getattr(getattr(inner, "model", None), "layers", None)
    return list(layers) if layers is not None else []


def fully_shard_policy(policy, ranks: Ranks, precision: str = "fp32"):
    """``policy`` sharded over ``ranks`` with FSDP2, its gradients summed across ranks; bf16: parameters
    gathered in bfloat16, gradients reduced in float32 (the float32 master weights stay sharded)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

    if not ranks.distributed:
        raise ValueError("train.parallel=fsdp shards over learner ranks: it needs train.learner_ranks > 1")
    device = next(policy.parameters()).device.type
    mesh = init_device_mesh(device, (ranks.world,))
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if precision == "bf16" \
        else MixedPrecisionPolicy()
    for layer in decoder_layers(policy):
        fully_shard(layer, mesh=mesh, mp_policy=mp)
    root = policy.model if decoder_layers(policy) else policy  # what prefill / decode / forward call
    fully_shard(root, mesh=mesh, mp_policy=mp)
    for module in policy.modules():
        if isinstance(module, FSDPModule):
            module.set_force_sum_reduction_for_comms(True)  # SUM on every backend (gloo's AVG: pytorch #162338)
            module.set_gradient_divide_factor(1.0)
    return policy


def full_state(module) -> dict:
    """``module``'s state dict with every sharded tensor gathered whole (a collective under FSDP: every rank)."""
    from torch.distributed.tensor import DTensor

    return {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone()
            for k, v in module.state_dict().items()}


def shard_rows(lengths: torch.Tensor, world: int, rank: int) -> torch.Tensor:
    """This rank's rows: longest first to the rank with the fewest tokens so far (ties: the lower rank), in order."""
    load = [0] * world
    owner = [0] * int(lengths.shape[0])
    for row in sorted(range(len(owner)), key=lambda r: (-int(lengths[r]), r)):
        target = min(range(world), key=lambda k: (load[k], k))
        owner[row] = target
        load[target] += int(lengths[row])
    return torch.tensor([r for r, k in enumerate(owner) if k == rank], dtype=torch.long)


# ---------------------------------------------------------------------------------------- state dicts (DCP)
def dcp_state(policy, optimizer) -> dict:
    """Model and optimizer state as torch.distributed.checkpoint saves them (FQN keys; sharded under FSDP)."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model, optim = get_state_dict(policy, optimizer)
    return {"model": model, "optim": optim}


def load_dcp(policy, optimizer, checkpoint_id) -> None:
    """Model and optimizer from a torch.distributed.checkpoint folder (any number of ranks wrote it), resharded to
    ``policy``'s ranks; a tensor saved in another dtype is refused (DCP would cast it into the template)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_state_dict

    state = dcp_state(policy, optimizer)  # templates: their shapes, shards and dtypes are what is loaded
    stored = dcp.FileSystemReader(str(checkpoint_id)).read_metadata().state_dict_metadata
    for key, value in state["model"].items():
        meta = stored.get(f"model.{key}")
        dtype = getattr(getattr(meta, "properties", None), "dtype", None)
        if isinstance(value, torch.Tensor) and dtype is not None and dtype != value.dtype:
            raise ValueError(f"{checkpoint_id}: {key} was saved as {dtype}, this model holds {value.dtype}: "
                             "resume with the precision and model the run was saved with")
    dcp.load(state, checkpoint_id=str(checkpoint_id))
    set_state_dict(policy, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])


def _trained_names(policy) -> list[str]:
    return [n for n, p in policy.named_parameters() if p.requires_grad]


def gather_whole_state(policy, optimizer, ranks: Ranks) -> dict | None:
    """An FSDP-sharded model and optimizer gathered whole to rank 0, one tensor at a time (a collective: every rank
    calls it), as one process saves them (optimizer state keyed by parameter index): ``{"model", "optimizer"}`` on
    rank 0, None on the others."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    model, optim = get_state_dict(policy, optimizer, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if ranks.rank != 0:
        return None
    index = {n: i for i, n in enumerate(_trained_names(policy))}
    return {"model": model,
            "optimizer": {"state": {index[k]: v for k, v in optim["state"].items()},
                          "param_groups": [{**g, "params": [index[n] for n in g["params"]]}
                                           for g in optim["param_groups"]]}}


def load_whole_state(policy, optimizer, model: dict, optimizer_state: dict) -> None:
    """A one-process checkpoint (whole tensors; optimizer state keyed by parameter index) into FSDP shards."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

    names = _trained_names(policy)
    ids = [i for group in optimizer_state["param_groups"] for i in group["params"]]
    if len(ids) != len(names):
        raise ValueError(f"the checkpoint's optimizer holds {len(ids)} parameters, the model {len(names)}")
    fqn = dict(zip(ids, names))
    optim = {"state": {fqn[i]: v for i, v in optimizer_state["state"].items()},
             "param_groups": [{**g, "params": [fqn[i] for i in g["params"]]} for g in optimizer_state["param_groups"]]}
    set_state_dict(policy, optimizer, model_state_dict=model, optim_state_dict=optim,
                   options=StateDictOptions(full_state_dict=True))
