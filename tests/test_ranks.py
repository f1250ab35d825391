"""Learner ranks on torch.distributed (gloo): two ranks x two micro-batches give the one-process update.

Float64: the update and every logged metric agree to 1e-12 (relative) with one process and one forward, for
every reduction and five presets. Float32, end to end under torchrun: a short run's metric lines agree with the
one-process run's to float32 rounding, and only rank 0 writes."""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from test_micro_batches import PRESETS, mismatched_batch, relative, update

from driftless.objectives import REDUCTIONS
from driftless.train.parallel import Ranks, shard_rows


def _rank_main(rank: int, world: int, init: str, model, batch, out: str, parallel: str = "ddp"):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    torch.set_num_threads(1)
    results = {}
    try:
        for preset in PRESETS:
            for reduction in REDUCTIONS:
                results[(preset, reduction)] = update(model, batch, preset, reduction, 60, ranks=Ranks(rank, world),
                                                      parallel=parallel)
    finally:
        dist.destroy_process_group()
    torch.save(results, f"{out}.{rank}")


@pytest.mark.parametrize("parallel", ["ddp", "fsdp"])
def test_two_gloo_ranks_give_the_one_process_update_for_every_reduction_and_preset(tmp_path, parallel):
    """ddp: whole copies, gradients summed after the backward; fsdp: FSDP2 shards, reduce-scattered (summed) in it."""
    model, batch = mismatched_batch()
    out = str(tmp_path / "results")
    mp.spawn(_rank_main, args=(2, f"file://{tmp_path / 'pg'}", model, batch, out, parallel), nprocs=2, join=True)
    ranks = [torch.load(f"{out}.{r}", weights_only=False) for r in range(2)]
    for (preset, reduction), (step, metrics) in ranks[0].items():
        whole_step, whole = update(model, batch, preset, reduction, None)
        other_step, _ = ranks[1][(preset, reduction)]
        for k in step:
            assert torch.equal(step[k], other_step[k]), (preset, reduction, k)  # the ranks stay identical
        worst = max(relative(step[k], whole_step[k]) for k in step if whole_step[k].abs().max() > 0)
        assert worst < 1e-12, (preset, reduction, worst)
        for key, value in whole.items():
            if key.endswith("_s") or not isinstance(value, float) or not math.isfinite(value):
                continue
            assert metrics[key] == pytest.approx(value, rel=1e-12, abs=1e-14), (preset, reduction, key)


def test_rows_are_shared_by_tokens():
    lengths = torch.tensor([10, 3, 8, 8, 2, 1])
    shares = [shard_rows(lengths, 2, r).tolist() for r in range(2)]
    assert shares == [[0, 1, 4, 5], [2, 3]]  # 16 tokens each: longest first, each to the lighter rank
    assert sorted(shares[0] + shares[1]) == list(range(6))
    assert shard_rows(torch.tensor([5]), 2, 1).tolist() == []  # a rank may hold no rows


TINY = ["task.name=arithmetic", "task.max_operand=9", "model.d_model=32", "model.n_head=1", "model.n_kv_head=1",
        "model.d_ff=64", "model.n_layer=1", "model.max_seq_len=24", "model.warm_start=false",
        "rollout.prompts_per_step=4", "rollout.group_size=4", "rollout.max_new_tokens=6", "rollout.head_k=8",
        "objective.name=sc+tis", "objective.params={top_k: 8}", "mismatch.view=noise:0.1", "train.eval_problems=8",
        "train.steps=3", "train.eval_every=3", "train.checkpoint_every=3", "optim.lr=1e-3"]


def _train(run_dir: Path, *extra, ranks: int = 1, base=TINY):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    flags = [e for e in extra if e.startswith("--")]
    extra = [e for e in extra if not e.startswith("--")]
    args = ["-m", "driftless", "train", "configs/default.yaml", *base, *extra, "--run-dir", str(run_dir),
            "--no-progress", *flags]
    if ranks > 1:
        torchrun = Path(sys.executable).with_name("torchrun")
        cmd = [str(torchrun), "--nproc-per-node", str(ranks), "--master-port", "29517", *args]
    else:
        cmd = [sys.executable, *args]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600, check=False,
                          cwd=Path(__file__).resolve().parents[1])
    assert done.returncode == 0, done.stderr[-3000:]
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.torchrun
@pytest.mark.parametrize("parallel", ["ddp", "fsdp"])
def test_a_run_under_torchrun_writes_the_one_process_lines(tmp_path, parallel):
    one = _train(tmp_path / "one")
    two = _train(tmp_path / "two", "train.learner_ranks=2", "train.micro_batch_tokens=40", f"train.parallel={parallel}",
                 ranks=2)
    from driftless.train.loop import TIMING_KEYS

    assert [r["step"] for r in two] == [0, 1, 2] and "eval_reward" in two[-1]
    for a, b in zip(one, two):
        for key, value in a.items():
            if key in TIMING_KEYS or key.endswith("_s") or not isinstance(value, float):
                assert key in b
                continue
            assert b[key] == pytest.approx(value, rel=1e-4, abs=1e-6), key
    assert (tmp_path / "two/checkpoints").exists()


def test_ranks_are_refused_where_they_cannot_be_honoured(tmp_path):
    from driftless.train import load_config

    with pytest.raises(ValueError, match="train.learner_ranks=2 runs under torchrun with rollout.runtime=sync, or as Ray actors"):
        load_config(None, ["train.learner_ranks=2", "rollout.runtime=thread"])
    with pytest.raises(ValueError, match="launch with torchrun --nproc-per-node 2"):
        Ranks.from_env(2)
    shard = ["rollout.shard_across_ranks=true", "rollout.draws=row", "train.learner_ranks=2"]
    with pytest.raises(ValueError, match="rollout.shard_across_ranks=true shares a step's generation among learner"):
        load_config(None, [*shard, "train.learner_ranks=1"])
    with pytest.raises(ValueError, match="rollout.shard_across_ranks=true needs rollout.draws=row"):
        load_config(None, [*shard, "rollout.draws=batch"])
    with pytest.raises(ValueError, match="rollout.shard_across_ranks=true with rollout.refresh=retain"):
        load_config(None, [*shard, "rollout.lag=1", "rollout.refresh=retain"])
    with pytest.raises(ValueError, match="rollout.prompts_per_step=1 < train.learner_ranks=2"):
        load_config(None, [*shard, "rollout.prompts_per_step=1"])
    with pytest.raises(ValueError, match="rollout.draws=row draws each row from its own stream in the built-in"):
        load_config(None, ["rollout.draws=row", "rollout.engine=vllm", "model.kind=hf", "model.hf_path=x"])


def _same_lines(one, two, rel=1e-4):
    from driftless.train.loop import TIMING_KEYS

    assert [r["step"] for r in two] == [r["step"] for r in one]
    for a, b in zip(one, two):
        for key, value in a.items():
            if key in TIMING_KEYS or key.endswith("_s") or not isinstance(value, float):
                assert key in b
                continue
            assert b[key] == pytest.approx(value, rel=rel, abs=1e-6), (key, a["step"])


@pytest.mark.torchrun
def test_a_transformers_checkpoint_trains_sharded_per_decoder_layer(tmp_path):
    """model.kind=hf under FSDP2: one unit per decoder layer and one for the model; the lines are one process's."""
    pytest.importorskip("transformers")
    from conftest import hf_stand_in

    hf = hf_stand_in(tmp_path)
    one = _train(tmp_path / "one", base=hf)
    two = _train(tmp_path / "two", "train.learner_ranks=2", "train.parallel=fsdp", "train.micro_batch_tokens=64",
                 ranks=2, base=hf)
    _same_lines(one, two)


@pytest.mark.torchrun
@pytest.mark.parametrize("parallel", ["ddp", "fsdp"])
def test_a_two_rank_run_resumes_on_one_rank_and_on_two_and_a_one_rank_run_on_two(tmp_path, parallel):
    """A checkpoint of several ranks holds model and optimizer through torch.distributed.checkpoint (resharded on
    load) and rank-local choices are functions of (seed, step): one written at 2 ranks resumes at 1 and at 2,
    and one written at 1 resumes at 2, each continuing the uninterrupted lines."""
    c = ["train.checkpoint_every=2", "train.eval_every=2", "optim.schedule=constant"]  # the same run, cut at step 2
    two = ["train.learner_ranks=2", f"train.parallel={parallel}"]
    straight = _train(tmp_path / "straight", "train.steps=4", *c)
    _train(tmp_path / "a", "train.steps=2", *c, *two, ranks=2)
    assert (tmp_path / "a/checkpoints/step_000002/dcp/.metadata").exists()
    assert not (tmp_path / "a/checkpoints/step_000002/optim.pt").exists()
    shutil.copytree(tmp_path / "a", tmp_path / "a2")
    a = _train(tmp_path / "a", "train.steps=4", *c, "--resume")
    a2 = _train(tmp_path / "a2", "train.steps=4", *c, *two, "--resume", ranks=2)
    _train(tmp_path / "b", "train.steps=2", *c)
    b = _train(tmp_path / "b", "train.steps=4", *c, *two, "--resume", ranks=2)
    from driftless.train.loop import TIMING_KEYS

    for resumed in (a, a2, b):
        assert [r["step"] for r in resumed] == [0, 1, 2, 3]
        for x, y in zip(straight, resumed):
            for key, value in x.items():
                if key not in TIMING_KEYS and not key.endswith("_s") and isinstance(value, float):
                    assert y[key] == pytest.approx(value, rel=1e-4, abs=1e-6), (key, x["step"])


def test_a_sharded_checkpoint_loads_into_one_process_and_a_dtype_mismatch_is_refused(tmp_path):
    """torch.distributed.checkpoint without a process group: the learner's state round-trips exactly; loading it
    into a model of another dtype is an error naming the tensor, not DCP's silent cast."""
    import torch.distributed.checkpoint as dcp

    model, batch = mismatched_batch()  # float64
    from driftless.objectives import make
    from driftless.train.learner import Learner, make_optimizer

    def learner(m):
        return Learner(m, make("pg"), make_optimizer(list(m.parameters()), "adamw", 1e-3), decomposition=False)

    trained = learner(model.float())
    trained.update(batch)
    dcp.save(trained.sharded_state(), checkpoint_id=str(tmp_path / "dcp"))
    fresh = learner(mismatched_batch()[0].float())
    fresh.load_state_dict({"dcp": tmp_path / "dcp", "version": 1, "skipped_steps": 0})
    for (k, a), b in zip(trained.policy.state_dict().items(), fresh.policy.state_dict().values()):
        assert torch.equal(a, b), k
    moments = [s["exp_avg"] for s in trained.optimizer.state.values()]
    assert all(torch.equal(a, s["exp_avg"]) for a, s in zip(moments, fresh.optimizer.state.values()))
    with pytest.raises(ValueError, match=r"final_norm was saved as torch.float32, this model holds torch.float64"):
        learner(mismatched_batch()[0]).load_state_dict({"dcp": tmp_path / "dcp", "version": 1, "skipped_steps": 0})


@pytest.mark.torchrun
def test_two_ranks_each_generate_half_the_groups_and_write_the_one_process_lines(tmp_path):
    """rollout.shard_across_ranks: each rank generates its share of the step's prompt groups and the ranks gather
    the batch. Exact on this config: rollout.draws=row (each row its own stream) and aligned execution (a row's bits
    do not depend on the rows beside it), so the gathered batch is one process's (the batch digest check passes
    every step) and the lines are its lines to float32 rounding of the summed gradient."""
    exact = ["rollout.draws=row", "model.execution=aligned"]
    one = _train(tmp_path / "one", *exact)
    two = _train(tmp_path / "two", *exact, "rollout.shard_across_ranks=true", "train.learner_ranks=2", ranks=2)
    _same_lines(one, two)
    rows = 4 * 4  # rollout.prompts_per_step x rollout.group_size
    for line in two:
        assert line["generated_rows_max"] == rows // 2  # each rank generated 2 of the 4 groups
        assert line["tokens"] / 2 <= line["generated_tokens_max"] < line["tokens"]
    assert "generated_rows_max" not in one[0]


@pytest.mark.torchrun
def test_a_run_generated_on_two_ranks_resumes_on_one_process_as_the_same_run(tmp_path):
    """Sharded generation changes who samples a row, not what it samples: a run cut at step 2 on 2 ranks with
    rollout.shard_across_ranks continues on one process (no sharding) with the uninterrupted one-process lines."""
    c = ["rollout.draws=row", "model.execution=aligned", "train.checkpoint_every=2", "train.eval_every=2",
         "optim.schedule=constant"]
    straight = _train(tmp_path / "straight", "train.steps=4", *c)
    _train(tmp_path / "a", "train.steps=2", *c, "train.learner_ranks=2", "rollout.shard_across_ranks=true", ranks=2)
    resumed = _train(tmp_path / "a", "train.steps=4", *c, "--resume")
    assert [r["step"] for r in resumed] == [0, 1, 2, 3]
    _same_lines(straight, resumed)
