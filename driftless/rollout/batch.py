"""RolloutBatch: the data spine. Padded tensors, right-padded, one row per response.

Per-token fields are aligned with ``tokens``: entry ``[b, t]`` describes token ``tokens[b, t]``
(predicted from the prefix ``tokens[b, :t]``). Position 0 is never an action.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch

from driftless.rollout.sampling import SamplingParams


@dataclass
class RolloutBatch:
    tokens: torch.Tensor  # [B, L] int64, prompt + completion, right-padded
    prompt_len: torch.Tensor  # [B]
    length: torch.Tensor  # [B] prompt + completion length
    action_mask: torch.Tensor  # [B, L] bool, tokens the policy chose
    sampler_logp: torch.Tensor  # [B, L] log q of the recorded token (0 off the mask)
    version: torch.Tensor  # [B, L] int64 weight version that sampled each token (−1 off the mask)
    sampling: SamplingParams = field(default_factory=SamplingParams)
    sampler_topk_ids: torch.Tensor | None = None  # [B, L, k] sorted by decreasing q
    sampler_topk_logp: torch.Tensor | None = None  # [B, L, k]
    group: torch.Tensor | None = None  # [B] prompt group ids
    reward: torch.Tensor | None = None  # [B]
    advantage: torch.Tensor | None = None  # [B] or [B, L]
    anchor_logp: torch.Tensor | None = None  # [B, L] π0, filled by the learner
    created: torch.Tensor | None = None  # [B] float64 unix time the response finished
    enqueued: torch.Tensor | None = None  # [B] float64 unix time it entered a queue
    kv_version: torch.Tensor | None = None  # [B, L] oldest weight version in the cache each token's logits read
    sampler_routes: torch.Tensor | None = None  # [B, L, layers, k] expert ids each MoE layer used at each input
    #   position (the smallest integer dtype that holds them; −1 where no forward read the position)
    n_experts: int | None = None  # the experts per MoE layer the routes index (checked when given)
    meta: dict = field(default_factory=dict)  # e.g. "refreshes": in-flight weight refresh events

    def __post_init__(self):
        self.validate()

    # -------------------------------------------------------------- validation
    def validate(self) -> None:
        def need(name, cond, msg):
            if not cond:
                raise ValueError(f"RolloutBatch.{name}: {msg}")

        t = self.tokens
        need("tokens", isinstance(t, torch.Tensor) and t.dim() == 2, f"must be [B, L], got {getattr(t, 'shape', t)}")
        need("tokens", t.dtype == torch.int64, f"must be int64, got {t.dtype}")
        b, l = t.shape
        for name in ("prompt_len", "length"):
            x = getattr(self, name)
            need(name, isinstance(x, torch.Tensor) and tuple(x.shape) == (b,), f"must have shape ({b},)")
        need("length", bool((self.length <= l).all()), f"exceeds the padded length {l}")
        need("prompt_len", bool((self.prompt_len >= 1).all()), "every prompt needs at least one token")
        need("prompt_len", bool((self.prompt_len <= self.length).all()), "is longer than the row's length")
        for name in ("action_mask", "sampler_logp", "version"):
            x = getattr(self, name)
            need(name, isinstance(x, torch.Tensor) and tuple(x.shape) == (b, l), f"must have shape ({b}, {l})")
        need("action_mask", self.action_mask.dtype == torch.bool, f"must be bool, got {self.action_mask.dtype}")
        pos = torch.arange(l)[None, :]
        inside = (pos >= self.prompt_len[:, None]) & (pos < self.length[:, None])
        need("action_mask", not bool((self.action_mask & ~inside).any()), "marks tokens outside the completion")
        on = self.action_mask
        lq = self.sampler_logp[on]
        need("sampler_logp", bool(torch.isfinite(lq).all()), "must be finite on every action token (q > 0)")
        need("sampler_logp", bool((lq <= 1e-6).all()), "holds log-probabilities > 0")
        need("version", self.version.dtype == torch.int64, f"must be int64, got {self.version.dtype}")
        need("version", bool((self.version[on] >= 0).all()), "every action token needs a weight version >= 0")
        if self.sampler_topk_ids is not None or self.sampler_topk_logp is not None:
            ids, lp = self.sampler_topk_ids, self.sampler_topk_logp
            need("sampler_topk_ids", ids is not None and lp is not None, "head ids and log-probs come together")
            need("sampler_topk_ids", ids.dim() == 3 and tuple(ids.shape[:2]) == (b, l), f"must be [{b}, {l}, k]")
            need("sampler_topk_logp", lp.shape == ids.shape, f"must match sampler_topk_ids {tuple(ids.shape)}")
            need("sampler_topk_logp", not bool(torch.isnan(lp[on]).any()), "holds NaN on action tokens")
        for name in ("group", "reward", "created", "enqueued"):
            x = getattr(self, name)
            if x is not None:
                need(name, tuple(x.shape) == (b,), f"must have shape ({b},), got {tuple(x.shape)}")
        if self.reward is not None:
            need("reward", bool(torch.isfinite(self.reward).all()), "holds NaN or inf")
        if self.advantage is not None:
            need("advantage", tuple(self.advantage.shape) in ((b,), (b, l)), f"must be [{b}] or [{b}, {l}]")
            need("advantage", bool(torch.isfinite(self.advantage).all()), "holds NaN or inf")
        if self.anchor_logp is not None:
            need("anchor_logp", tuple(self.anchor_logp.shape) == (b, l), f"must have shape ({b}, {l})")
        if self.kv_version is not None:
            kv = self.kv_version
            need("kv_version", tuple(kv.shape) == (b, l) and kv.dtype == torch.int64, f"must be int64 [{b}, {l}]")
            need("kv_version", not bool((kv[on] > self.version[on]).any()),
                 "is newer than the version that sampled the token")

        if self.sampler_routes is not None:
            self._validate_routes(need, b, l)

    def _validate_routes(self, need, b: int, l: int) -> None:
        """Routes present at every position the trainer's forward reads (each row's positions before its last
        token: the prompt and every fed action token), unique within a token-layer, in range."""
        r = self.sampler_routes
        need("sampler_routes", isinstance(r, torch.Tensor) and r.dim() == 4 and tuple(r.shape[:2]) == (b, l),
             f"must be [{b}, {l}, layers, k] (batch first, then positions), got {tuple(getattr(r, 'shape', ()))}")
        need("sampler_routes", not r.is_floating_point() and r.dtype != torch.bool,
             f"must hold integer expert ids, got {r.dtype}")
        read = torch.arange(l, device=self.length.device)[None, :] < (self.length[:, None] - 1)  # [B, L]
        missing = read & ~(r >= 0).all(-1).all(-1)
        if bool(missing.any()):
            row, pos = (int(v) for v in missing.nonzero()[0])
            need("sampler_routes", False, f"missing at row {row}, position {pos}: every position before a row's last "
                 "token is read by the trainer's forward (a route layout shifted by a position looks like this)")
        ids = r[read]  # [N, layers, k], in the recorded dtype (an int64 copy of a real MoE's routes is GBs)
        if ids.numel() and ids.shape[-1] > 1:
            ordered = ids.sort(-1).values
            repeated = (ordered[..., 1:] == ordered[..., :-1]).any(-1).any(-1)
            if bool(repeated.any()):
                row, pos = (int(v) for v in read.nonzero()[int(repeated.nonzero()[0])])
                need("sampler_routes", False, f"repeats an expert within one token-layer at row {row}, position "
                     f"{pos}: {r[row, pos].tolist()} (an engine returning all-zero ids looks like this)")
        if self.n_experts is not None and ids.numel():
            high = int(ids.max())
            need("sampler_routes", high < self.n_experts, f"holds expert id {high}, the model has {self.n_experts}")

    # -------------------------------------------------------------- helpers
    @property
    def batch_size(self) -> int:
        return self.tokens.shape[0]

    def replace(self, **changes) -> RolloutBatch:
        return dataclasses.replace(self, **changes)

    def select(self, rows) -> RolloutBatch:
        """The given rows, with the padded width trimmed to what they use (same histories)."""
        rows = torch.as_tensor(rows, dtype=torch.long)
        width = int(self.length[rows].max())
        b = self.batch_size
        changes = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if isinstance(value, torch.Tensor) and value.dim() >= 1 and value.shape[0] == b:
                value = value[rows]
                if value.dim() >= 2:  # per-token fields: [B, L, ...]
                    value = value[:, :width]
                changes[f.name] = value
        return self.replace(**changes)

    def to(self, device) -> RolloutBatch:
        """Every tensor field on ``device`` (the learner's; the same values)."""
        return self.replace(**{f.name: getattr(self, f.name).to(device) for f in dataclasses.fields(self)
                               if isinstance(getattr(self, f.name), torch.Tensor)})

    def shorten(self, length: torch.Tensor) -> RolloutBatch:
        """The rows cut to ``length`` (each at most its own): later tokens leave the mask and lose their records."""
        length = torch.minimum(torch.as_tensor(length, dtype=torch.long), self.length)
        keep = torch.arange(self.tokens.shape[1])[None, :] < length[:, None]
        changes = {"length": length, "action_mask": self.action_mask & keep,
                   "sampler_logp": torch.where(keep, self.sampler_logp, 0.0),
                   "version": torch.where(keep, self.version, -1)}
        if self.kv_version is not None:
            changes["kv_version"] = torch.where(keep, self.kv_version, -1)
        if self.sampler_topk_ids is not None:
            changes["sampler_topk_ids"] = torch.where(keep[..., None], self.sampler_topk_ids, 0)
            changes["sampler_topk_logp"] = torch.where(keep[..., None], self.sampler_topk_logp, 0.0)
        if self.advantage is not None and self.advantage.dim() == 2:
            changes["advantage"] = torch.where(keep, self.advantage, 0.0)
        return self.replace(**changes)

    def completions(self) -> list[list[int]]:
        return [self.tokens[i, self.prompt_len[i]:self.length[i]].tolist() for i in range(self.batch_size)]

    def prompts(self) -> list[list[int]]:
        return [self.tokens[i, : self.prompt_len[i]].tolist() for i in range(self.batch_size)]

    def token_ages(self, current_version: int) -> torch.Tensor:
        """current version − generating version, on action tokens (the measured sampler age)."""
        return (current_version - self.version)[self.action_mask]


# what a per-token field holds past a row's end (the sampler's own padding): concat_batches widens with it
_PAD = {"action_mask": False, "sampler_logp": 0.0, "version": -1, "kv_version": -1, "sampler_topk_ids": 0,
        "sampler_topk_logp": 0.0, "anchor_logp": 0.0, "sampler_routes": -1, "advantage": 0.0}


def concat_batches(batches: list[RolloutBatch], pad_id: int) -> RolloutBatch:
    """The rows of ``batches`` in order, as one batch, each widened to the widest with the sampler's padding
    (``tokens``: ``pad_id``): the batch one ``generate`` call over all their prompts writes, when each row's
    tokens do not depend on the others (``rollout.draws=row``). Every batch carries the same fields."""
    if not batches:
        raise ValueError("concat_batches: no batches")
    if len(batches) == 1:
        return batches[0]
    width = max(b.tokens.shape[1] for b in batches)
    changes = {}
    for f in dataclasses.fields(RolloutBatch):
        values = [getattr(b, f.name) for b in batches]
        tensors = [isinstance(v, torch.Tensor) for v in values]
        if any(tensors) and not all(tensors):
            raise ValueError(f"concat_batches: {f.name} is missing from some batches")
        if not any(tensors):
            continue
        parts = []
        for b, v in zip(batches, values):
            if v.dim() >= 2 and v.shape[1] == b.tokens.shape[1] and v.shape[1] < width:  # per-token: [B, L, ...]
                fill = pad_id if f.name == "tokens" else _PAD[f.name]
                pad = torch.full((v.shape[0], width - v.shape[1], *v.shape[2:]), fill, dtype=v.dtype)
                v = torch.cat([v, pad], dim=1)
            parts.append(v)
        changes[f.name] = torch.cat(parts)
    meta = {}
    for b in batches:
        for key, value in b.meta.items():
            meta.setdefault(key, []).extend(value if isinstance(value, list) else [value])
    return batches[0].replace(**changes, meta=meta)
