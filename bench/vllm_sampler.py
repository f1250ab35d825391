"""vLLM sampler vs the built-in Sampler on the same tiny transformers model; prints JSON.

    .venv-vllm/bin/python bench/vllm_sampler.py                   # batch 16, prompt 8, 64 new tokens
    .venv-vllm/bin/python bench/vllm_sampler.py --batch 128 --new-tokens 96

Needs the vLLM environment (`make test-vllm` builds it). The model is a Qwen3 config with
TinyLM's default sizes (hidden 192, 4 layers, 3 heads of 64, 1 KV head, FFN 512, vocabulary
64), randomly initialised; both samplers record the same fields (log q under the transform,
the top-32 head, versions) and generate exactly --new-tokens tokens per row (no EOS),
temperature 1, no filtering. Median of --repeats after one warm-up. Also reports the engine's
start-up and weight-sync times and the q mismatch of the two against the trainer.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
from _timing import timed

os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")  # vLLM logs to stdout: keep the JSON clean


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--head-k", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()

    import transformers

    from driftless.models.hf import HFPolicy
    from driftless.rollout import Sampler, SamplingParams, Snapshot, score_batch
    from driftless.rollout.vllm import VLLMSampler

    config = transformers.Qwen3Config(vocab_size=64, hidden_size=192, intermediate_size=512, num_hidden_layers=4,
                                      num_attention_heads=3, num_key_value_heads=1, head_dim=64,
                                      max_position_embeddings=256, tie_word_embeddings=False)
    torch.manual_seed(0)
    trainer = HFPolicy(config)
    snapshot = Snapshot.of(trainer, 0)
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(2, 64, (args.batch, args.prompt_len), generator=g).tolist()
    params, n_tokens = SamplingParams(), args.batch * args.new_tokens

    builtin = Sampler(HFPolicy(config), head_k=args.head_k)
    builtin.load(snapshot)
    t0 = time.perf_counter()
    engine = VLLMSampler(HFPolicy(config), head_k=args.head_k)
    start_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    engine.load(snapshot)
    sync_s = time.perf_counter() - t0

    out: dict = {"batch": args.batch, "prompt_len": args.prompt_len, "new_tokens": args.new_tokens,
                 "head_k": args.head_k, "threads": torch.get_num_threads(), "cpu_count": os.cpu_count(),
                 "engine_start_s": start_s, "weight_sync_s": sync_s}
    for name, sampler in (("builtin", builtin), ("vllm", engine)):
        t = timed(lambda s=sampler: s.generate(prompts, params, args.new_tokens, seed=1), args.repeats)
        batch = sampler.generate(prompts, params, args.new_tokens, seed=1)
        m = batch.action_mask
        assert int(m.sum()) == n_tokens, (name, int(m.sum()))
        with torch.no_grad():
            diff = (score_batch(trainer, batch).logp[m] - batch.sampler_logp[m]).abs()
        out[name] = {"seconds": t, "tokens_per_s": n_tokens / t, "max_abs_logp_diff_vs_trainer": float(diff.max())}
    out["vllm_vs_builtin_tokens_per_s"] = out["vllm"]["tokens_per_s"] / out["builtin"]["tokens_per_s"]
    engine.close()
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
