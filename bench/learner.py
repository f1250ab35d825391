"""The scaled learner's memory and speed (train.parallel, train.micro_batch_tokens); prints JSON.

    .venv/bin/python bench/learner.py                       # the demo's TinyLM, fast execution, float32
    .venv/bin/python bench/learner.py --repeats 5 --rows 64

Three measurements, each in fresh processes (gloo ranks spawned here; nothing else should run):

- ``state_bytes``: per-rank bytes of parameters + gradients + AdamW state after one update, at 1 rank and
  at 2 ranks under ``fsdp`` (and ``ddp`` for comparison); ``fsdp_2_ranks_fraction`` is rank 0's share of
  the one-rank bytes (the goal: at most 0.55).
- ``peak_rss``: the growth of the process's peak resident memory over one update, against the batch's
  rows at a fixed ``micro_batch_tokens`` (one process): flat when the micro-batches bound the activations,
  linear without them (``micro_batch_tokens=None`` is measured too).
- ``tokens_per_s``: learner tokens (prompt + response, every row) per second of one update (median over
  ``--repeats`` after a warm-up): 2 gloo ranks x 1 thread each, against 1 rank x 2 threads.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch
import torch.multiprocessing as mp


def _model_and_batch(rows: int, seed: int = 0):
    from driftless.models import TinyLM, TinyLMConfig
    from driftless.rollout import RolloutBatch, SamplingParams

    config = TinyLMConfig(vocab_size=64, d_model=192, n_layer=4, n_head=3, n_kv_head=1, d_ff=512, max_seq_len=64)
    model = TinyLM(config)
    model.reset_parameters(seed=1)
    g = torch.Generator().manual_seed(seed)
    width = 48
    prompt = torch.full((rows,), 16)
    length = prompt + torch.randint(4, width - 16, (rows,), generator=g)  # uneven responses
    tokens = torch.randint(3, 64, (rows, width), generator=g)
    positions = torch.arange(width)[None, :]
    mask = (positions >= prompt[:, None]) & (positions < length[:, None])
    tokens = torch.where(positions < length[:, None], tokens, 0)
    logq = torch.where(mask, -torch.rand(rows, width, generator=g) * 3, 0.0)
    batch = RolloutBatch(tokens=tokens, prompt_len=prompt, length=length, action_mask=mask, sampler_logp=logq,
                         version=torch.where(mask, 0, -1),
                         advantage=torch.randn(rows, generator=g), reward=torch.zeros(rows),
                         group=torch.arange(rows) // 8, sampling=SamplingParams(temperature=1.0))
    return model, batch


def _learner(model, micro, ranks=None, parallel="ddp"):
    from driftless.objectives import make
    from driftless.train.learner import Learner, make_optimizer
    from driftless.train.parallel import fully_shard_policy

    if parallel == "fsdp":
        fully_shard_policy(model, ranks)
    optimizer = make_optimizer(list(model.parameters()), "adamw", 1e-4)
    return Learner(model, make("tis"), optimizer, decomposition=False, micro_batch_tokens=micro, ranks=ranks)


def _local_bytes(learner) -> dict:
    def size(t):
        t = t.to_local() if hasattr(t, "to_local") else t
        return t.numel() * t.element_size()

    params = list(learner.policy.parameters())
    state = [v for s in learner.optimizer.state.values() for v in s.values()
             if isinstance(v, torch.Tensor) and v.dim() > 0]
    # gradients are released after the step: the same shapes (and shards) as the parameters
    return {"params": sum(size(p) for p in params), "grads": sum(size(p) for p in params),
            "optimizer": sum(size(v) for v in state)}


def _rank(rank, world, init, rows, micro, parallel, repeats, out):
    import torch.distributed as dist

    from driftless.train.parallel import Ranks

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    try:
        model, batch = _model_and_batch(rows)
        learner = _learner(model, micro, Ranks(rank, world), parallel)
        times = []
        for _ in range(repeats + 1):
            dist.barrier()
            t0 = time.perf_counter()
            learner.update(batch)
            times.append(time.perf_counter() - t0)
        result = {"bytes": _local_bytes(learner), "update_s": statistics.median(times[1:])}
    finally:
        dist.destroy_process_group()
    torch.save(result, f"{out}.{rank}")


def ranks_run(rows, micro, parallel, repeats, world=2) -> list[dict]:
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "r")
        mp.spawn(_rank, args=(world, f"file://{tmp}/pg", rows, micro, parallel, repeats, out), nprocs=world,
                 join=True)
        return [torch.load(f"{out}.{r}") for r in range(world)]


def one_process(rows, micro, repeats, threads) -> dict:
    torch.set_num_threads(threads)
    model, batch = _model_and_batch(rows)
    learner = _learner(model, micro)
    times = []
    for _ in range(repeats + 1):
        t0 = time.perf_counter()
        learner.update(batch)
        times.append(time.perf_counter() - t0)
    return {"bytes": _local_bytes(learner), "update_s": statistics.median(times[1:])}


def peak_growth(rows, micro) -> int:
    """KiB of peak-RSS growth over one update, in a fresh process (ru_maxrss only grows)."""
    code = ("import resource, sys; sys.path.insert(0, 'bench'); import torch; torch.set_num_threads(1); "
            "from learner import _model_and_batch, _learner; "
            f"m, b = _model_and_batch({rows}); l = _learner(m, {micro!r}); "
            "before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss; l.update(b); "
            "print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                          cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    return int(done.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=64)
    p.add_argument("--micro", type=int, default=512, help="micro_batch_tokens (padded tokens a forward)")
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    _, batch = _model_and_batch(args.rows)
    tokens = int(batch.length.sum())

    one = one_process(args.rows, args.micro, args.repeats, threads=1)
    fsdp = ranks_run(args.rows, args.micro, "fsdp", args.repeats)
    ddp = ranks_run(args.rows, args.micro, "ddp", args.repeats)
    two_threads = one_process(args.rows, args.micro, args.repeats, threads=2)
    total = sum(one["bytes"].values())
    peaks = {str(rows): {"micro": peak_growth(rows, args.micro), "whole": peak_growth(rows, None)}
             for rows in (16, 32, 64, 128)}
    print(json.dumps({
        "model": "TinyLM d_model 192, 4 layers, vocab 64 (the demo's), fast execution, float32, AdamW",
        "rows": args.rows, "tokens": tokens, "micro_batch_tokens": args.micro,
        "torch": torch.__version__, "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "state_bytes": {"one_rank": one["bytes"], "fsdp_2_ranks": [r["bytes"] for r in fsdp],
                        "ddp_2_ranks": [r["bytes"] for r in ddp],
                        "fsdp_2_ranks_fraction": round(sum(fsdp[0]["bytes"].values()) / total, 4),
                        "ddp_2_ranks_fraction": round(sum(ddp[0]["bytes"].values()) / total, 4)},
        "peak_rss_growth_kib": {"by_rows": peaks, "note": "micro: micro_batch_tokens fixed; whole: one forward"},
        "tokens_per_s": {"1_rank_x_1_thread": round(tokens / one["update_s"]),
                         "1_rank_x_2_threads": round(tokens / two_threads["update_s"]),
                         "2_ranks_x_1_thread_fsdp": round(tokens / max(r["update_s"] for r in fsdp)),
                         "2_ranks_x_1_thread_ddp": round(tokens / max(r["update_s"] for r in ddp))},
    }, indent=2))


if __name__ == "__main__":
    main()
