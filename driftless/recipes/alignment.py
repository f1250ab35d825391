"""``driftless check-alignment``: does the trainer re-score exactly what the sampler recorded?

For each execution mode: generate from the same weights with several batch groupings, re-score
every response with the trainer's full forward (whole batch, and again in other groupings),
and compare the recorded log q with the trainer's log p at the same version (Eq. 1's
same-version term). Fast mode shows the real numerical mismatch; aligned mode should be zero.
"""

from __future__ import annotations

import torch

from driftless.diagnostics.metrics import kl_k3
from driftless.models.protocols import SupportsNumerics
from driftless.ops.cpu import describe_profile, kernel_pairs, kernel_profile, reported_kernel_set
from driftless.rollout import RolloutBatch, Sampler, SamplingParams, Snapshot, score_batch


def _compare(batch: RolloutBatch, trainer_logp: torch.Tensor, trainer_head: torch.Tensor | None,
             trainer_routes: torch.Tensor | None = None) -> dict:
    m = batch.action_mask
    q, p = batch.sampler_logp[m], trainer_logp[m]
    equal = (q == p)
    if trainer_head is not None and batch.sampler_topk_logp is not None:
        equal = equal & (trainer_head[m] == batch.sampler_topk_logp[m]).all(-1)
    return {
        "tokens": int(m.sum()),
        "bitwise_equal_fraction": float(equal.float().mean()) if m.any() else 1.0,
        "max_abs_logp_diff": float((q - p).abs().max()) if m.any() else 0.0,
        "kl_k3": kl_k3(trainer_logp, batch.sampler_logp, m.double()),
        **_route_agreement(batch, trainer_routes),
    }


def _route_agreement(batch: RolloutBatch, trainer_routes: torch.Tensor | None) -> dict:
    """A mixture of experts: the share of token-layers (at the input positions that score action tokens) whose
    trainer-chosen experts are the sampler's, in the same order; empty for a dense model."""
    if batch.sampler_routes is None or trainer_routes is None:
        return {}
    on = batch.action_mask[:, 1:].bool()
    same = (batch.sampler_routes[:, :-1][on].long() == trainer_routes[:, :-1][on].long()).all(-1)  # [N, layers]
    return {"token_layers": int(same.numel()), "routes_equal_fraction": float(same.double().mean()) if same.numel()
            else 1.0}


def _score_in_groups(policy, batch: RolloutBatch, sizes: list[int]):
    """Re-score the batch split into consecutive groups of the given sizes (cycled)."""
    logps, heads, routes, start, i = [], [], [], 0, 0
    b = batch.batch_size
    while start < b:
        stop = min(b, start + sizes[i % len(sizes)])
        sub = batch.select(torch.arange(start, stop))  # a different padded width, same histories
        with torch.no_grad():
            v = score_batch(policy, sub)
        pad = batch.tokens.shape[1] - sub.tokens.shape[1]
        logps.append(torch.nn.functional.pad(v.logp, (0, pad)))
        heads.append(torch.nn.functional.pad(v.head_logp, (0, 0, 0, pad)))
        if v.routes is not None:  # a mixture of experts: the experts the trainer chose, [b, L, layers, k]
            routes.append(torch.nn.functional.pad(v.routes, (0, 0, 0, 0, 0, pad)))
        start, i = stop, i + 1
    return torch.cat(logps), torch.cat(heads), torch.cat(routes) if routes else None


def check_policy(make_policy, prompts, *, params: SamplingParams, max_new_tokens: int, seed: int,
                 head_k: int = 8, groupings=((64,), (1,), (3, 1, 2)), view=None, trainer_numerics=None,
                 make_sampler=None) -> dict:
    """Generate in several groupings, re-score in several groupings, aggregate the comparison.

    ``view``: a sampler mismatch view; ``trainer_numerics``: the trainer's forward numerics;
    ``make_sampler(policy, head_k, view)``: another rollout engine (default: the built-in Sampler).
    """
    trainer = make_policy()
    if isinstance(trainer, SupportsNumerics):
        trainer.numerics = trainer_numerics
    make_sampler = make_sampler or (lambda policy, head_k, view: Sampler(policy, head_k=head_k, view=view))
    sampler = make_sampler(make_policy(), head_k, view)
    sampler.load(Snapshot.of(trainer, 0))
    totals = {"tokens": 0, "equal": 0.0, "max": 0.0, "kl_sum": 0.0, "token_layers": 0, "routes_equal": 0.0}
    for gi, gen_sizes in enumerate(groupings):
        batches, start, i = [], 0, 0
        while start < len(prompts):
            stop = min(len(prompts), start + gen_sizes[i % len(gen_sizes)])
            batches.append(sampler.generate(prompts[start:stop], params, max_new_tokens, seed=seed + 97 * gi + i))
            start, i = stop, i + 1
        for batch in batches:
            for score_sizes in ((batch.batch_size,), (1,), (2, 5)):
                logp, head, routes = _score_in_groups(trainer, batch, list(score_sizes))
                r = _compare(batch, logp, head, routes)
                totals["token_layers"] += r.get("token_layers", 0)
                totals["routes_equal"] += r.get("routes_equal_fraction", 0.0) * r.get("token_layers", 0)
                totals["tokens"] += r["tokens"]
                totals["equal"] += r["bitwise_equal_fraction"] * r["tokens"]
                totals["max"] = max(totals["max"], r["max_abs_logp_diff"])
                totals["kl_sum"] += r["kl_k3"] * r["tokens"]
    n = max(totals["tokens"], 1)
    out = {"tokens": totals["tokens"], "bitwise_equal_fraction": totals["equal"] / n,
           "max_abs_logp_diff": totals["max"], "kl_k3": totals["kl_sum"] / n}
    if totals["token_layers"]:
        out["routes_equal_fraction"] = totals["routes_equal"] / totals["token_layers"]
    return out


MODES = ("fast", "aligned", "hf", "fast+quant", "aligned+quant", "aligned-xproc")
OPTIONAL_MODES = ("vllm",)  # run when asked for: needs the vLLM extra (docs/vllm.md)


def run_check(*, model_path=None, modes=MODES,
              num_prompts: int = 12, max_new_tokens: int = 24, seed: int = 0, params: SamplingParams | None = None,
              view: str = "w8a8+kv:int8", trainer_numerics: str = "fwd-fq", n_experts: int = 0) -> dict:
    """Modes: ``fast``, ``aligned``, ``hf`` (transformers decode vs its own full forward) and
    ``fast+quant`` / ``aligned+quant``: a sampler quantized by ``view`` against a trainer whose
    forward uses the matching ``trainer_numerics`` (``fwd-fq`` or ``native``); ``aligned-xproc``:
    sampler and trainer in two processes with other CPU kernels, BLAS path and threads, for every
    pair of kernel sets this CPU runs (``driftless.ops.cpu.kernel_pairs``; named in ``pairs``); ``vllm`` (asked for by name): a vLLM engine's q against the
    transformers trainer's p at the same weights (the tiny Qwen3 of the ``hf`` mode).

    ``n_experts``: a random mixture-of-experts TinyLM (top-2 of that many experts per layer) for the TinyLM
    modes, each of which then also reports ``routes_equal_fraction``: the token-layers whose trainer-chosen
    experts are the sampler's (aligned execution: all of them, by construction)."""
    from driftless.mismatch import parse_view
    from driftless.models import TinyLM, TinyLMConfig, load_model

    params = params or SamplingParams()
    g = torch.Generator().manual_seed(seed)
    if n_experts:
        dense_only = [m for m in modes if m in ("hf", "vllm")]
        if model_path is not None:
            raise ValueError("--experts builds a random mixture-of-experts TinyLM; a --model file brings its own")
        if dense_only:
            raise ValueError(f"--experts applies to the TinyLM modes; {', '.join(dense_only)} score(s) a dense "
                             "Qwen3 (drop them from --modes)")
    if model_path is not None:
        base, _ = load_model(model_path)
        config, state = base.config, base.state_dict()
    else:
        config = TinyLMConfig(n_experts=n_experts) if n_experts else TinyLMConfig()
        base = TinyLM(config)
        base.reset_parameters(seed=seed)
        state = base.state_dict()
    vocab = config.vocab_size
    prompts = [torch.randint(2, vocab, (int(n),), generator=g).tolist()
               for n in torch.randint(1, 12, (num_prompts,), generator=g)]
    out = {}
    for mode in modes:
        if mode in ("fast", "aligned", "fast+quant", "aligned+quant"):
            execution = mode.split("+")[0]

            def make(execution=execution):
                m = TinyLM(config, execution=execution)
                m.load_state_dict(state)
                return m
            kwargs = {}
            if mode.endswith("+quant"):
                sampler_view = parse_view(view)
                if sampler_view.quant is None:
                    raise ValueError(f"view {view!r} has no quantization for the {mode} mode")
                kwargs = {"view": sampler_view, "trainer_numerics": sampler_view.quant.numerics.for_trainer(trainer_numerics)}
            out[mode] = check_policy(make, prompts, params=params, max_new_tokens=max_new_tokens, seed=seed, **kwargs)
        elif mode in ("hf", "vllm"):
            try:
                from driftless.models.hf import HFPolicy, tiny_qwen3_config

                hf_config = tiny_qwen3_config(vocab_size=vocab)
            except ImportError:
                if mode == "vllm":
                    raise
                continue
            torch.manual_seed(seed)
            hf_state = HFPolicy(hf_config).state_dict()

            def make_hf(hf_config=hf_config, hf_state=hf_state):
                m = HFPolicy(hf_config)
                m.load_state_dict(hf_state)
                return m
            kwargs = {}
            if mode == "vllm":
                from driftless.rollout.vllm import VLLMSampler

                kwargs["make_sampler"] = lambda policy, head_k, view: VLLMSampler(policy, head_k=head_k, view=view,
                                                                                   seed=seed)
            out[mode] = check_policy(make_hf, prompts, params=params, max_new_tokens=max_new_tokens, seed=seed,
                                     **kwargs)
        elif mode == "aligned-xproc":
            model = TinyLM(config)
            model.load_state_dict(state)
            out[mode] = cross_process_checks(model, prompts, params=params, max_new_tokens=max_new_tokens, seed=seed)
        else:
            raise ValueError(f"unknown mode {mode!r}; choose from {', '.join(MODES + OPTIONAL_MODES)}")
    return {"modes": out}


# ---------------------------------------------------------------- sampler and trainer in two processes
# Two processes as unlike as this CPU allows (driftless.ops.cpu.kernel_pairs): other SIMD kernels
# (torch's CPU capability, only sets this CPU reports), other BLAS code path (MKL's CBWR branch) and
# other thread counts. With aligned execution (the same driftless and torch versions) they must agree
# bit for bit.
_BATCH_FIELDS = ("tokens", "prompt_len", "length", "action_mask", "sampler_logp", "version",
                 "sampler_topk_ids", "sampler_topk_logp", "sampler_routes")


def _worker(role: str, model_path: str, job_path: str, out_path: str) -> None:
    """One side of the cross-process check (``python -m driftless.recipes.alignment ...``)."""
    from driftless.models import load_model
    from driftless.ops.fuse import fused_enabled

    job = torch.load(job_path, weights_only=False)
    policy, version = load_model(model_path, execution=job["execution"])
    info = {"cpu_capability": torch.backends.cpu.get_cpu_capability(), "threads": torch.get_num_threads()}
    if role not in ("sample", "score"):
        raise ValueError(f"role must be 'sample' or 'score', got {role!r}")

    def after_the_work() -> dict:
        # read after the work: a failed build falls back to eager, and inductor's ISA probes are then built in the
        # cache folder the pieces chose (ops.fuse), not in its parent
        if not fused_enabled():
            return {**info, "fused": False}
        from torch._inductor.cpu_vec_isa import pick_vec_isa

        isa = pick_vec_isa()  # what inductor vectorises for (it follows ATEN_CPU_CAPABILITY)
        return {**info, "fused": True, "inductor_isa": str(isa) if isa else "scalar"}

    if role == "sample":
        sampler = Sampler(policy, head_k=job["head_k"])
        sampler.load(Snapshot.of(policy, version))
        batch = sampler.generate(job["prompts"], job["params"], job["max_new_tokens"], seed=job["seed"])
        torch.save({"batch": {f: getattr(batch, f) for f in _BATCH_FIELDS}, "info": after_the_work()}, out_path)
    elif role == "score":
        fields = torch.load(job["batch_path"], weights_only=False)["batch"]
        batch = RolloutBatch(**fields, sampling=job["params"])
        logp, head, routes = _score_in_groups(policy, batch, [2, 5, 1])
        torch.save({"logp": logp, "head": head, "routes": routes, "info": after_the_work()}, out_path)


def cross_process_check(model, prompts, *, params: SamplingParams, max_new_tokens: int, seed: int,
                        head_k: int = 8, execution: str = "aligned", envs=None, workdir=None) -> dict:
    """Sample in one subprocess (environment ``envs[0]``), score in another (``envs[1]``), compare.

    ``envs``: a (sampler, trainer) pair of environments, by default the first of ``kernel_pairs()``;
    a kernel set this CPU cannot run is refused by name before any process starts."""
    import os
    import subprocess
    import sys
    import tempfile
    from pathlib import Path

    from driftless.models import save_model

    if envs is None:
        pairs = kernel_pairs()
        if not pairs:
            raise ValueError(f"this CPU runs only one kernel set ({reported_kernel_set()!r}): no pair to compare")
        envs = pairs[0]
    for env in envs:
        if "ATEN_CPU_CAPABILITY" in env:
            kernel_profile(env["ATEN_CPU_CAPABILITY"], threads=1)  # raises when this CPU cannot run it
    with tempfile.TemporaryDirectory(dir=workdir) as tmp:
        tmp = Path(tmp)
        save_model(model, tmp / "model.safetensors", version=0)
        job = {"execution": execution, "prompts": prompts, "params": params, "max_new_tokens": max_new_tokens,
               "seed": seed, "head_k": head_k, "batch_path": str(tmp / "batch.pt")}
        torch.save(job, tmp / "job.pt")
        for role, env, out in (("sample", envs[0], "batch.pt"), ("score", envs[1], "scores.pt")):
            proc = subprocess.run(
                [sys.executable, "-m", "driftless.recipes.alignment", role, str(tmp / "model.safetensors"),
                 str(tmp / "job.pt"), str(tmp / out)],
                env={**os.environ, **env}, capture_output=True, text=True, check=False)
            if proc.returncode != 0:
                raise RuntimeError(f"the {role} process failed (environment {env}):\n{proc.stderr[-2000:]}")
        sampled = torch.load(tmp / "batch.pt", weights_only=False)
        scored = torch.load(tmp / "scores.pt", weights_only=False)
    batch = RolloutBatch(**sampled["batch"], sampling=params)
    result = _compare(batch, scored["logp"], scored["head"], scored["routes"])
    result["sampler_process"] = {**envs[0], **sampled["info"]}
    result["trainer_process"] = {**envs[1], **scored["info"]}
    return result


def cross_process_checks(model, prompts, **kwargs) -> dict:
    """``cross_process_check`` for every pair of ``kernel_pairs()``: totals plus each pair, named.

    A CPU with a single kernel set gives ``{"skipped": reason}``."""
    pairs = kernel_pairs()
    if not pairs:
        return {"skipped": f"this CPU runs only one kernel set ({reported_kernel_set()!r}): nothing to compare"}
    results = [cross_process_check(model, prompts, envs=pair, **kwargs) for pair in pairs]
    tokens = sum(r["tokens"] for r in results)
    out = {
        "tokens": tokens,
        "bitwise_equal_fraction": sum(r["bitwise_equal_fraction"] * r["tokens"] for r in results) / max(tokens, 1),
        "max_abs_logp_diff": max(r["max_abs_logp_diff"] for r in results),
        "kl_k3": sum(r["kl_k3"] * r["tokens"] for r in results) / max(tokens, 1),
        "pairs": [{"sampler": describe_profile(s), "trainer": describe_profile(t), "tokens": r["tokens"],
                   "bitwise_equal_fraction": r["bitwise_equal_fraction"], "max_abs_logp_diff": r["max_abs_logp_diff"],
                   **({"routes_equal_fraction": r["routes_equal_fraction"]} if "routes_equal_fraction" in r else {})}
                  for (s, t), r in zip(pairs, results)],
    }
    layers = sum(r.get("token_layers", 0) for r in results)
    if layers:
        out["routes_equal_fraction"] = sum(r["routes_equal_fraction"] * r["token_layers"] for r in results) / layers
    return out


if __name__ == "__main__":
    import sys

    _worker(*sys.argv[1:5])
