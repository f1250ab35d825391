"""Sampler throughput (fast / aligned / transformers generate) and the cost of alignment; prints JSON.

    .venv/bin/python bench/rollout.py                      # batch 16, prompt 8, 64 new tokens
    .venv/bin/python bench/rollout.py --batch 64 --new-tokens 96

The transformers model is a Qwen3 config with TinyLM's default sizes (hidden 192, 4 layers,
3 heads of 64, 1 KV head, FFN 512, vocabulary 64), randomly initialised; both generate exactly
--new-tokens tokens per row (no EOS), temperature 1, no filtering. Median of --repeats.
"""

from __future__ import annotations

import argparse
import json
import os

import torch
from _timing import timed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    from driftless.models import TinyLM, TinyLMConfig
    from driftless.rollout import Sampler, SamplingParams, Snapshot

    config = TinyLMConfig()
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(2, config.vocab_size, (args.batch, args.prompt_len), generator=g)
    params = SamplingParams()
    n_tokens = args.batch * args.new_tokens
    out: dict = {"batch": args.batch, "prompt_len": args.prompt_len, "new_tokens": args.new_tokens,
                 "threads": args.threads, "torch": torch.__version__}

    base = TinyLM(config)
    base.reset_parameters(seed=0)
    seconds = {}
    for mode in ("fast", "aligned"):
        model = TinyLM(config, execution=mode)
        model.load_state_dict(base.state_dict())
        sampler = Sampler(model, head_k=32)
        sampler.load(Snapshot.of(base, 0))
        seconds[f"sampler_{mode}"] = timed(
            lambda sampler=sampler: sampler.generate(prompts.tolist(), params, args.new_tokens, seed=1), args.repeats)
        full = torch.randint(2, config.vocab_size, (args.batch, args.prompt_len + args.new_tokens), generator=g)
        with torch.no_grad():
            seconds[f"forward_{mode}"] = timed(lambda model=model, full=full: model(full), args.repeats)

        def fwd_bwd(model=model, full=full):
            model.zero_grad(set_to_none=True)
            torch.log_softmax(model(full), -1).mean().backward()
        seconds[f"forward_backward_{mode}"] = timed(fwd_bwd, args.repeats)

    try:
        from driftless.models.hf import HFPolicy, tiny_qwen3_config

        hf = HFPolicy(tiny_qwen3_config(vocab_size=config.vocab_size, hidden=config.d_model, layers=config.n_layer,
                                        heads=config.n_head, kv_heads=config.n_kv_head, intermediate=config.d_ff,
                                        max_positions=config.max_seq_len)).model
        mask = torch.ones_like(prompts)

        def hf_generate():
            with torch.no_grad():
                hf.generate(input_ids=prompts, attention_mask=mask, do_sample=True, top_k=0, top_p=1.0,
                            temperature=1.0, max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens,
                            pad_token_id=0, eos_token_id=None)
        seconds["transformers_generate"] = timed(hf_generate, args.repeats)
    except ImportError:
        pass

    out["seconds"] = seconds
    out["tokens_per_second"] = {k: n_tokens / v for k, v in seconds.items()
                                if k.startswith(("sampler", "transformers"))}
    if "transformers_generate" in seconds:
        out["speedup_vs_transformers_generate"] = seconds["transformers_generate"] / seconds["sampler_fast"]
    out["aligned_vs_fast_forward_ratio"] = seconds["forward_aligned"] / seconds["forward_fast"]
    out["aligned_vs_fast_forward_backward_ratio"] = seconds["forward_backward_aligned"] / seconds["forward_backward_fast"]
    out["aligned_vs_fast_decode_ratio"] = seconds["sampler_aligned"] / seconds["sampler_fast"]
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
