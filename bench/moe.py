"""The cost of a mixture of experts' routes: bytes per token recorded, the time to record and to replay; prints JSON.

    .venv/bin/python bench/moe.py                    # the demo's TinyLM shape with 8 experts, top-2, 4 layers
    .venv/bin/python bench/moe.py --experts 16 --k 4 --repeats 5

``route_bytes_per_token``: what ``RolloutBatch.sampler_routes`` holds per position (layers × k ids in the
smallest integer dtype; int8 up to 127 experts). ``generate_s``: one sampler call of --rows prompts with
the routes recorded, against ``generate_unrecorded_s`` with the recorder off (the dense-model path);
``score_recompute_s`` / ``score_replay_s``: the trainer's scoring forward and backward with its own experts
and with the sampler's (R3). Medians over --repeats after a warm-up, fast execution, one process.
"""

from __future__ import annotations

import argparse
import json
from unittest import mock

import torch
from _timing import timed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--k", type=int, default=2)
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=24)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    from driftless.models import TinyLM, TinyLMConfig
    from driftless.rollout import Snapshot, score_batch
    from driftless.rollout import sampler as sampler_module
    from driftless.rollout.sampler import Sampler
    from driftless.rollout.sampling import SamplingParams

    config = TinyLMConfig(vocab_size=64, d_model=192, n_layer=4, n_head=3, n_kv_head=1, d_ff=256, max_seq_len=64,
                          n_experts=args.experts, experts_per_token=args.k)
    model = TinyLM(config)
    model.reset_parameters(seed=1)
    sampler = Sampler(TinyLM(config), head_k=0)
    sampler.load(Snapshot.of(model, 0))
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(1, 64, (int(n),), generator=g).tolist()
               for n in torch.randint(8, 20, (args.rows,), generator=g)]
    params = SamplingParams()

    def generate():
        return sampler.generate(prompts, params, max_new_tokens=args.new_tokens, seed=0)

    batch = generate()
    out = {"experts": args.experts, "k": args.k, "layers": config.n_layer, "rows": args.rows,
           "route_dtype": str(batch.sampler_routes.dtype),
           "route_bytes_per_token": batch.sampler_routes[0, 0].numel() * batch.sampler_routes.element_size(),
           "tokens": int(batch.length.sum())}
    out["generate_s"] = timed(generate, args.repeats)

    class _Off(sampler_module._Routes):  # the recorder switched off: what the forwards cost without it
        def __init__(self, policy, rows, width):
            super().__init__(policy, rows, width)
            self.ids = None

    with mock.patch.object(sampler_module, "_Routes", _Off):
        out["generate_unrecorded_s"] = timed(generate, args.repeats)

    def score(routing):
        def run():
            model.zero_grad(set_to_none=True)
            score_batch(model, batch, routing=routing).logp.sum().backward()
        return run

    out["score_recompute_s"] = timed(score("recompute"), args.repeats)
    out["score_replay_s"] = timed(score("replay"), args.repeats)
    out["record_overhead"] = out["generate_s"] / out["generate_unrecorded_s"] - 1
    out["replay_overhead"] = out["score_replay_s"] / out["score_recompute_s"] - 1
    out["torch"] = torch.__version__
    out["threads"] = torch.get_num_threads()
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
