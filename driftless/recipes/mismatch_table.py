"""``driftless mismatch-table``: how far each sampler view moves q from the trainer's p.

For every mismatch kind: build a sampler with that view from the trainer's weights, generate,
re-score with the full-precision trainer (trainer numerics (a)), and report mean KL(q‖p) (k3),
max |Δ log p| and the top-k head mass (Σ_H q of the sampler's head, Σ_H p of the trainer on it).

``engine="vllm"``: the sampler is a vLLM engine (driftless.rollout.vllm) over a tiny Qwen3 and
the trainer its transformers copy; kinds are weight-only views and noise, plus the engine's own
KV-cache formats (``vllm-kv:fp8_e4m3``, ``vllm-kv:fp8_e5m2``: vLLM's ``kv_cache_dtype``).

Without a run config the prompts are random token ids and generation runs to ``max_new_tokens`` with no end
token: a measure of the views on arbitrary text, far off any task (on the study's MoE warm start, noise 0.15
gives KL 2.8e-1 there and about 1e-3 on its own Countdown prompts, docs/moe.md). ``run_config_table`` measures what a run's
step 0 sees instead: the config's task prompts through its tokenizer, its end ids, sampling and length, and
its starting weights.
"""

from __future__ import annotations

import random

import torch

from driftless.diagnostics.evidence import routing_diagnostics
from driftless.diagnostics.metrics import kl_k3, masked_mean
from driftless.mismatch import parse_view
from driftless.rollout import Sampler, SamplingParams, Snapshot, score_batch

DEFAULT_KINDS = ("none", "noise:0.01", "noise:0.02", "noise:0.05", "w:int8", "w:int4:g32", "w:fp8_e4m3",
                 "w:mxfp4", "w:nvfp4", "w8a8", "w8a8-fp8", "kv:int8", "kv:int4", "kv:fp8", "kv:fp4",
                 "w8a8+kv:int8", "dtype:bf16", "dtype:fp16")
VLLM_KINDS = ("none", "noise:0.01", "noise:0.02", "noise:0.05", "w:int8", "w:int4:g32", "w:fp8_e4m3", "w:mxfp4",
              "w:nvfp4", "vllm-kv:fp8_e4m3", "vllm-kv:fp8_e5m2")
ENGINE_KV_PREFIX = "vllm-kv:"


def _builtin_sampler(policy, spec: str, head_k: int):
    return Sampler(policy, head_k=head_k, view=parse_view(spec))


def _vllm_sampler(policy, spec: str, head_k: int):
    from driftless.rollout.vllm import VLLMSampler

    if spec.startswith(ENGINE_KV_PREFIX):
        return VLLMSampler(policy, head_k=head_k, engine_kwargs={"kv_cache_dtype": spec[len(ENGINE_KV_PREFIX):]})
    return VLLMSampler(policy, head_k=head_k, view=parse_view(spec))


def _vllm_unavailable(spec: str) -> str | None:
    from driftless.rollout.vllm import engine_option_unavailable

    if spec.startswith(ENGINE_KV_PREFIX):
        return engine_option_unavailable({"kv_cache_dtype": spec[len(ENGINE_KV_PREFIX):]})
    return None


def measure_view(make_policy, spec: str, prompts, *, max_new_tokens=24, head_k=32, seed=0,
                 make_sampler=_builtin_sampler, unavailable=lambda spec: None, sampling=None, shorten=None) -> dict:
    """The row of one mismatch kind; ``{"unavailable": reason}`` where this machine cannot run it."""
    reason = unavailable(spec)
    if reason is not None:
        return {"unavailable": reason}
    trainer = make_policy()
    sampler = make_sampler(make_policy(), spec, head_k)
    sampler.load(Snapshot.of(trainer, 0))
    batch = sampler.generate(prompts, sampling or SamplingParams(), max_new_tokens, seed=seed)
    if shorten is not None:  # a run's stop strings end its responses where its worker ends them
        batch = shorten(batch)
    if hasattr(sampler, "close"):
        sampler.close()
    with torch.no_grad():
        view = score_batch(trainer, batch)
    m = batch.action_mask
    mask = m.double()
    row = {
        "tokens": int(m.sum()),
        "kl_k3": kl_k3(view.logp, batch.sampler_logp, mask),
        "max_abs_logp_diff": float((view.logp[m] - batch.sampler_logp[m]).abs().max()),
        "sampler_head_mass": masked_mean(batch.sampler_topk_logp.exp().sum(-1), mask),
        "trainer_head_mass": masked_mean(view.head_logp.exp().sum(-1), mask),
    }
    if batch.sampler_routes is not None:  # a mixture of experts: how often the routes flip, and replay's KL
        routing = routing_diagnostics(batch.sampler_routes, view.routes, view.logp, batch.sampler_logp, m)
        row.update({k: routing[k] for k in ("routing_set_disagreement", "routing_token_any")})
        with torch.no_grad():
            replayed = score_batch(trainer, batch, routing="replay")
        row["kl_k3_replay"] = kl_k3(replayed.logp, batch.sampler_logp, mask)
    return row


def run_table(*, model_path=None, kinds=None, num_prompts=32, max_new_tokens=24, head_k=32, seed=0,
              execution="fast", engine="driftless", n_experts: int = 0) -> dict:
    from driftless.models import TinyLM, TinyLMConfig, load_model

    if engine == "vllm" and n_experts:
        raise ValueError("--experts builds a mixture-of-experts TinyLM for the built-in engine; the vLLM table's "
                         "tiny Qwen3 is dense")
    if engine == "vllm":
        return _run_vllm_table(model_path=model_path, kinds=kinds or VLLM_KINDS, num_prompts=num_prompts,
                               max_new_tokens=max_new_tokens, head_k=head_k, seed=seed)
    if engine != "driftless":
        raise ValueError(f"engine must be 'driftless' or 'vllm', got {engine!r}")
    kinds = kinds or DEFAULT_KINDS
    if model_path is not None and n_experts:
        raise ValueError("--experts builds a random mixture-of-experts TinyLM; a --model file brings its own")
    if model_path is not None:
        base, _ = load_model(model_path)
        config, state = base.config, base.state_dict()
        g = torch.Generator().manual_seed(seed)
        prompts = [torch.randint(2, config.vocab_size, (6,), generator=g).tolist() for _ in range(num_prompts)]
    else:
        config = TinyLMConfig(init_std=0.1, n_experts=n_experts)  # peaked random: a uniform one hides mismatch
        base = TinyLM(config)
        base.reset_parameters(seed=seed)
        state = base.state_dict()
        g = torch.Generator().manual_seed(seed)
        prompts = [torch.randint(2, config.vocab_size, (6,), generator=g).tolist() for _ in range(num_prompts)]

    def make():
        m = TinyLM(config, execution=execution)
        m.load_state_dict(state)
        return m
    moe = f", {n_experts} experts top-{config.experts_per_token}" if n_experts else ""
    return {"model": str(model_path or f"random TinyLM (init_std 0.1{moe}, seed {seed})"), "head_k": head_k,
            "kinds": {k: measure_view(make, k, prompts, max_new_tokens=max_new_tokens, head_k=head_k, seed=seed)
                      for k in kinds}}


def run_config_table(config, *, kinds=None, num_prompts=32, seed=0, model_path=None) -> dict:
    """The table on a run's own setting (``driftless mismatch-table --config``): ``num_prompts`` training prompts of
    the config's task (drawn with ``seed``) through its tokenizer and chat template, generated with its sampling
    settings, end ids, stop strings and ``rollout.max_new_tokens`` by a sampler holding its starting weights (the
    warm start or the checkpoint's; ``model_path``: other weights of the same model, a TinyLM safetensors file or,
    for ``model.kind=hf``, a transformers directory); the trainer is the same weights in float32. The head-mass
    columns use ``rollout.head_k`` (32 where the config records no head)."""
    import copy
    from pathlib import Path

    from driftless.rollout.text import stop_lengths
    from driftless.train import build

    config = build.check(copy.deepcopy(config))
    if config.rollout.engine != "driftless":
        raise ValueError(f"mismatch-table --config: rollout.engine={config.rollout.engine!r}; the table runs the "
                         "built-in sampler (override rollout.engine=driftless, or use --engine vllm without --config)")
    if config.mismatch.trainer_numerics != "fp" or config.train.precision != "fp32":
        raise ValueError(f"mismatch-table --config: mismatch.trainer_numerics={config.mismatch.trainer_numerics!r}, "
                         f"train.precision={config.train.precision!r}: the table's trainer scores in float32 with "
                         "plain numerics (override mismatch.trainer_numerics=fp train.precision=fp32)")
    if model_path is not None and config.model.kind == "hf":
        if not Path(model_path).is_dir():
            raise ValueError(f"--model {model_path}: with model.kind=hf, give a transformers checkpoint directory")
        config.model.hf_path, model_path = str(model_path), None
    tok = build.tokenizer(config)
    text = build.codec(config, tok)
    state = model_path if model_path is not None else build.initial_state(config, tok, progress=True)[0]
    if model_path is not None:
        try:
            build.policy(config, state, tok)
        except Exception as e:  # safetensors' own errors, missing / unexpected keys, shapes
            first = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
            raise ValueError(f"--model {model_path}: not weights of the config's model ({first})") from e
    problems = build.task(config).sample(num_prompts, random.Random(seed), "train")
    prompts = [text.encode(p.prompt) for p in problems]
    eos = getattr(text, "eos_ids", text.eos_id)
    stop = tuple(config.rollout.stop)

    def make():
        return build.policy(config, state, tok)

    def sampler(policy, spec, head_k):
        return Sampler(policy, head_k=head_k, eos_id=eos, pad_id=text.pad_id, view=parse_view(spec))

    def shorten(batch):
        return batch.shorten(stop_lengths(batch, text, stop)) if stop else batch

    head_k = config.rollout.head_k or 32
    kinds = kinds or DEFAULT_KINDS
    return {"model": str(model_path or config.model.hf_path or "the config's starting weights"),
            "prompts": f"{num_prompts} {config.task.name} training prompts (seed {seed})", "head_k": head_k,
            "kinds": {k: measure_view(make, k, prompts, max_new_tokens=config.rollout.max_new_tokens, head_k=head_k,
                                      seed=seed, make_sampler=sampler, sampling=build.sampling(config),
                                      shorten=shorten)
                      for k in kinds}}


def _run_vllm_table(*, model_path, kinds, num_prompts, max_new_tokens, head_k, seed) -> dict:
    from driftless.models.hf import HFPolicy, tiny_qwen3_config

    source = model_path
    if source is None:
        source = tiny_qwen3_config(vocab_size=64)
        source.initializer_range = 0.1  # peaked, as the TinyLM table's init_std 0.1
    torch.manual_seed(seed)
    state = HFPolicy(source).state_dict()
    vocab = HFPolicy(source).vocab_size if model_path is not None else 64
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(2, vocab, (6,), generator=g).tolist() for _ in range(num_prompts)]

    def make():
        m = HFPolicy(source)
        m.load_state_dict(state)
        return m
    name = str(model_path or f"random tiny Qwen3 (initializer_range 0.1, seed {seed})")
    return {"model": name, "engine": "vllm", "head_k": head_k,
            "kinds": {k: measure_view(make, k, prompts, max_new_tokens=max_new_tokens, head_k=head_k, seed=seed,
                                      make_sampler=_vllm_sampler, unavailable=_vllm_unavailable) for k in kinds}}


def format_table(result: dict) -> str:
    k = result["head_k"]
    moe = any("routing_set_disagreement" in r for r in result["kinds"].values())
    extra = " expert sets flipped | tokens with a flip | KL with routing replay |" if moe else ""
    lines = [f"| mismatch | tokens | mean KL(q‖p) (k3) | max abs Δ log p | sampler top-{k} mass | trainer mass on it |"
             + extra, "|---|---|---|---|---|---|" + ("---|---|---|" if moe else "")]
    for kind, r in result["kinds"].items():
        if "unavailable" in r:
            lines.append(f"| `{kind}` | unavailable here: {r['unavailable']} | | | | |" + (" | | |" if moe else ""))
            continue
        line = (f"| `{kind}` | {r['tokens']} | {r['kl_k3']:.3e} | {r['max_abs_logp_diff']:.3e} | "
                f"{r['sampler_head_mass']:.4f} | {r['trainer_head_mass']:.4f} |")
        if moe:
            line += (f" {r['routing_set_disagreement']:.3f} | {r['routing_token_any']:.3f} | "
                     f"{r['kl_k3_replay']:.3e} |")
        lines.append(line)
    return "\n".join(lines)
