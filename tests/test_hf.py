"""The transformers adapter end to end on a tiny randomly initialised Qwen3 config (no downloads)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from driftless.models.hf import HFCache, HFPolicy, distinct_prompts, tiny_qwen3_config
from driftless.objectives import make
from driftless.rollout import Sampler, SamplingParams, Snapshot, score_batch


def test_hf_policy_samples_scores_and_trains(tmp_path):
    torch.manual_seed(0)
    trainer = HFPolicy(tiny_qwen3_config())
    trainer.model.save_pretrained(tmp_path / "tiny")
    from_dir = HFPolicy(tmp_path / "tiny")  # a local causal-LM directory, local_files_only
    sampler = Sampler(from_dir, head_k=8, eos_id=None)
    sampler.load(Snapshot.of(trainer, 4))
    prompts = [[5, 6, 7], [8, 9, 10, 11, 12, 13], [4]]
    batch = sampler.generate(prompts, SamplingParams(temperature=0.9, top_p=0.95), 10, seed=0)
    m = batch.action_mask
    assert int(m.sum()) == 30 and (batch.version[m] == 4).all()
    view = score_batch(trainer, batch)
    # its decode path and its own full forward agree to float32 rounding (not bitwise)
    assert float((view.logp.detach()[m] - batch.sampler_logp[m]).abs().max()) < 1e-5
    batch = batch.replace(advantage=torch.tensor([1.0, -0.5, -0.5]))
    loss, metrics = make("sc+tis", top_k=8)(view, batch)
    loss.backward()
    grads = [p.grad for p in trainer.parameters() if p.grad is not None]
    assert grads and all(torch.isfinite(g).all() for g in grads)
    assert metrics["kl_k3"] < 1e-8


def test_hf_policy_refuses_bad_tokens():
    policy = HFPolicy(tiny_qwen3_config())
    with pytest.raises(ValueError, match="token ids must be in"):
        policy(torch.tensor([[64]]))
    with pytest.raises(ValueError, match="exceed the context"):
        policy(torch.zeros(1, 129, dtype=torch.long))


def _shared_prompt_rows():
    """6 rows, 3 distinct prompts: rows 0-2 one prompt of 5 tokens, rows 3-4 one of 9, row 5 its own of 3."""
    torch.manual_seed(0)
    tokens = torch.randint(1, 64, (6, 14))
    tokens[1, :5] = tokens[0, :5]
    tokens[2, :5] = tokens[0, :5]
    tokens[4, :9] = tokens[3, :9]
    return tokens, torch.tensor([5, 5, 5, 9, 9, 3]), torch.tensor([14, 10, 12, 14, 11, 8])


def _rows_seen(policy):
    seen = []
    policy.model.model.embed_tokens.register_forward_hook(lambda m, args, out: seen.append(args[0].shape[0]))
    return seen


def test_rows_that_share_a_prompt_prefill_it_once_with_the_same_logits_and_cache():
    policy = HFPolicy(tiny_qwen3_config())
    tokens, plen, _ = _shared_prompt_rows()
    seen = _rows_seen(policy)
    with torch.no_grad():
        shared = HFCache()
        first = policy.prefill_last(tokens[:, :9], plen, shared)
        assert seen == [3]  # 3 distinct prompts, not 6 rows
        step = torch.arange(6) + 1
        after = policy.decode(step, plen, shared)
        alone = []  # each row prefilled and decoded by itself
        for i in range(6):
            cache = HFCache()
            row = policy.prefill_last(tokens[i:i + 1, :9], plen[i:i + 1], cache)
            alone.append((row, policy.decode(step[i:i + 1], plen[i:i + 1], cache)))
    assert torch.allclose(first, torch.cat([a for a, _ in alone]), atol=1e-5, rtol=0)
    assert torch.allclose(after, torch.cat([b for _, b in alone]), atol=1e-5, rtol=0)
    assert distinct_prompts(tokens[:, :9], plen)[1].tolist() == [0, 0, 0, 1, 1, 2]
    assert distinct_prompts(tokens[3:, :9], plen[3:] - torch.tensor([0, 1, 0])) is None  # lengths differ: distinct


def test_scoring_runs_each_shared_prompt_once_with_the_whole_sequences_values_and_gradients():
    policy = HFPolicy(tiny_qwen3_config())
    tokens, plen, length = _shared_prompt_rows()
    mask = (torch.arange(14)[None, :] >= plen[:, None]) & (torch.arange(14)[None, :] < length[:, None])
    rows, cols = mask[:, 1:].nonzero(as_tuple=True)
    seen = _rows_seen(policy)
    shared = policy.action_hidden_states(tokens, plen, rows, cols)
    assert seen == [3, 6]  # the 3 prompts, then the 6 responses
    whole = policy.hidden_states(tokens[:, :-1])[rows, cols]
    assert torch.allclose(shared, whole, atol=1e-5, rtol=0)
    weights = torch.randn_like(whole)
    params = [p for p in policy.parameters()]
    got = torch.autograd.grad((shared * weights).sum(), params, allow_unused=True)
    want = torch.autograd.grad((whole * weights).sum(), params, allow_unused=True)
    for g, w in zip(got, want):
        assert (g is None) == (w is None)
        if w is not None:
            assert torch.allclose(g, w, atol=1e-5 * float(w.abs().max()), rtol=1e-4)
    distinct = torch.randint(1, 64, (3, 14))  # no prompt repeats: the caller runs the whole sequences
    assert policy.action_hidden_states(distinct, torch.tensor([4, 5, 6]), torch.tensor([0]), torch.tensor([4])) is None


def test_the_shared_prompts_backward_runs_last_with_the_same_gradient_and_a_models_gradient_less_held():
    """prompt_backward_last (the Learner's .backward()): the responses' pass reads the prompts' keys, values and last
    hidden state through detached leaves, the prompts' backward runs after the responses' with their gradients;
    .grad equals the one-graph gradient of the same path (float64: to rounding), and each weight's gradient lands
    in .grad twice (responses, then prompts) instead of waiting in autograd's buffer for the prompt's share."""
    policy = HFPolicy(tiny_qwen3_config()).double()
    tokens, plen, length = _shared_prompt_rows()
    mask = (torch.arange(14)[None, :] >= plen[:, None]) & (torch.arange(14)[None, :] < length[:, None])
    rows, cols = mask[:, 1:].nonzero(as_tuple=True)
    down = policy.model.model.layers[0].mlp.down_proj.weight
    seen = []
    down.register_post_accumulate_grad_hook(lambda p: seen.append(p.grad.clone()))
    grads, outs = [], []
    for last in (False, True):
        policy.zero_grad(set_to_none=True)
        policy.prompt_backward_last = last
        out = policy.action_hidden_states(tokens, plen, rows, cols)
        weights = torch.randn(out.shape, generator=torch.Generator().manual_seed(0), dtype=out.dtype)
        (out * weights).sum().backward()
        outs.append(out.detach())
        grads.append({n: p.grad.clone() for n, p in policy.named_parameters() if p.grad is not None})
    assert torch.equal(outs[0], outs[1])
    assert len(seen) == 3  # once in the one graph; twice when the prompts' backward runs last
    assert grads[0].keys() == grads[1].keys() and len(grads[0]) > 10
    for n, want in grads[0].items():
        assert torch.allclose(grads[1][n], want, atol=1e-13 * float(want.abs().max()), rtol=1e-12), (
            n, float((grads[1][n] - want).abs().max()))


def test_activation_checkpointing_gives_the_same_values_and_gradients():
    torch.manual_seed(0)
    plain = HFPolicy(tiny_qwen3_config())
    checkpointed = HFPolicy(tiny_qwen3_config())
    checkpointed.load_state_dict(plain.state_dict())
    checkpointed.checkpoint_activations()
    tokens = torch.randint(0, 64, (3, 12))
    recomputed = []
    layer = checkpointed.model.model.layers[0]
    layer.input_layernorm.register_forward_pre_hook(lambda m, args: recomputed.append(torch.is_grad_enabled()))
    outs = [p(tokens) for p in (plain, checkpointed)]
    assert torch.equal(outs[0], outs[1])
    weights = torch.randn_like(outs[0])
    grads = [torch.autograd.grad((o * weights).sum(), list(p.parameters())) for o, p in zip(outs, (plain, checkpointed))]
    assert all(torch.allclose(a, b, atol=1e-6, rtol=1e-5) for a, b in zip(*grads))
    assert len(recomputed) == 2  # the layer ran again in the backward
    assert not checkpointed.model.model.layers[0].self_attn.training  # no dropout switched on


def _by_hand(state, spec):
    """A reference for a sampler view on a transformers model, built without HFPolicy's numerics: the weights
    quantized by hand, every linear's input quantized by a forward pre-hook, and K and V quantized where the
    attention receives them (a registered attention function around SDPA), run as one whole-sequence forward
    without a cache."""
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from driftless.mismatch import parse_view

    quant = parse_view(spec).quant

    def attention(module, query, key, value, *args, **kwargs):
        if quant.kv is not None:
            key, value = quant.kv(key), quant.kv(value)
        return sdpa_attention_forward(module, query, key, value, *args, **kwargs)

    AttentionInterface.register("kv_by_hand", attention)
    config = tiny_qwen3_config()
    config._attn_implementation = "kv_by_hand"
    class WholeForward(HFPolicy):
        output_weight = None  # scored through the model's own output layer (its input quantized too)

    reference = WholeForward(config, attn_implementation="kv_by_hand")
    reference.load_state_dict(state)
    with torch.no_grad():
        for p in reference.parameters():
            if quant.weight is not None and p.dim() == 2:
                p.copy_(quant.weight(p))
    if quant.act is not None:
        for module in reference.model.modules():
            if isinstance(module, torch.nn.Linear):
                module.register_forward_pre_hook(lambda m, args: (quant.act(args[0]),))
    return reference


@pytest.mark.parametrize("spec", ["a:int4", "kv:int4", "w8a8+kv:int4"])
def test_activation_and_kv_views_quantize_a_transformers_samplers_linear_inputs_and_written_cache(spec):
    """A transformers sampler under an activation / KV view records the q of the quantized engine: its cached decode
    gives what a reference built by hand (weights, linear inputs, and K and V as the attention receives them, all
    quantized) gives on the whole sequence without a cache, within float rounding, while the unquantized model
    is far off; with the numerics reset the sampler is the trainer again."""
    from driftless.mismatch import parse_view

    torch.manual_seed(0)
    trainer = HFPolicy(tiny_qwen3_config())
    policy = HFPolicy(tiny_qwen3_config())
    sampler = Sampler(policy, head_k=8, eos_id=None, view=parse_view(spec))
    sampler.load(Snapshot.of(trainer, 1))
    assert policy.numerics is not None and (policy.numerics.kv is not None) == ("kv:" in spec)
    prompts = [[5, 6, 7], [8, 9, 10, 11, 12, 13], [4], [5, 6, 7]]
    batch = sampler.generate(prompts, SamplingParams(temperature=1.0), 10, seed=0)
    m = batch.action_mask
    with torch.no_grad():
        quantized = score_batch(_by_hand(trainer.state_dict(), spec), batch).logp
        plain = score_batch(trainer, batch).logp
    gap = (quantized[m] - batch.sampler_logp[m]).abs()
    to_plain = float((plain[m] - batch.sampler_logp[m]).abs().median())
    # float rounding apart (decode vs a whole-sequence forward), except where it flips a quantization step: a few
    # tokens at most (measured here: none past 1e-4)
    assert float(gap.median()) < 1e-5 and float((gap > 1e-3).float().mean()) <= 0.05, gap
    assert to_plain > 1e-3, to_plain  # the view moved q: the comparison above is not trivially met

    policy.numerics = None
    sampler.view = parse_view("none")
    sampler.load(Snapshot.of(trainer, 2))
    assert all("forward" not in vars(x) for x in policy.model.modules())
    again = sampler.generate(prompts, SamplingParams(temperature=1.0), 10, seed=0)
    m = again.action_mask
    assert float((score_batch(trainer, again).logp[m] - again.sampler_logp[m]).abs().max()) < 1e-5


def test_a_transformers_model_refuses_trainer_numerics_and_native_views_by_name():
    from driftless.mismatch import parse_view
    from driftless.ops.numerics import Numerics
    from driftless.ops.quant import QuantSpec

    policy = HFPolicy(tiny_qwen3_config())
    with pytest.raises(ValueError, match="need TinyLM's numerics hook"):
        policy.numerics = Numerics(weight=QuantSpec("int8", "row"), act=QuantSpec("int8", "row"))
    with pytest.raises(ValueError, match="native views"):
        parse_view("w8a8+native").apply(policy)


def test_activation_views_are_refused_on_a_transformers_mixture_of_experts():
    """Its experts and routers compute outside nn.Linear (3-D expert weights), where an activation format would not
    reach: refused by name rather than quantizing the attention alone."""
    from transformers import Qwen3MoeConfig

    from driftless.mismatch import parse_view

    policy = HFPolicy(Qwen3MoeConfig(vocab_size=64, hidden_size=32, intermediate_size=32, moe_intermediate_size=16,
                                     num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                                     num_experts=4, num_experts_per_tok=2, max_position_embeddings=64))
    with pytest.raises(ValueError, match="activation views .* mixture of experts"):
        parse_view("a:int8").apply(policy)
    parse_view("kv:int8").apply(policy)  # KV views still apply
    assert policy.numerics.kv is not None
