"""Sampler throughput (fast / aligned / transformers generate) and the cost of alignment; prints JSON.

    .venv/bin/python bench/rollout.py                      # batch 16, prompt 8, 64 new tokens, 7 rounds
    .venv/bin/python bench/rollout.py --batch 64 --new-tokens 96 --threads 1

Three executions of TinyLM (default sizes): ``fast``, ``aligned`` (the fused aligned pieces,
``driftless.ops.fuse``) and ``aligned_eager`` (the same bits, each op its own kernel: what
aligned execution cost before fusion, and what it costs where inductor cannot build). Each
measurement (sampler decode, full forward, forward + backward) runs in ``--repeats`` rounds, the
executions interleaved within a round so that load on the machine hits all of them alike; the
JSON gives each one's median and range and each ratio's median and range over the rounds.

``ops_per_decode_step``: what one decode step dispatches from Python (one aten call or one
compiled-graph call each; ops inside a compiled graph are fused loops and do not count). The
FLOP-bound estimate is 2 · parameters per token against a measured float32 GEMM rate;
``gemm_gflops_1024x512x512`` compares that rate with aligned mode's fixed-order GEMM
(``ops.fixed_mm``, b in the padded rows aligned weights are kept in) and a float64 GEMM (what
aligned GEMMs were before it); ``linear_gemm_us`` times each linear layer's GEMM at forward and
decode sizes both ways.

The transformers model is a Qwen3 config with TinyLM's default sizes (hidden 192, 4 layers,
3 heads of 64, 1 KV head, FFN 512, vocabulary 64), randomly initialised; both generate exactly
--new-tokens tokens per row (no EOS), temperature 1, no filtering.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch

MODES = ("fast", "aligned", "aligned_eager")


def top_level_ops(fn) -> dict:
    """Calls ``fn`` under the profiler; counts the ops dispatched from Python (not those inside them)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    aten = graphs = 0
    for e in prof.events():
        parent = e.cpu_parent
        while parent is not None and not parent.name.startswith(("aten::", "## Call CompiledFxGraph")):
            parent = parent.cpu_parent
        if parent is not None:
            continue
        if e.name.startswith("aten::"):
            aten += 1
        elif e.name.startswith("## Call CompiledFxGraph"):
            graphs += 1
    return {"aten_ops": aten, "compiled_graphs": graphs, "total": aten + graphs}


def gemm_gflops(mm=torch.mm, dtype=torch.float32, layout=None) -> float:
    """GFLOP/s of ``mm`` at 1024 x 512 x 512; ``layout`` prepares b once, as a model keeps its weights."""
    a, b = torch.randn(1024, 512, dtype=dtype), torch.randn(512, 512, dtype=dtype)
    b = layout(b) if layout is not None else b
    for _ in range(3):
        mm(a, b)
    n, t0 = 50, time.perf_counter()
    for _ in range(n):
        mm(a, b)
    return 2 * 1024 * 512 * 512 * n / (time.perf_counter() - t0) / 1e9


def linear_gemm_us(config, rows: dict[str, int]) -> dict:
    """Median µs of each linear layer's GEMM of the model, fp32 BLAS (as fast mode's ``F.linear``) vs
    the fixed-order GEMM on the weight as aligned mode keeps it: where a machine's aligned cost sits."""
    from driftless.ops.exact import linear_weight
    from driftless.ops.fixed_mm import fixed_order_mm

    d, hd = config.d_model, config.head_dim
    shapes = {"wq|wk|wv": ((config.n_head + 2 * config.n_kv_head) * hd, d), "wo": (d, config.n_head * hd),
              "w_gate|w_up": (2 * config.d_ff, d), "w_down": (d, config.d_ff), "lm_head": (config.vocab_size, d)}
    out = {}
    for name, (n, k) in shapes.items():
        w = torch.randn(n, k)
        wt = linear_weight(w)
        for kind, m in rows.items():
            x = torch.randn(m, k)
            per = {}
            for label, fn, b in (("fp32_blas", torch.nn.functional.linear, w), ("fixed_order", fixed_order_mm, wt)):
                for _ in range(3):
                    fn(x, b)
                times = []
                for _ in range(20):
                    t0 = time.perf_counter()
                    fn(x, b)
                    times.append(time.perf_counter() - t0)
                per[label] = statistics.median(times) * 1e6
            out[f"{name} {kind} {m}x{k}x{n}"] = per
    return out


def summary(times: list[float]) -> dict:
    return {"median": statistics.median(times), "min": min(times), "max": max(times)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=7, help="rounds (each mode once per round, after a warm-up)")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--no-transformers", action="store_true")
    ap.add_argument("--profile", action="store_true",
                    help="also profile one full forward per execution: GEMM time (aten::mm, bmm, the fixed-order GEMM) against the total")
    args = ap.parse_args()
    for name in ("batch", "prompt_len", "new_tokens", "repeats", "threads"):
        if getattr(args, name) < 1:
            raise SystemExit(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    torch.set_num_threads(args.threads)

    from driftless.models import TinyLM, TinyLMConfig
    from driftless.ops.fuse import fused_enabled, fusion_failure, set_fused
    from driftless.rollout import Sampler, SamplingParams, Snapshot

    config = TinyLMConfig()
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(2, config.vocab_size, (args.batch, args.prompt_len), generator=g)
    full = torch.randint(2, config.vocab_size, (args.batch, args.prompt_len + args.new_tokens), generator=g)
    params = SamplingParams()
    n_tokens = args.batch * args.new_tokens
    base = TinyLM(config)
    base.reset_parameters(seed=0)
    n_params = sum(p.numel() for p in base.parameters())

    def fused_for(mode):
        set_fused(False if mode == "aligned_eager" else None)

    models, samplers = {}, {}
    for mode in MODES:
        fused_for(mode)
        model = TinyLM(config, execution="fast" if mode == "fast" else "aligned")
        model.load_state_dict(base.state_dict())
        models[mode] = model
        samplers[mode] = Sampler(model, head_k=32)
        samplers[mode].load(Snapshot.of(base, 0))

    def forward_backward(model):
        model.zero_grad(set_to_none=True)
        torch.log_softmax(model(full), -1).mean().backward()

    jobs = {
        "sampler": lambda m: samplers[m].generate(prompts.tolist(), params, args.new_tokens, seed=1),
        "forward": lambda m: torch.no_grad()(models[m])(full),
        "forward_backward": lambda m: forward_backward(models[m]),
    }
    times = {job: {m: [] for m in MODES} for job in jobs}
    compile_s = {}
    for job, fn in jobs.items():
        for mode in MODES:  # warm-up (and, for the fused path, the compiles)
            fused_for(mode)
            t0 = time.perf_counter()
            fn(mode)
            compile_s[f"{job}_{mode}_first_call"] = time.perf_counter() - t0
        for _ in range(args.repeats):
            for mode in MODES:
                fused_for(mode)
                t0 = time.perf_counter()
                fn(mode)
                times[job][mode].append(time.perf_counter() - t0)

    ops = {}
    for mode in MODES:
        fused_for(mode)
        model = models[mode]
        cache = model.new_cache(args.batch)
        with torch.no_grad():
            model.prefill(prompts, torch.full((args.batch,), args.prompt_len), cache)
            step = prompts[:, -1]
            pos = torch.full((args.batch,), args.prompt_len)
            model.decode(step, pos, cache)  # warm
            ops[mode] = top_level_ops(lambda model=model, cache=cache, step=step, pos=pos: model.decode(step, pos + 1, cache))
    set_fused(None)

    out: dict = {"batch": args.batch, "prompt_len": args.prompt_len, "new_tokens": args.new_tokens,
                 "threads": args.threads, "repeats": args.repeats, "torch": torch.__version__,
                 "cpu_capability": torch.backends.cpu.get_cpu_capability(),
                 "fused_available": fused_enabled(), "fusion_failure": fusion_failure()}
    out["seconds"] = {job: {m: summary(v) for m, v in by_mode.items()} for job, by_mode in times.items()}
    out["first_call_seconds"] = compile_s
    out["ratios"] = {}
    for job, by_mode in times.items():
        for mode in ("aligned", "aligned_eager"):
            per_round = [a / f for a, f in zip(by_mode[mode], by_mode["fast"])]
            out["ratios"][f"{job}_{mode}_vs_fast"] = {
                "of_medians": statistics.median(by_mode[mode]) / statistics.median(by_mode["fast"]),
                "per_round_min": min(per_round), "per_round_max": max(per_round)}
    out["ops_per_decode_step"] = ops
    if args.profile:
        from torch.profiler import ProfilerActivity, profile, record_function

        from driftless.ops import fixed_mm

        # eager calls run the kernel directly (no op for the profiler to see): name them while profiling
        eager_run = fixed_mm._run

        def recorded_run(a, b):
            with record_function("driftless::fixed_order_bmm"):
                return eager_run(a, b)

        out["forward_profile_ms"] = {}
        fixed_mm._run = recorded_run
        try:
            for mode in MODES:
                fused_for(mode)
                with torch.no_grad(), profile(activities=[ProfilerActivity.CPU]) as prof:
                    models[mode](full)
                table = prof.key_averages()
                out["forward_profile_ms"][mode] = {
                    "gemm": sum(e.self_cpu_time_total for e in table if e.key in ("aten::mm", "aten::bmm", "driftless::fixed_order_bmm")) / 1e3,
                    "total": sum(e.self_cpu_time_total for e in table) / 1e3}
        finally:
            fixed_mm._run = eager_run
        set_fused(None)
    out["tokens_per_second"] = {f"sampler_{m}": n_tokens / statistics.median(times["sampler"][m]) for m in MODES}
    from driftless.ops.fixed_mm import fixed_order_mm, gemm_layout

    gflops = gemm_gflops()
    out["flop_bound"] = {"params": n_params, "fp32_gemm_gflops": gflops,
                         "tokens_per_second_if_gemm_bound": gflops * 1e9 / (2 * n_params)}
    # the GEMM rates behind the aligned/fast ratio: aligned mode's fixed-order GEMM against fp32 and fp64 BLAS
    out["gemm_gflops_1024x512x512"] = {"fp32_blas": gflops, "fixed_order": gemm_gflops(fixed_order_mm, layout=gemm_layout),
                                       "fp64_blas": gemm_gflops(dtype=torch.float64)}
    out["linear_gemm_us"] = linear_gemm_us(config, rows={"forward": args.batch * (args.prompt_len + args.new_tokens),
                                                         "decode": args.batch})

    if not args.no_transformers:
        try:
            from driftless.models.hf import HFPolicy, tiny_qwen3_config
        except ImportError:
            pass
        else:
            hf = HFPolicy(tiny_qwen3_config(vocab_size=config.vocab_size, hidden=config.d_model,
                                            layers=config.n_layer, heads=config.n_head, kv_heads=config.n_kv_head,
                                            intermediate=config.d_ff, max_positions=config.max_seq_len)).model
            mask = torch.ones_like(prompts)

            def hf_generate():
                with torch.no_grad():
                    hf.generate(input_ids=prompts, attention_mask=mask, do_sample=True, top_k=0, top_p=1.0,
                                temperature=1.0, max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens,
                                pad_token_id=0, eos_token_id=None)
            hf_generate()
            hf_times = []
            for _ in range(args.repeats):
                t0 = time.perf_counter()
                hf_generate()
                hf_times.append(time.perf_counter() - t0)
            out["seconds"]["transformers_generate"] = summary(hf_times)
            out["tokens_per_second"]["transformers_generate"] = n_tokens / statistics.median(hf_times)
            out["sampler_fast_speedup_vs_transformers_generate"] = (
                statistics.median(hf_times) / statistics.median(times["sampler"]["fast"]))
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
