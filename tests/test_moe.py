"""Mixture of experts: TinyLM's MoE blocks, the sampler's recorded routes, routing replay (R3), the routing metrics."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from driftless.diagnostics.evidence import routing_diagnostics
from driftless.mismatch.views import parse_view
from driftless.models import TinyLM, TinyLMConfig
from driftless.ops.cpu import kernel_pairs
from driftless.rollout import Snapshot, score_batch
from driftless.rollout.sampler import Sampler
from driftless.rollout.sampling import SamplingParams

CONFIG = {"vocab_size": 40, "d_model": 32, "n_layer": 2, "n_head": 2, "n_kv_head": 1, "d_ff": 32, "max_seq_len": 32}
PROMPTS = [[1, 2, 3], [4, 5], [6, 7, 8, 9], [10], [11, 12]]


def moe(execution="fast", n_experts=8, k=2, seed=0, **kw) -> TinyLM:
    torch.manual_seed(seed)
    model = TinyLM(TinyLMConfig(**CONFIG, n_experts=n_experts, experts_per_token=k, **kw), execution=execution)
    with torch.no_grad():  # a router with opinions: random init leaves it nearly uniform
        for layer in model.layers:
            layer.router.weight.mul_(40.0)
    return model


def sample(model, view=None, prompts=PROMPTS, new=8, seed=0):
    sampler = Sampler(TinyLM(model.config, execution=model.execution), head_k=0,
                      view=None if view is None else parse_view(view))
    sampler.load(Snapshot.of(model, 0))
    return sampler.generate(prompts, SamplingParams(), max_new_tokens=new, seed=seed)


def reference_moe(layer, h, config, ids=None):
    """The mixture written plainly, token by token: softmax over all experts, the top-k (or ``ids``), gate
    weights from the full softmax at those ids, renormalized, the experts' SwiGLU outputs summed."""
    probs = F.softmax(layer.router(h).float(), -1)
    out = torch.zeros_like(h)
    for n in range(h.shape[0]):
        chosen = probs[n].topk(config.experts_per_token).indices if ids is None else ids[n]
        weight = probs[n, chosen]
        if config.norm_topk_prob:
            weight = weight / weight.sum()
        for w, e in zip(weight, chosen.tolist()):
            ex = layer.experts[e]
            out[n] += w * ex.w_down(F.silu(ex.w_gate(h[n])) * ex.w_up(h[n]))
    return out


@pytest.mark.parametrize("norm", [True, False])
def test_the_mixture_is_the_plain_definition(norm):
    model = moe(norm_topk_prob=norm)
    h = torch.randn(2, 5, CONFIG["d_model"])
    layer = model.layers[0]
    model.routes = []
    got = model._moe(0, layer, h, aligned=False, grad=False).reshape(10, -1)
    own = model.routes[0].reshape(10, -1)
    torch.testing.assert_close(got, reference_moe(layer, h.reshape(10, -1), model.config), rtol=1e-5, atol=1e-6)
    # replayed ids: the same definition at those ids
    other = torch.stack([torch.randperm(8)[:2] for _ in range(10)])
    model.replay = other.view(2, 5, 1, 2).expand(2, 5, 2, 2)
    got = model._moe(0, layer, h, aligned=False, grad=False).reshape(10, -1)
    torch.testing.assert_close(got, reference_moe(layer, h.reshape(10, -1), model.config, other), rtol=1e-5,
                               atol=1e-6)
    assert (own.sort(-1).values != other.sort(-1).values).any()  # the replay did choose other experts


def test_aligned_moe_is_batch_invariant_sampler_and_trainer_the_same_bits():
    """Aligned MoE: the sampler's prefill + decode and the trainer's one forward, batched differently and
    with other tokens per expert, give the same log-probabilities and the same routes, bit for bit."""
    model = moe("aligned")
    batch = sample(model)
    assert batch.sampler_routes.dtype == torch.int8 and tuple(batch.sampler_routes.shape[2:]) == (2, 2)
    view = score_batch(model, batch)
    on = batch.action_mask
    assert torch.equal(view.logp[on], batch.sampler_logp[on])
    read = torch.arange(batch.tokens.shape[1])[None, :] < (batch.length[:, None] - 1)
    assert torch.equal(view.routes[read].to(torch.int8), batch.sampler_routes[read])
    alone = score_batch(model, batch.select([2]))  # one row alone: its own expert groups
    assert torch.equal(alone.logp[0, : int(batch.length[2])], view.logp[2, : int(batch.length[2])])


def test_fast_moe_disagrees_only_by_rounding_and_replay_of_its_own_routes_changes_nothing():
    model = moe("fast")
    batch = sample(model)
    on = batch.action_mask
    recompute = score_batch(model, batch)
    replay = score_batch(model, batch, routing="replay")
    assert float((recompute.logp.detach() - batch.sampler_logp)[on].abs().max()) < 1e-4
    assert float((replay.logp - recompute.logp).detach()[on].abs().max()) < 1e-5


def test_replaying_other_routes_changes_the_trainers_probabilities():
    model = moe("fast")
    batch = sample(model)
    swapped = batch.sampler_routes.clone()
    swapped[..., 0] = (swapped[..., 0] + 1) % 8  # another expert in every token-layer ...
    clash = swapped[..., 0] == swapped[..., 1]
    swapped[..., 0] = torch.where(clash, (swapped[..., 0] + 1) % 8, swapped[..., 0])  # ... still two distinct ones
    swapped = torch.where(batch.sampler_routes >= 0, swapped, -1)
    other = score_batch(model, batch.replace(sampler_routes=swapped), routing="replay")
    own = score_batch(model, batch, routing="replay")
    assert float((other.logp - own.logp).detach()[batch.action_mask].abs().max()) > 1e-3


def test_a_replayed_expert_keeps_the_routers_gradient():
    """R3's gate weights come from the trainer's full softmax at the replayed ids: an expert the trainer would
    not pick still gets a nonzero weight, and the router a gradient through it (a post-top-k gather would give
    it exactly zero)."""
    model = moe("fast")
    layer = model.layers[0]
    h = torch.randn(1, 1, CONFIG["d_model"])
    model.routes = []
    with torch.no_grad():
        model._moe(0, layer, h, aligned=False, grad=False)
    own = set(model.routes[0].flatten().tolist())
    outside = [e for e in range(8) if e not in own][:2]
    model.routes = None
    model.replay = torch.tensor(outside).view(1, 1, 1, 2).expand(1, 1, 2, 2)
    out = model._moe(0, layer, h, aligned=False, grad=True)
    out.pow(2).sum().backward()
    router_grad = layer.router.weight.grad
    assert router_grad is not None and float(router_grad[outside].abs().sum()) > 0
    for e in range(8):  # only the replayed experts ran
        used = layer.experts[e].w_up.weight.grad is not None and bool(layer.experts[e].w_up.weight.grad.any())
        assert used == (e in outside), e


@pytest.mark.parametrize("execution", ["fast", "aligned"])
def test_the_router_gradient_of_replay_matches_the_plain_definition(execution):
    model = moe(execution)
    model.requires_grad_(True)
    h = torch.randn(6, CONFIG["d_model"])
    ids = torch.stack([torch.randperm(8)[:2] for _ in range(6)])
    model.replay = ids.view(1, 6, 1, 2).expand(1, 6, 2, 2)
    model._moe(0, model.layers[0], h[None], aligned=execution == "aligned", grad=True).sum().backward()
    got = model.layers[0].router.weight.grad.clone()
    model.zero_grad()
    reference_moe(model.layers[0], h, model.config, ids).sum().backward()
    torch.testing.assert_close(got, model.layers[0].router.weight.grad, rtol=1e-4, atol=1e-6)


# -------------------------------------------------------------------------------- recorded routes, validated
def test_a_shifted_or_transposed_route_layout_is_refused_by_name():
    model = moe("fast")
    batch = sample(model)
    r = batch.sampler_routes
    right = torch.cat([torch.full_like(r[:, :1], -1), r[:, :-1]], 1)  # a position late
    with pytest.raises(ValueError, match=r"sampler_routes.*missing at row 0, position 0"):
        batch.replace(sampler_routes=right)
    left = torch.cat([r[:, 1:], torch.full_like(r[:, :1], -1)], 1)  # a position early
    with pytest.raises(ValueError, match=r"sampler_routes.*missing at row \d+, position \d+"):
        batch.replace(sampler_routes=left)
    square = sample(model, prompts=[[1, 2]] * 4 + [[3]] * 6, new=8)  # B = L: sequence-first has the same shape
    assert square.sampler_routes.shape[0] == square.sampler_routes.shape[1]
    with pytest.raises(ValueError, match=r"sampler_routes.*missing at row"):
        square.replace(sampler_routes=square.sampler_routes.transpose(0, 1).contiguous())


def test_routes_that_repeat_an_expert_or_leave_the_range_are_refused():
    batch = sample(moe("fast"))
    with pytest.raises(ValueError, match=r"sampler_routes.*repeats an expert.*row 0, position 0"):
        batch.replace(sampler_routes=torch.where(batch.sampler_routes >= 0, 0, -1).to(torch.int8))  # all-zero ids
    high = batch.sampler_routes.clone()
    high[0, 0, 0] = torch.tensor([3, 9], dtype=torch.int8)
    with pytest.raises(ValueError, match=r"sampler_routes.*expert id 9, the model has 8"):
        batch.replace(sampler_routes=high)
    with pytest.raises(ValueError, match=r"sampler_routes.*integer"):
        batch.replace(sampler_routes=batch.sampler_routes.float())


def test_a_dense_model_records_no_routes_and_refuses_replay():
    torch.manual_seed(0)
    dense = TinyLM(TinyLMConfig(**CONFIG))
    batch = sample(dense)
    assert batch.sampler_routes is None
    assert score_batch(dense, batch).routes is None
    with pytest.raises(ValueError, match="train.routing=replay needs a mixture-of-experts policy"):
        score_batch(dense, batch, routing="replay")


def test_in_flight_recompute_keeps_each_tokens_own_routes():
    """A refresh with recompute rebuilds the cache under new weights: the positions already fed keep the
    routes their logits were computed with; only the next token's position takes the new ones."""
    model = moe("fast")
    newer = moe("fast", seed=1)
    sampler = Sampler(TinyLM(model.config), head_k=0)
    sampler.load(Snapshot.of(model, 0))
    calls = iter([Snapshot.of(newer, 1)])
    batch = sampler.generate(PROMPTS, SamplingParams(), max_new_tokens=8, seed=0, weights=lambda: next(calls, None),
                             refresh="recompute", refresh_every=3)
    assert batch.meta["refreshes"] and batch.meta["refreshes"][0]["step"] == 3
    old = sample(model)  # the same seed without a refresh: the first three tokens are the same draws
    rebuilt = score_batch(newer, batch).routes  # the new weights' forward over the same tokens
    for row in range(len(PROMPTS)):
        fed = int(batch.prompt_len[row]) + 2  # the prompt and two action tokens were fed before the refresh
        assert torch.equal(batch.sampler_routes[row, :fed], old.sampler_routes[row, :fed]), row
        assert torch.equal(batch.sampler_routes[row, fed].long(), rebuilt[row, fed]), row  # the next token's: new


# -------------------------------------------------------------------------------- metrics
def test_routing_metrics_count_sets_orders_tokens_and_split_the_kl():
    b, l = 1, 4
    sampler = torch.tensor([[[[0, 1], [2, 3]], [[0, 1], [2, 3]], [[0, 1], [2, 3]], [[-1, -1], [-1, -1]]]])
    trainer = torch.tensor([[[[1, 0], [2, 3]], [[0, 4], [2, 3]], [[0, 1], [3, 2]], [[-1, -1], [-1, -1]]]])
    mask = torch.tensor([[False, True, True, True]])  # scored by input positions 0, 1, 2
    logq = torch.zeros(b, l)
    logp = torch.tensor([[0.0, 0.0, -0.5, 0.0]])  # only the token routed apart disagrees
    got = routing_diagnostics(sampler, trainer, logp, logq, mask)
    assert got["routing_set_disagreement"] == pytest.approx(1 / 6)
    assert got["routing_order_only"] == pytest.approx(2 / 6)  # position 0 layer 0, position 2 layer 1
    assert got["routing_token_any"] == pytest.approx(1 / 3)
    assert got["routing_layers_per_token"] == pytest.approx(1 / 3)
    assert got["routing_set_disagreement_layer0"] == pytest.approx(1 / 3)
    assert got["routing_set_disagreement_layer1"] == 0.0
    assert got["routing_alike_fraction"] == pytest.approx(2 / 3)
    assert got["kl_k3_routed_alike"] == 0.0
    assert got["kl_k3_routed_apart"] == pytest.approx(float(torch.tensor(-0.5).expm1() + 0.5))


def test_a_noisy_sampler_flips_routes_and_the_metrics_see_it():
    model = moe("fast")
    batch = sample(model, view="noise:0.3")
    view = score_batch(model, batch)
    got = routing_diagnostics(batch.sampler_routes, view.routes, view.logp, batch.sampler_logp, batch.action_mask)
    assert 0.05 < got["routing_set_disagreement"] < 1 and got["routing_token_any"] >= got["routing_set_disagreement"]
    same = sample(model)
    clean = score_batch(model, same)
    assert routing_diagnostics(same.sampler_routes, clean.routes, clean.logp, clean.logp,
                               same.action_mask)["routing_set_disagreement"] == 0.0


# -------------------------------------------------------------------------------- the run
SMALL = ["task.name=first-token", "model.d_model=32", "model.n_layer=2", "model.n_head=2",
         "model.d_ff=32", "model.max_seq_len=32", "model.n_experts=4", "model.warm_start=false",
         "rollout.prompts_per_step=4", "rollout.group_size=4", "rollout.max_new_tokens=6", "train.steps=2",
         "train.eval_every=2", "train.eval_problems=8", "train.checkpoint_every=2", "train.progress=false",
         "mismatch.view=noise:0.3"]


@pytest.mark.parametrize("routing", ["recompute", "replay"])
def test_a_moe_run_trains_and_logs_its_routing(tmp_path, routing):
    from driftless.train import load_config
    from driftless.train.loop import train

    warm = ["model.warm_start=true", "warm_start.steps=10", "warm_start.eval_problems=8",  # a short supervised
            f"warm_start.cache_dir={tmp_path / 'ws'}"] if routing == "replay" else []      # warm start of a mixture
    config = load_config(None, [*SMALL, f"train.routing={routing}", "train.micro_batch_tokens=64", *warm])
    run = train(config, tmp_path / "run", progress=False)
    lines = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert len(lines) == 2 and all(line["grad_norm"] > 0 for line in lines)
    assert all(0 < line["routing_set_disagreement"] < 1 for line in lines)
    assert {"routing_token_any", "kl_k3_routed_alike", "kl_k3_routed_apart", "routing_set_disagreement_layer1"} \
        <= lines[0].keys()


@pytest.mark.parametrize("overrides, match", [
    (["train.routing=replay", "model.n_experts=0"], "needs model.n_experts > 0"),
    (["model.kind=hf", "model.n_experts=4"], "model.n_experts=4 builds TinyLM's mixture"),
    (["model.n_experts=4", "model.experts_per_token=5"], "experts_per_token=5 must be at most"),
    (["model.n_experts=4", "model.execution=aligned", "train.reproducible=true"], "model.n_experts=4: the mixture"),
    (["model.n_experts=0", "mismatch.view=router-noise:0.3"], "perturbs a mixture of experts' routers"),
])
def test_moe_settings_that_cannot_be_honoured_are_refused_by_name(overrides, match):
    from driftless.train import load_config

    with pytest.raises(ValueError, match=match):
        load_config(None, overrides)


# -------------------------------------------------------------------------------- a transformers MoE checkpoint
def tiny_qwen3_moe(tmp_path, **sizes):
    """A Qwen3-MoE checkpoint directory (``tmp_path / "qwen3-moe"``) in the real format (config, safetensors), from
    a tiny local config whose ``sizes`` may be overridden."""
    import transformers

    config = transformers.Qwen3MoeConfig(**{
        "vocab_size": 40, "hidden_size": 32, "intermediate_size": 64, "moe_intermediate_size": 32,
        "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 16, "num_experts": 8,
        "num_experts_per_tok": 2, "norm_topk_prob": True, "max_position_embeddings": 64, "tie_word_embeddings": False,
        **sizes})
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for name, module in model.named_modules():
            if name.endswith("mlp.gate"):
                module.weight.normal_(0, 1.0)  # a router with opinions
    model.save_pretrained(tmp_path / "qwen3-moe")
    return tmp_path / "qwen3-moe"


def test_a_transformers_moe_checkpoint_records_and_replays_routes_through_its_routers(tmp_path):
    from driftless.models.hf import HFPolicy

    path = tiny_qwen3_moe(tmp_path)
    policy = HFPolicy(path)
    assert policy.route_shape == (2, 2) and policy.n_experts == 8
    sampler = Sampler(HFPolicy(path), head_k=0)
    sampler.load(Snapshot.of(policy, 0))
    batch = sampler.generate(PROMPTS, SamplingParams(), max_new_tokens=6, seed=0)
    assert batch.sampler_routes is not None and batch.n_experts == 8
    on = batch.action_mask
    own = score_batch(policy, batch)
    read = torch.arange(batch.tokens.shape[1])[None, :] < (batch.length[:, None] - 1)
    agree = (own.routes[read].sort(-1).values == batch.sampler_routes[read].long().sort(-1).values).all(-1)
    assert float(agree.double().mean()) > 0.95  # the same weights: routes differ at most where rounding ties
    replay = score_batch(policy, batch, routing="replay")
    assert float((replay.logp - batch.sampler_logp).detach()[on].abs().max()) < 1e-4
    # other routes replayed: other probabilities, and the router's gradient through the full softmax
    swapped = torch.where(batch.sampler_routes >= 0, (batch.sampler_routes + 3) % 8, -1)
    other = score_batch(policy, batch.replace(sampler_routes=swapped), routing="replay")
    assert float((other.logp - replay.logp).detach()[on].abs().max()) > 1e-3
    other.logp[on].sum().backward()
    gate = policy.model.model.layers[0].mlp.gate.weight
    assert gate.grad is not None and float(gate.grad.abs().sum()) > 0
    assert policy.routes is None and policy.replay is None  # nothing left behind for the next forward


def test_the_mismatch_table_reports_route_flips_and_the_kl_replay_leaves():
    from driftless.recipes.mismatch_table import format_table, run_table

    result = run_table(kinds=("none", "w8a8", "noise:0.02"), num_prompts=8, max_new_tokens=8, n_experts=8)
    none, w8a8, noise = (result["kinds"][k] for k in ("none", "w8a8", "noise:0.02"))
    assert none["routing_set_disagreement"] == 0.0 and none["kl_k3_replay"] < 1e-9
    for row in (w8a8, noise):
        assert 0 < row["routing_set_disagreement"] <= row["routing_token_any"] < 1
        assert row["kl_k3_replay"] < row["kl_k3"] / 2  # on this peaked random mixture replay removes most of it
    assert "KL with routing replay" in format_table(result)
    with pytest.raises(ValueError, match="--experts builds a random"):
        run_table(model_path="model.safetensors", n_experts=8)


def test_the_mismatch_table_on_a_run_config_measures_its_task_prompts_and_end_ids(capsys, monkeypatch, tmp_path):
    """--config: the task's prompts through its tokenizer, its end ids and length, its starting weights."""
    import random

    from driftless.cli import main
    from driftless.recipes import mismatch_table
    from driftless.train import build, load_config

    seen = []

    class Recording(Sampler):
        def generate(self, prompts, params, max_new_tokens, **kw):
            seen.append((prompts, self.eos_id, max_new_tokens, params.temperature))
            return super().generate(prompts, params, max_new_tokens, **kw)

    monkeypatch.setattr(mismatch_table, "Sampler", Recording)
    overrides = ["model.warm_start=false", "model.n_experts=4", "model.d_ff=64", "rollout.max_new_tokens=6",
                 "rollout.temperature=0.9"]
    config = load_config("configs/study.yaml", overrides)
    result = mismatch_table.run_config_table(config, kinds=("none", "router-noise:1.0"), num_prompts=6)
    text = build.codec(config)
    task_prompts = [text.encode(p.prompt) for p in build.task(config).sample(6, random.Random(0), "train")]
    assert [s[0] for s in seen] == [task_prompts, task_prompts]  # the run's own prompts, both views
    ends = tuple(getattr(text, "eos_ids", (text.eos_id,)))
    assert {(tuple(e) if isinstance(e, (tuple, list)) else (e,), n, t) for _, e, n, t in seen} == {(ends, 6, 0.9)}
    none, noisy = result["kinds"]["none"], result["kinds"]["router-noise:1.0"]
    assert result["prompts"] == "6 countdown training prompts (seed 0)"
    assert 0 < none["tokens"] <= 6 * 6 and none["kl_k3"] < 1e-9 and none["routing_set_disagreement"] == 0.0
    assert noisy["routing_set_disagreement"] > 0 and noisy["kl_k3_replay"] < noisy["kl_k3"]
    assert main(["mismatch-table", "--config", "configs/study.yaml", *overrides, "--kinds", "none",
                 "--prompts", "2", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["kinds"]["none"]["tokens"] <= 12
    for args, message in (
            (["model.n_experts=4"], ("mismatch-table (without --config): model.n_experts is a config key this "
                                     "command does not take; it takes rollout.max_new_tokens")),
            (["rollout.max_new_token=4"], "did you mean rollout.max_new_tokens?"),
            (["--config", "configs/study.yaml", "--kinds", "none", "model.d_ff=64"],
             "model.d_ff=64 is an override, not a view: put a.b=c overrides before --kinds"),
            (["--config", "configs/study.yaml", "--engine", "vllm"], "drop --engine vllm / --experts"),
            (["--config", "configs/study.yaml", *overrides, "--model", str(tmp_path / "none.safetensors")],
             f"--model {tmp_path / 'none.safetensors'}: not weights of the config's model"),
            (["--config", "configs/study.yaml", "model.kind=hf", "--model", str(tmp_path / "x.safetensors")],
             "with model.kind=hf, give a transformers checkpoint directory"),
            (["--config", "configs/study.yaml", "mismatch.trainer_numerics=fwd-fq", "mismatch.view=w8a8"],
             "the table's trainer scores in float32 with plain numerics")):
        assert main(["mismatch-table", *args]) == 2, args
        assert message in capsys.readouterr().err, args
    with pytest.raises(SystemExit):  # one name per setting: the length is rollout.max_new_tokens=8, with or without --config
        main(["mismatch-table", "--config", "configs/study.yaml", "--max-new-tokens", "8"])
    assert "unrecognized arguments: --max-new-tokens" in capsys.readouterr().err


def test_a_copied_transformers_moe_policy_routes_through_its_own_hooks(tmp_path):
    """The Eq. 1 scorer and the clean evaluator are deep copies: their routers' hooks must read the copy."""
    import copy

    from driftless.models.hf import HFPolicy

    policy = HFPolicy(tiny_qwen3_moe(tmp_path))
    sampler = Sampler(HFPolicy(tiny_qwen3_moe(tmp_path)), head_k=0)
    sampler.load(Snapshot.of(policy, 0))
    batch = sampler.generate(PROMPTS, SamplingParams(), max_new_tokens=4, seed=0)
    twin = copy.deepcopy(policy)
    swapped = batch.replace(sampler_routes=torch.where(batch.sampler_routes >= 0, (batch.sampler_routes + 3) % 8, -1))
    with torch.no_grad():
        a = score_batch(policy, swapped, routing="replay")
        b = score_batch(twin, swapped, routing="replay")
    assert b.routes is not None and torch.equal(a.logp, b.logp) and torch.equal(a.routes, b.routes)


def test_a_mixtral_router_always_renormalizes_and_an_unknown_router_refuses_replay(tmp_path):
    """Mixtral renormalizes its top-k weights without a norm_topk_prob attribute: replaying its own routes
    changes nothing. A router whose weights driftless cannot recompute records its routes but refuses replay."""
    import transformers

    from driftless.models.hf import HFPolicy

    config = transformers.MixtralConfig(
        vocab_size=40, hidden_size=32, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, head_dim=16, num_local_experts=8, num_experts_per_tok=2, max_position_embeddings=64)
    torch.manual_seed(0)
    policy = HFPolicy(config)
    assert policy.route_shape == (2, 2)
    sampler = Sampler(HFPolicy(config), head_k=0)
    sampler.load(Snapshot.of(policy, 0))
    batch = sampler.generate(PROMPTS, SamplingParams(), max_new_tokens=4, seed=0)
    with torch.no_grad():
        own, replay = score_batch(policy, batch), score_batch(policy, batch, routing="replay")
    assert float((own.logp - replay.logp)[batch.action_mask].abs().max()) < 1e-6
    for router in policy._routers:
        router.__class__ = type("SigmoidBiasRouter", (router.__class__,), {})
    with torch.no_grad():
        assert score_batch(policy, batch).routes is not None  # still recorded
        with pytest.raises(ValueError, match="SigmoidBiasRouter computes its gate weights"):
            score_batch(policy, batch, routing="replay")
    assert policy.routes is None and policy.replay is None


def test_check_alignment_reports_how_often_the_trainer_routes_like_the_sampler():
    from driftless.recipes.alignment import run_check

    result = run_check(modes=("fast", "aligned", "aligned+quant"), n_experts=4, num_prompts=4, max_new_tokens=8)
    modes = result["modes"]
    assert modes["aligned"]["bitwise_equal_fraction"] == 1.0 and modes["aligned"]["routes_equal_fraction"] == 1.0
    assert modes["aligned+quant"]["routes_equal_fraction"] == 1.0
    assert 0.0 < modes["fast"]["routes_equal_fraction"] <= 1.0
    with pytest.raises(ValueError, match="--experts applies to the TinyLM modes; hf score"):
        run_check(modes=("fast", "hf"), n_experts=4)
    dense = run_check(modes=("aligned",), num_prompts=2, max_new_tokens=4)["modes"]["aligned"]
    assert "routes_equal_fraction" not in dense  # a dense model has no routes to compare


@pytest.mark.skipif(not kernel_pairs(), reason="this CPU runs one kernel set: no pair to compare")
def test_aligned_moe_sampler_and_trainer_route_alike_across_processes_and_kernel_sets(tmp_path):
    """Sampler and trainer of an aligned MoE TinyLM in two processes with other kernel sets, MKL branches and
    thread counts (the first pair this CPU reports): the same bits and the same experts for every token-layer."""
    from driftless.recipes.alignment import cross_process_check

    model = TinyLM(TinyLMConfig(**CONFIG, n_experts=4))
    model.reset_parameters(seed=3)
    r = cross_process_check(model, PROMPTS, params=SamplingParams(), max_new_tokens=8, seed=1,
                            envs=kernel_pairs()[0], workdir=tmp_path)
    assert r["tokens"] > 20 and r["token_layers"] == 2 * r["tokens"]
    assert r["bitwise_equal_fraction"] == 1.0 and r["routes_equal_fraction"] == 1.0


def test_router_noise_moves_only_the_routers_and_flips_routes_that_replay_then_removes():
    from driftless.mismatch.views import parse_view as view_of

    model = moe("fast")
    noisy = TinyLM(model.config, execution=model.execution)
    noisy.load_state_dict(model.state_dict())
    view = view_of("router-noise:0.5@3")
    assert view.describe() == "router-noise(0.5)"
    view.apply(noisy)
    moved = {n for n, p in noisy.named_parameters() if not torch.equal(p, dict(model.named_parameters())[n])}
    assert moved == {n for n, _ in model.named_parameters() if n.endswith(".router.weight")} and moved
    batch = sample(model, view="router-noise:0.5@3")
    recomputed = score_batch(model, batch)
    got = routing_diagnostics(batch.sampler_routes, recomputed.routes, recomputed.logp, batch.sampler_logp,
                              batch.action_mask)
    assert got["routing_set_disagreement"] > 0.05
    replayed = score_batch(model, batch, routing="replay")
    on = batch.action_mask
    kl = lambda v: float((batch.sampler_logp - v.logp)[on].abs().mean())  # mean |log q − log p|
    assert kl(replayed) < 0.75 * kl(recomputed)  # the experts compute alike: what is left is the gate weights
    with pytest.raises(ValueError, match="has no MoE router"):
        view_of("router-noise:0.1").apply(TinyLM(TinyLMConfig(**CONFIG)))
    with pytest.raises(ValueError, match="noise view needs a number"):
        view_of("router-noise:x")
