"""The rollout engine: batched generation with a KV cache over a versioned weight snapshot.

For every action token it records the token, log q under the exact sampling transform, the
sampler's top-k head (ids and log q, sorted by decreasing q), the weight version that computed
its logits and ``kv_version``: the oldest weight version among the cached keys and values those
logits attended to. The sampler owns its own copy of the policy, so a mismatch view (quantized
weights, noise, lower precision, a different execution mode) changes only the sampler's copy.

In-flight refresh: with ``weights`` (a callable returning a newer Snapshot or None), the
sampler asks for new weights before every ``refresh_every``-th token and, per ``refresh``:

- ``pin``: never; every response finishes under the version it started with;
- ``recompute``: loads them and rebuilds the KV cache of every row under the new weights
  (AReaL, verl's partial rollout): ``kv_version == version`` on every token;
- ``retain``: loads them and keeps the stale cache (PipelineRL): later tokens have
  ``kv_version < version``, a hybrid state that no single snapshot reproduces.

Each refresh is an event in ``batch.meta["refreshes"]`` (step, old and new version, policy).
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field

import torch

from driftless.models.io import adopt_state, clone_state
from driftless.rollout.batch import RolloutBatch
from driftless.rollout.engine import REFRESH_POLICIES, EndIds, assemble, check_request, prepare
from driftless.rollout.sampling import SamplingParams, draw_rows, is_aligned, sampling_logprobs
from driftless.rollout.snapshot import Snapshot

__all__ = ["REFRESH_POLICIES", "Sampler", "Snapshot", "check_request"]


@dataclass
class _Decoded:
    """What the decode loop records per step, for every row (packed into the batch afterwards)."""

    steps: dict[str, list] = field(default_factory=lambda: {
        "token": [], "logq": [], "active": [], "head_ids": [], "head_logp": [], "version": [], "kv_version": []})
    events: list[dict] = field(default_factory=list)
    end: torch.Tensor | None = None  # [B] each row's length
    routes: torch.Tensor | None = None  # [B, total, layers, k] the MoE layers' expert ids per input position


class _Routes:
    """The expert ids a mixture-of-experts policy selects (``policy.route_shape``), recorded per input position
    as its forwards run (−1 where none ran); a dense policy records nothing."""

    def __init__(self, policy, rows: int, width: int):
        self.policy, shape = policy, getattr(policy, "route_shape", None)
        self.ids = None
        if shape is not None:
            layers, k = shape
            dtype = torch.int8 if policy.n_experts <= 127 else torch.int16  # the smallest that holds them
            self.ids = torch.full((rows, width, layers, k), -1, dtype=dtype)

    @contextlib.contextmanager
    def forward(self, positions: torch.Tensor, keep: torch.Tensor):
        """Around one forward over ``positions [B, T]``; routes are kept where ``keep [B, T]``."""
        if self.ids is None:
            yield
            return
        self.policy.routes = []
        try:
            yield
            got = torch.stack(self.policy.routes, 2).cpu()  # [B, T, layers, k]
        finally:
            self.policy.routes = None
        rows = torch.arange(positions.shape[0])[:, None].expand_as(positions)
        self.ids[rows[keep], positions[keep]] = got[keep].to(self.ids.dtype)


def row_uniforms(row_seeds: list[int], steps: int) -> torch.Tensor:
    """``[B, steps]`` float64 uniforms in [0, 1), row i's from its own generator seeded ``row_seeds[i]``."""
    return torch.stack([torch.rand(steps, generator=torch.Generator().manual_seed(int(s)), dtype=torch.float64)
                        for s in row_seeds]) if row_seeds else torch.zeros(0, steps, dtype=torch.float64)


def _adoptable(policy, state: dict) -> bool:
    """Whether ``state``'s tensors can become ``policy``'s own: the same names, shapes, dtypes and devices."""
    own = policy.state_dict(keep_vars=True)
    return own.keys() == state.keys() and all(
        t.shape == own[k].shape and t.dtype == own[k].dtype and t.device == own[k].device for k, t in state.items())


def _holds(policy, state: dict) -> bool:
    """Whether ``policy``'s own tensors already are ``state``'s (the same storage, offset and shape)."""
    own = policy.state_dict()
    return all(own[k].data_ptr() == t.data_ptr() and own[k].shape == t.shape for k, t in state.items())


def _device(policy) -> torch.device:
    """Where ``policy``'s weights are (the CPU for a policy without parameters)."""
    params = getattr(policy, "parameters", None)
    first = next(iter(params()), None) if params is not None else None
    return first.device if first is not None else torch.device("cpu")


class Sampler(EndIds):
    """Generate from a policy copy; ``load(snapshot)`` syncs it to published weights.

    ``version``: the weight version ``policy`` already holds (None: call ``load`` first)."""

    def __init__(self, policy, *, head_k: int = 32, eos_id: int | tuple[int, ...] | None = None, pad_id: int = 0, view=None,
                 version: int | None = None, decode_latency: float = 0.0):
        if head_k < 0:
            raise ValueError(f"head_k must be >= 0, got {head_k}")
        if not decode_latency >= 0:
            raise ValueError(f"decode_latency must be >= 0 seconds, got {decode_latency}")
        self.decode_latency = decode_latency  # seconds slept per decode step: a slower (larger) model's token time
        self.policy = policy
        self.head_k = head_k
        self.eos_id = eos_id  # every id that ends a response (a checkpoint may have several): self.eos_ids
        self.pad_id = pad_id
        self.view = view  # a mismatch view applied at every load (driftless.mismatch)
        self.version: int | None = version
        self.adopted = False  # the policy's tensors are a shared snapshot's (the trainer's own): never written into

    @property
    def unviewed(self) -> bool:
        """No mismatch view changes the weights this engine holds (None, or the empty ``mismatch.view=none``)."""
        return self.view is None or getattr(self.view, "identity", False)

    def load(self, snapshot: Snapshot) -> None:
        """Hold ``snapshot``'s weights: copied into the policy, or, for a shared snapshot (``Snapshot.sharing``) with
        no view to apply and matching devices and dtypes, adopted as the policy's own tensors (no copy)."""
        if not isinstance(snapshot, Snapshot):
            raise ValueError(f"Sampler.load needs a Snapshot with a version, got {type(snapshot).__name__}")
        with torch.no_grad():
            if snapshot.shared and self.unviewed and _adoptable(self.policy, snapshot.state):
                if not (self.adopted and _holds(self.policy, snapshot.state)):  # the same tensors: nothing to do
                    adopt_state(self.policy, snapshot.state)  # (new Parameters would refill id-keyed caches)
                self.adopted = True
            elif self.adopted:  # copying would write into the trainer's tensors: take copies of our own instead
                adopt_state(self.policy, clone_state(snapshot.state))
                self.adopted = False
            else:
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
        weights=None,
        refresh: str = "pin",
        refresh_every: int = 8,
        row_seeds: list[int] | None = None,
    ) -> RolloutBatch:
        """``row_seeds``: one seed per prompt (``rollout.draws=row``): each row draws from its own stream by
        ``draw_rows``, so a row's tokens do not depend on which rows are generated beside it (the ranks of
        sharded generation each generate a share and get the whole batch's rows). None: one generator seeded
        by ``seed`` draws for the whole batch (``torch.multinomial``)."""
        params, seed = prepare(self, prompts, params, max_new_tokens, seed=seed, refresh=refresh,
                               refresh_every=refresh_every)
        if row_seeds is not None and len(row_seeds) != len(prompts):
            raise ValueError(f"row_seeds: one per prompt ({len(prompts)}), got {len(row_seeds)}")
        ctx = self.policy.max_seq_len
        plen = torch.tensor([len(p) for p in prompts])
        total = min(int(plen.max()) + max_new_tokens, ctx)
        tokens = torch.full((len(prompts), total), self.pad_id, dtype=torch.long)
        for i, p in enumerate(prompts):
            tokens[i, : len(p)] = torch.tensor(p)
        limit = torch.clamp(plen + max_new_tokens, max=ctx)  # per-row end (exclusive)
        if row_seeds is None:
            gen = torch.Generator().manual_seed(seed)

            def draw(logq, n_step):
                return torch.multinomial(logq.exp(), 1, generator=gen).squeeze(-1)
        else:
            uniforms = row_uniforms(row_seeds, max_new_tokens)  # [B, max_new_tokens]

            def draw(logq, n_step):
                return draw_rows(logq, uniforms[:, n_step])
        decoded = self._decode(tokens, plen, limit, params, draw, weights, refresh, refresh_every)
        return self._pack(tokens, plen, decoded, params, group)

    def _decode(self, tokens, plen, limit, params: SamplingParams, draw, weights, refresh: str,
                refresh_every: int) -> _Decoded:
        """The decode loop: prefill, then one token per step for every active row, refreshing weights per
        ``refresh``; records per step the token, log q, head, version and kv_version."""
        policy, b = self.policy, tokens.shape[0]
        exact = is_aligned(policy)
        ctx, total = policy.max_seq_len, tokens.shape[1]
        k = min(self.head_k, policy.vocab_size)
        device = _device(policy)  # the forwards run there; the bookkeeping stays on the CPU
        out = _Decoded()
        routes = _Routes(policy, b, total)  # a mixture of experts' selections, as the forwards make them
        cache = policy.new_cache(b)
        span = torch.arange(int(plen.max()))[None, :].expand(b, -1)
        with routes.forward(span, span < plen[:, None]):
            prompt = tokens[:, : int(plen.max())].to(device)
            if hasattr(policy, "prefill_last"):  # the last prompt position's logits only (a large vocabulary)
                last = policy.prefill_last(prompt, plen.to(device), cache).cpu()  # [B, V]
            else:
                last = policy.prefill(prompt, plen.to(device), cache).cpu()[torch.arange(b), plen - 1]  # [B, V]
        last_version = self.version  # the weights that computed `last`
        kv_oldest = torch.full((b,), self.version, dtype=torch.long)  # oldest version in each row's cache
        pos = plen.clone()  # where each row's next token goes
        done = torch.zeros(b, dtype=torch.bool)
        seq = tokens.clone()  # prompt + what has been generated so far (for a recompute)
        steps = out.steps
        while True:
            active = ~done & (pos < limit)
            if not active.any():
                break
            n_step = len(steps["token"])
            if weights is not None and refresh != "pin" and n_step and n_step % refresh_every == 0:
                snapshot = weights()
                if snapshot is not None and snapshot.version != self.version:
                    out.events.append({"step": n_step, "from": self.version, "to": snapshot.version,
                                       "policy": refresh})
                    self.load(snapshot)
                    if refresh == "recompute":  # rebuild every row's cache under the new weights
                        cache = policy.new_cache(b)
                        # each token keeps the routes of the forward that computed its logits: of the rebuilt
                        # cache, only the last position's (the next token's) are new
                        span = torch.arange(int(pos.max()))[None, :].expand(b, -1)
                        with routes.forward(span, (span == (pos - 1)[:, None]) & active[:, None]):
                            logits = policy.prefill(seq[:, : int(pos.max())].to(device), pos.to(device), cache).cpu()
                        last = logits[torch.arange(b), pos - 1]
                        last_version = self.version
                        kv_oldest = torch.full((b,), self.version, dtype=torch.long)
            logq = sampling_logprobs(last, params, exact=exact)  # [B, V] under the exact transform
            if params.greedy:
                tok = logq.argmax(-1)
            else:
                tok = draw(logq, n_step)
            if self.decode_latency:
                time.sleep(self.decode_latency)
            steps["token"].append(tok)
            steps["logq"].append(logq.gather(1, tok[:, None]).squeeze(1).float())
            steps["active"].append(active)
            steps["version"].append(torch.full((b,), last_version, dtype=torch.long))
            steps["kv_version"].append(kv_oldest.clone())
            if k:
                top = torch.topk(logq, k, dim=-1)
                steps["head_ids"].append(top.indices)
                steps["head_logp"].append(top.values.float())
            if self.eos_ids:
                done |= active & torch.isin(tok, torch.tensor(self.eos_ids))
            seq[active, pos[active].clamp(max=total - 1)] = tok[active]
            pos = pos + active.long()
            if not (~done & (pos < limit)).any():
                break
            # feed each row's new token at its position (finished rows feed junk into a slot they no longer read)
            fed = torch.clamp(pos - 1, max=ctx - 1)
            with routes.forward(fed[:, None], active[:, None]):
                last = policy.decode(tok.to(device), fed.to(device), cache).cpu()
            last_version = self.version
            kv_oldest = torch.clamp(kv_oldest, max=self.version)  # the slot just written holds this version
        out.end = pos
        out.routes = routes.ids
        return out

    def _pack(self, tokens, plen, decoded: _Decoded, params: SamplingParams, group) -> RolloutBatch:
        """Write the per-step records at each row's positions plen + step, in one scatter per field."""
        steps, b = decoded.steps, tokens.shape[0]
        n_steps = len(steps["token"])
        act = torch.stack(steps["active"], 1)  # [B, S]; a row is active for a prefix of the steps
        where = plen[:, None] + torch.arange(n_steps)[None, :]  # [B, S]
        width = tokens.shape[1] + n_steps  # scratch room so inactive steps never collide with real positions

        def place(values, fill, dtype, tail=()):
            buf = torch.full((b, width, *tail), fill, dtype=dtype)
            index = where.view(b, n_steps, *[1] * len(tail)).expand(b, n_steps, *tail)
            return buf.scatter_(1, index, values)

        used = int(decoded.end.max())
        tokens = torch.cat([tokens, torch.full((b, n_steps), self.pad_id, dtype=torch.long)], 1)
        tokens = torch.where(place(act, False, torch.bool), place(torch.stack(steps["token"], 1), 0, torch.long), tokens)
        head_ids = head_logp = None
        if steps["head_ids"]:
            act_k, k = act[..., None], steps["head_ids"][0].shape[-1]
            head_ids = place(torch.where(act_k, torch.stack(steps["head_ids"], 1), 0), 0, torch.long, (k,))[:, :used]
            head_logp = place(torch.where(act_k, torch.stack(steps["head_logp"], 1), 0.0), 0.0, torch.float32,
                              (k,))[:, :used]
        routes = {} if decoded.routes is None else {
            "sampler_routes": decoded.routes[:, :used], "n_experts": int(self.policy.n_experts)}
        return assemble(
            **routes, tokens=tokens[:, :used], prompt_len=plen, length=decoded.end, mask=place(act, False, torch.bool)[:, :used],
            logq=place(torch.where(act, torch.stack(steps["logq"], 1), 0.0), 0.0, torch.float32)[:, :used],
            version=place(torch.where(act, torch.stack(steps["version"], 1), -1), -1, torch.long)[:, :used],
            kv_version=place(torch.where(act, torch.stack(steps["kv_version"], 1), -1), -1, torch.long)[:, :used],
            params=params, head_ids=head_ids, head_logp=head_logp, group=group,
            meta={"refreshes": decoded.events} if decoded.events else {})
