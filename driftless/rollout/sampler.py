"""The rollout engine: batched generation with a KV cache over a versioned weight snapshot.

For every action token it records the token, log q under the exact sampling transform, the
sampler's top-k head (ids and log q, sorted by decreasing q) and the weight version. The
sampler owns its own copy of the policy, so a mismatch view (quantized weights, noise, lower
precision, a different execution mode) changes only the sampler's copy.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from driftless.rollout.batch import RolloutBatch
from driftless.rollout.sampling import SamplingParams, sampling_logprobs


@dataclass
class Snapshot:
    """Published trainer weights and the version number they carry."""

    state: dict
    version: int

    def __post_init__(self):
        if self.version is None or not isinstance(self.version, int) or self.version < 0:
            raise ValueError(f"a snapshot needs an integer version >= 0, got {self.version!r}")

    @classmethod
    def of(cls, model, version: int) -> "Snapshot":
        return cls({k: v.detach().clone() for k, v in model.state_dict().items()}, version)


class Sampler:
    """Generate from a policy copy; ``load(snapshot)`` syncs it to published weights."""

    def __init__(self, policy, *, head_k: int = 32, eos_id: int | None = None, pad_id: int = 0, view=None):
        if head_k < 0:
            raise ValueError(f"head_k must be >= 0, got {head_k}")
        self.policy = policy
        self.head_k = head_k
        self.eos_id = eos_id
        self.pad_id = pad_id
        self.view = view  # a mismatch view applied at every load (driftless.mismatch)
        self.version: int | None = None

    def load(self, snapshot: Snapshot) -> None:
        if not isinstance(snapshot, Snapshot):
            raise ValueError(f"Sampler.load needs a Snapshot with a version, got {type(snapshot).__name__}")
        with torch.no_grad():
            self.policy.load_state_dict(snapshot.state)
            if self.view is not None:
                self.view.apply(self.policy)
        self.version = snapshot.version

    @torch.no_grad()
    def generate(
        self,
        prompts: list[list[int]],
        params: SamplingParams | None = None,
        max_new_tokens: int = 32,
        *,
        seed: int | None = None,
        group: list[int] | torch.Tensor | None = None,
    ) -> RolloutBatch:
        params = params or SamplingParams()
        if self.version is None:
            raise ValueError("the sampler has no weight version: call load(Snapshot(state, version)) first")
        policy = self.policy
        ctx, vocab = policy.max_seq_len, policy.vocab_size
        if not prompts:
            raise ValueError("prompts is empty")
        for i, p in enumerate(prompts):
            if len(p) == 0:
                raise ValueError(f"prompt {i} is empty")
            if len(p) >= ctx:
                raise ValueError(f"prompt {i} has {len(p)} tokens; the context holds {ctx} (need room to generate)")
            bad = [t for t in p if not 0 <= t < vocab]
            if bad:
                raise ValueError(f"prompt {i} holds token ids outside [0, {vocab}): {bad[:5]}")
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        if params.top_k > vocab:
            raise ValueError(f"top_k={params.top_k} is larger than the vocabulary ({vocab})")
        if seed is None:  # drawn from the global generator: reproducible under torch.manual_seed
            seed = int(torch.randint(0, 2**62, (1,)))
        gen = torch.Generator().manual_seed(seed)
        b = len(prompts)
        plen = torch.tensor([len(p) for p in prompts])
        total = min(int(plen.max()) + max_new_tokens, ctx)
        tokens = torch.full((b, total), self.pad_id, dtype=torch.long)
        for i, p in enumerate(prompts):
            tokens[i, : len(p)] = torch.tensor(p)
        k = min(self.head_k, vocab)
        logq_tok = torch.zeros(b, total, dtype=torch.float32)
        version = torch.full((b, total), -1, dtype=torch.long)
        mask = torch.zeros(b, total, dtype=torch.bool)
        head_ids = torch.zeros(b, total, k, dtype=torch.long)
        head_logp = torch.zeros(b, total, k, dtype=torch.float32)
        limit = torch.clamp(plen + max_new_tokens, max=ctx)  # per-row end (exclusive)

        cache = policy.new_cache(b)
        prefill = policy.prefill(tokens[:, : int(plen.max())], plen, cache)  # [B, T, V]
        last = prefill[torch.arange(b), plen - 1]  # [B, V]
        pos = plen.clone()  # where each row's next token goes
        done = torch.zeros(b, dtype=torch.bool)
        rows = torch.arange(b)
        while True:
            active = ~done & (pos < limit)
            if not active.any():
                break
            logq = sampling_logprobs(last, params)  # [B, V]
            if params.greedy:
                tok = logq.argmax(-1)
            else:
                tok = torch.multinomial(logq.exp(), 1, generator=gen).squeeze(-1)
            a = rows[active]
            p_a = pos[active]
            tokens[a, p_a] = tok[active]
            logq_tok[a, p_a] = logq[active, tok[active]].float()
            version[a, p_a] = self.version
            mask[a, p_a] = True
            if k:
                top = torch.topk(logq[active], k, dim=-1)
                head_ids[a, p_a] = top.indices
                head_logp[a, p_a] = top.values.float()
            if self.eos_id is not None:
                done |= active & (tok == self.eos_id)
            pos = torch.where(active, pos + 1, pos)
            if not (~done & (pos < limit)).any():
                break
            feed_pos = torch.clamp(pos - 1, max=ctx - 1)
            feed_tok = tokens[rows, feed_pos]
            last = policy.decode(feed_tok, feed_pos, cache)
        length = pos
        used = int(length.max())
        now = time.time()
        return RolloutBatch(
            tokens=tokens[:, :used].clone(),
            prompt_len=plen,
            length=length.clone(),
            action_mask=mask[:, :used].clone(),
            sampler_logp=logq_tok[:, :used].clone(),
            version=version[:, :used].clone(),
            sampling=params,
            sampler_topk_ids=head_ids[:, :used].clone() if k else None,
            sampler_topk_logp=head_logp[:, :used].clone() if k else None,
            group=torch.as_tensor(group, dtype=torch.long) if group is not None else torch.arange(b),
            created=torch.full((b,), now, dtype=torch.float64),
        )
