"""``driftless audit``: where a setup's sampler–trainer disagreement comes from.

Every RL framework logs one aggregate mismatch number; the bugs its users hit are plumbing (the wrong token's
log-probability recorded, processed log-probabilities compared with full-vocabulary ones, an engine that kept
old weights or an old cache after a sync, precision and batch-layout differences, MoE routes). The audit
scores what an engine recorded with the checkpoint and names the cause, one check each:

- ``sampled-token``: the recorded value is the log-probability of the sampled token at its position, not of the
  top-ranked token or of a neighbouring position's token;
- ``sampling-transform``: which convention the values follow (``raw``: log-softmax of the logits at temperature 1,
  vLLM's ``raw_logprobs``; ``scaled``: at the sampling temperature over the whole vocabulary; ``processed``:
  after temperature, top-k and top-p, renormalised over the kept set, vLLM's ``processed_logprobs``), whether it is
  the declared one, and the bias a trainer comparing its full-vocabulary log p would see;
- ``weights``: whether the values come from these weights at all: the residual under the best explanation
  against the floor numerics alone produce (the same checkpoint scored at bfloat16 and alone vs batched);
- ``numerics``: what remains per token (KL(q‖p) k3, |Δ log p| quantiles, bitwise fraction), and whether the
  records sit closer to bfloat16 or float32 scoring, to batched or lone scoring.

``audit_engine`` samples with an engine first (records as above) and adds what only a live engine allows:
``batch-invariance`` (a sequence's log q alone vs in batches), ``weight-sync`` (publish perturbed weights through
the engine's own update path and sample again: the new log q must fit the new weights, not the old) and, for a
mixture of experts, ``routes`` (how often the engine's expert sets differ from the trainer's).

A check is ``passed: true``, ``false``, or ``null`` (not judged, with why). The records format (JSONL, one
response a line): ``prompt_ids``, ``response_ids``, ``response_logprobs`` (the engine's log q of each sampled
token), optionally ``temperature``, ``top_k``, ``top_p``, ``logprobs_mode`` (``raw_logprobs`` |
``processed_logprobs``), ``weight_version``, ``top_logprobs``, ``routed_experts``.
"""

from __future__ import annotations

import copy
import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import torch

from driftless.rollout import Snapshot
from driftless.rollout.sampling import SamplingParams, sampling_logprobs

MODES = ("raw_logprobs", "processed_logprobs")
CONVENTIONS = ("raw", "scaled", "processed")
CANDIDATES = ("sampled", "top-ranked", "previous position", "next position")
CHECKS = ("sampled-token", "sampling-transform", "weights", "numerics")
FLOOR_FACTOR, FLOOR_MIN = 3.0, 1e-4  # weights: a residual above 3 × the numerics floor (and 1e-4) is other weights


@dataclass
class Record:
    prompt_ids: list[int]
    response_ids: list[int]
    response_logprobs: list[float]
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    logprobs_mode: str = "processed_logprobs"
    extra: dict = field(default_factory=dict)

    @property
    def params(self) -> SamplingParams:
        return SamplingParams(temperature=self.temperature, top_k=self.top_k, top_p=self.top_p)


# ------------------------------------------------------------------------------------------------ records
def _ints(value, what: str) -> list[int]:
    if not isinstance(value, list) or not value or not all(isinstance(v, int) and not isinstance(v, bool)
                                                            for v in value):
        raise ValueError(f"{what} must be a non-empty list of integers, got {str(value)[:60]}")
    return value


def parse_record(row: dict, where: str, defaults: dict, vocab: int | None = None) -> Record:
    if not isinstance(row, dict):
        raise ValueError(f"{where}: a record is a JSON object, got {type(row).__name__}")
    for key in ("prompt_ids", "response_ids", "response_logprobs"):
        if key not in row:
            raise ValueError(f"{where}: field {key!r} is missing")
    prompt = _ints(row["prompt_ids"], f"{where}: field 'prompt_ids'")
    response = _ints(row["response_ids"], f"{where}: field 'response_ids'")
    values = row["response_logprobs"]
    if not isinstance(values, list) or len(values) != len(response):
        raise ValueError(f"{where}: field 'response_logprobs' holds {len(values) if isinstance(values, list) else 0} "
                         f"values for {len(response)} response_ids")
    for i, v in enumerate(values):
        if not isinstance(v, (int, float)) or isinstance(v, bool) or math.isnan(v) or v > 1e-6:
            raise ValueError(f"{where}: field 'response_logprobs'[{i}] = {v!r} is not a log-probability (a number <= 0)")
    if vocab is not None:
        for key, ids in (("prompt_ids", prompt), ("response_ids", response)):
            bad = [t for t in ids if not 0 <= t < vocab]
            if bad:
                raise ValueError(f"{where}: field {key!r} holds ids outside the model's vocabulary [0, {vocab}): {bad[:3]}")
    settings = {**defaults, **{k: row[k] for k in ("temperature", "top_k", "top_p", "logprobs_mode") if k in row}}
    mode = settings.get("logprobs_mode", "processed_logprobs")
    if mode not in MODES:
        raise ValueError(f"{where}: field 'logprobs_mode' = {mode!r}; one of {', '.join(MODES)}")
    try:
        record = Record(prompt, response, [float(v) for v in values], float(settings.get("temperature", 1.0)),
                        int(settings.get("top_k", 0)), float(settings.get("top_p", 1.0)), mode,
                        {k: row[k] for k in ("weight_version", "top_logprobs", "routed_experts") if k in row})
        record.params  # noqa: B018 - validates temperature, top_k, top_p
    except (TypeError, ValueError) as err:
        raise ValueError(f"{where}: sampling settings: {err}") from None
    return record


def read_records(path, defaults: dict | None = None, vocab: int | None = None) -> list[Record]:
    """Records from a JSONL file; a bad line is refused by file, line and field."""
    path = Path(path)
    out = []
    with open(path) as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as err:
                raise ValueError(f"{path} line {n}: not JSON ({err.msg})") from None
            out.append(parse_record(row, f"{path} line {n}", defaults or {}, vocab))
    if not out:
        raise ValueError(f"{path}: no records")
    return out


def write_records(records: list[Record], path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        f.writelines(json.dumps({"prompt_ids": r.prompt_ids, "response_ids": r.response_ids,
                                "response_logprobs": r.response_logprobs, "temperature": r.temperature,
                                "top_k": r.top_k, "top_p": r.top_p, "logprobs_mode": r.logprobs_mode, **r.extra}) + "\n" for r in records)
    return path


def records_of(batch, mode: str = "processed_logprobs") -> list[Record]:
    """A RolloutBatch as records (driftless's engines record processed log q: the exact sampling transform)."""
    out = []
    s = batch.sampling
    for b in range(batch.batch_size):
        start, stop = int(batch.prompt_len[b]), int(batch.length[b])
        if stop <= start:
            continue
        out.append(Record(batch.tokens[b, :start].tolist(), batch.tokens[b, start:stop].tolist(),
                          batch.sampler_logp[b, start:stop].double().tolist(), s.temperature, s.top_k, s.top_p, mode,
                          {"weight_version": int(batch.version[b, start])}))
    return out


# ------------------------------------------------------------------------------------------------ scoring
def load_policy(model):
    """An HF checkpoint directory, a TinyLM safetensors file, or a policy as it is."""
    if not isinstance(model, (str, Path)):
        return model
    path = Path(model)
    if path.is_dir():
        from driftless.models.hf import HFPolicy

        return HFPolicy(path)
    if path.is_file():
        from driftless.models.io import load_model

        return load_model(path)[0]
    raise FileNotFoundError(2, "no model directory or file", str(path))


@torch.no_grad()
def _logits(policy, records: list[Record], *, batch_size: int, bf16: bool = False) -> list[torch.Tensor]:
    """Per record, the logits ``[R, V]`` that predict its response tokens (float32)."""
    out = []
    for start in range(0, len(records), batch_size):
        chunk = records[start:start + batch_size]
        seqs = [r.prompt_ids + r.response_ids for r in chunk]
        width = max(map(len, seqs))
        tokens = torch.zeros(len(seqs), width, dtype=torch.long)
        for i, s in enumerate(seqs):
            tokens[i, :len(s)] = torch.tensor(s)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            logits = policy(tokens[:, :-1]).float()
        for i, r in enumerate(chunk):
            p = len(r.prompt_ids)
            out.append(logits[i, p - 1:p - 1 + len(r.response_ids)].clone())
    return out


def _values(logits: list[torch.Tensor], records: list[Record]) -> dict:
    """For every token: each convention's log-probability of each candidate token, flattened over records."""
    vals = {(c, a): [] for c in CONVENTIONS for a in CANDIDATES}
    for x, r in zip(logits, records):
        ids = torch.tensor(r.response_ids)
        convs = {"raw": torch.log_softmax(x, -1), "scaled": torch.log_softmax(x / r.temperature, -1),
                 "processed": sampling_logprobs(x, r.params)}
        n = len(ids)
        for c, lp in convs.items():
            own = lp.gather(1, ids[:, None])[:, 0]
            vals[(c, "sampled")].append(own)
            vals[(c, "top-ranked")].append(lp.max(-1).values)
            nan = own.new_full((1,), float("nan"))
            vals[(c, "previous position")].append(torch.cat([nan, own[:-1]]) if n > 1 else nan[:n])
            vals[(c, "next position")].append(torch.cat([own[1:], nan]) if n > 1 else nan[:n])
    return {k: torch.cat(v).double() for k, v in vals.items()}


def _fit(recorded: torch.Tensor, value: torch.Tensor) -> float:
    """Mean |recorded − value| over the tokens where the candidate exists (−inf: a token the transform excludes)."""
    defined = ~torch.isnan(value)
    if not bool(defined.any()):
        return float("inf")
    diff = (recorded[defined] - value[defined]).abs()
    return float(torch.where(torch.isfinite(diff), diff, torch.full_like(diff, 1e3)).mean())


def audit_records(model, records: list[Record], *, also_model=None, batch_size: int = 8, max_kl: float = 1e-3,
                  policy_label: str | None = None) -> dict:
    """The four checks of the module doc on ``records`` scored by ``model``; ``also_model``: other weights the
    records may come from (the ``weights`` check says which of the two they fit)."""
    policy = load_policy(model)
    vocab = int(policy.vocab_size)
    for i, r in enumerate(records):
        bad = [t for t in r.prompt_ids + r.response_ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"record {i}: ids outside the model's vocabulary [0, {vocab}): {bad[:3]}")
    recorded = torch.tensor([v for r in records for v in r.response_logprobs], dtype=torch.float64)
    batched = _values(_logits(policy, records, batch_size=batch_size), records)
    # the numerics floor: the same weights at bfloat16, and each record alone
    low = _values(_logits(policy, records, batch_size=batch_size, bf16=True), records)
    alone = _values(_logits(policy, records, batch_size=1), records)
    keys = [(c, a) for c in CONVENTIONS for a in CANDIDATES]
    fits = {k: _fit(recorded, batched[k]) for k in keys}
    floors = {k: {"bf16_vs_fp32": _fit(batched[k], low[k]), "alone_vs_batched": _fit(batched[k], alone[k])}
              for k in keys}
    bounds = {k: max(FLOOR_FACTOR * max(floors[k].values()), FLOOR_MIN) for k in keys}
    declared = {"raw_logprobs": "raw", "processed_logprobs": "processed"}
    modes = {r.logprobs_mode for r in records}
    declared_conv = declared[next(iter(modes))] if len(modes) == 1 else "processed"
    # the best explanation: among those that fit down to the numerics floor, the sampled token and the declared
    # convention first; when none does (other weights), the sampled token under its best-fitting convention
    explaining = [k for k in keys if fits[k] <= bounds[k]]
    if explaining:
        conv, cand = min(explaining, key=lambda k: (k[1] != "sampled", k[0] != declared_conv, fits[k]))
    else:
        conv, cand = min((k for k in keys if k[1] == "sampled"), key=lambda k: (round(fits[k], 9), k[0] != declared_conv))
    best = batched[(conv, cand)]
    residual = recorded - best
    defined = torch.isfinite(residual)
    checks = []

    # sampled-token
    others = {a: fits[(conv, a)] for a in CANDIDATES if a != "sampled"}
    sampled_fit = fits[(conv, "sampled")]
    differs = (batched[(conv, "top-ranked")] - batched[(conv, "sampled")]).abs() > 1e-6
    token = {"name": "sampled-token", "passed": cand == "sampled", "fits_best": cand,
             "mean_abs_residual": {"sampled": sampled_fit, **others},
             "tokens_where_top_ranked_is_not_sampled": int(differs.sum())}
    if not explaining:
        token.update(passed=None, what="not judged: no candidate token fits within the numerics floor (weights check)")
    else:
        token["what"] = ("the recorded values are the sampled tokens' log-probabilities" if cand == "sampled" else
                         f"the recorded values fit the {cand} token's log-probability, not the sampled one's (the "
                         "engine recorded another token's value)")
    checks.append(token)

    # sampling-transform
    conv_fits = {c: fits[(c, cand)] for c in CONVENTIONS}
    tol = max(FLOOR_MIN, 0.1 * conv_fits[conv])
    declared_ok = conv_fits[declared_conv] <= conv_fits[conv] + tol
    full = batched[("scaled", cand)]  # what a trainer normalising over the whole vocabulary compares with
    ratio = torch.exp(full - recorded)
    ok = torch.isfinite(ratio)
    checks.append({"name": "sampling-transform", "passed": bool(declared_ok), "declared": declared_conv,
                   "follows": conv, "mean_abs_residual": conv_fits,
                   "full_vocabulary_bias_mean": float((full - recorded)[ok].mean()) if ok.any() else float("nan"),
                   "full_vocabulary_ratio_outside_0.9_1.1": float(((ratio[ok] < 0.9) | (ratio[ok] > 1.1)).double().mean())
                   if ok.any() else float("nan"),
                   "what": (f"the values follow the {conv} convention" + ("" if declared_ok else
                            f", not the declared {declared_conv} one: a trainer reading them as {declared_conv} "
                            "compares log-probabilities of two different distributions"))})

    floor = floors[(conv, cand)]
    fit_now = fits[(conv, cand)]  # a token the transform excludes counts as a residual of 1e3
    bound = bounds[(conv, cand)]
    low, alone = low[(conv, cand)], alone[(conv, cand)]
    weights = {"name": "weights", "passed": fit_now <= bound, "mean_abs_residual": fit_now, "floor": floor,
               "bound": bound}
    if also_model is not None:
        other = load_policy(also_model)
        other_fit = _fit(recorded, _values(_logits(other, records, batch_size=batch_size), records)[(conv, cand)])
        weights["also_model_mean_abs_residual"] = other_fit
        weights["fits"] = "model" if fit_now <= other_fit else "also_model"
    weights["what"] = ("the values come from these weights (residual within the numerics floor)" if weights["passed"]
                       else f"the residual {fit_now:.3g} is above {bound:.3g} (numerics alone): the records were made "
                            "with other weights (a stale engine or cache, a dropped update)"
                            + (" — they fit --also-model better" if weights.get("fits") == "also_model" else ""))
    checks.append(weights)

    # numerics
    delta = (best - recorded)[defined]  # log p − log q
    kl = float((torch.exp(delta) - 1 - delta).mean()) if delta.numel() else float("nan")
    absd = delta.abs()
    q = (lambda p: float(torch.quantile(absd, p))) if absd.numel() else (lambda p: float("nan"))
    bitwise = float((recorded.float() == best.float()).double().mean())
    numerics = {"name": "numerics", "kl_k3": kl, "abs_dlogp_p50": q(0.5), "abs_dlogp_p99": q(0.99),
                "abs_dlogp_max": float(absd.max()) if absd.numel() else float("nan"), "bitwise_fraction": bitwise,
                "tokens": int(defined.sum()), "max_kl": max_kl,
                "closer_to": {"precision": "bf16" if _fit(recorded, low) < fit_now else "fp32",
                              "layout": "alone" if _fit(recorded, alone) < fit_now else "batched"},
                "mean_abs_residual_if_scored": {"fp32_batched": fit_now, "bf16": _fit(recorded, low),
                                                "alone": _fit(recorded, alone)}}
    if not weights["passed"]:
        numerics.update(passed=None, what="not judged: the records are not from these weights (weights check)")
    else:
        numerics["passed"] = bool(kl <= max_kl)
        numerics["what"] = (f"mean KL(q‖p) {kl:.2e} per token {'within' if kl <= max_kl else 'above'} {max_kl:g}; "
                            f"the records sit closer to {numerics['closer_to']['precision']} scoring")
    checks.append(numerics)
    return {"model": policy_label or (str(model) if isinstance(model, (str, Path)) else type(policy).__name__),
            "records": len(records), "tokens": int(recorded.numel()), "explanation": {"convention": conv,
                                                                                      "token": cand},
            "checks": checks, "passed": all(c["passed"] is not False for c in checks),
            "residual_by_position": _by_position(records, residual)}


def _by_position(records: list[Record], residual: torch.Tensor) -> list[float]:
    """Mean |Δ log p| at each response position (over the records long enough)."""
    width = max(len(r.response_ids) for r in records)
    sums, counts = [0.0] * width, [0] * width
    i = 0
    for r in records:
        for t in range(len(r.response_ids)):
            v = float(residual[i])
            if math.isfinite(v):
                sums[t] += abs(v)
                counts[t] += 1
            i += 1
    return [s / c if c else float("nan") for s, c in zip(sums, counts)]


# ------------------------------------------------------------------------------------------------ live engines
class IgnoresUpdates:
    """An engine wrapper that keeps its first weights whatever is published later (a planted fault for tests: what
    sleep mode dropping a sync, or a stale cache, looks like from outside)."""

    def __init__(self, engine):
        self.engine, self.loaded = engine, False

    def __getattr__(self, name):
        return getattr(self.engine, name)

    def load(self, snapshot):
        if not self.loaded:
            self.engine.load(snapshot)
            self.loaded = True


def make_engine(kind: str, policy, *, eos_ids=(), pad_id: int = 0, model_dir=None, engine_kwargs: dict | None = None):
    """The engine to audit: ``builtin`` (driftless's Sampler), ``hf`` (transformers ``generate``), ``vllm``."""
    eos = tuple(eos_ids) or None
    if kind == "builtin":
        from driftless.rollout import Sampler

        return Sampler(copy.deepcopy(policy), head_k=0, eos_id=eos, pad_id=pad_id)
    if kind == "hf":
        return HFGenerate(copy.deepcopy(policy), eos_ids=eos_ids, pad_id=pad_id)
    if kind == "vllm":
        from driftless.rollout.vllm import VLLMSampler

        return VLLMSampler(copy.deepcopy(policy), head_k=0, eos_id=eos, pad_id=pad_id, model_dir=model_dir,
                           tokenizer=model_dir is not None, engine_kwargs=engine_kwargs)
    raise ValueError(f"audit engine: --engine must be builtin, hf or vllm, got {kind!r}")


class HFGenerate:
    """transformers' ``generate`` as an engine: its processed scores' log-softmax as log q (what users of TRL's
    transformers path record)."""

    def __init__(self, policy, *, eos_ids=(), pad_id: int = 0):
        self.policy, self.eos_ids, self.pad_id, self.version = policy, list(eos_ids), pad_id, None

    def load(self, snapshot):
        self.policy.load_state_dict(snapshot.state)
        self.version = snapshot.version

    @torch.no_grad()
    def records(self, prompts: list[list[int]], params: SamplingParams, max_new_tokens: int, seed: int) -> list[Record]:
        model = self.policy.model
        torch.manual_seed(seed)
        out = []
        for ids in prompts:
            res = model.generate(torch.tensor([ids]), do_sample=True, temperature=params.temperature,
                                 top_k=params.top_k or None, top_p=params.top_p, max_new_tokens=max_new_tokens,
                                 eos_token_id=self.eos_ids or None, pad_token_id=self.pad_id, output_scores=True,
                                 return_dict_in_generate=True)
            gen = res.sequences[0, len(ids):].tolist()
            logq = [float(torch.log_softmax(s[0].float(), -1)[t]) for s, t in zip(res.scores, gen)]
            out.append(Record(list(ids), gen, logq, params.temperature, params.top_k, params.top_p,
                              "processed_logprobs", {"weight_version": self.version}))
        return out


def _sample(engine, prompts, params: SamplingParams, max_new_tokens: int, seed: int) -> list[Record]:
    if isinstance(engine, HFGenerate) or isinstance(getattr(engine, "engine", None), HFGenerate):
        return engine.records(prompts, params, max_new_tokens, seed)
    return records_of(engine.generate(prompts, params, max_new_tokens, seed=seed))


def perturbed(state: dict, scale: float = 0.05, seed: int = 1234) -> dict:
    """``state`` with relative Gaussian noise on every floating-point tensor (tied tensors perturbed once)."""
    from driftless.models.io import clone_state

    out = clone_state(state)
    g = torch.Generator().manual_seed(seed)
    done = set()
    for t in out.values():
        if t.is_floating_point() and t.data_ptr() not in done:
            done.add(t.data_ptr())
            t.add_(scale * torch.randn(t.shape, generator=g).to(t.dtype) * t)
    return out


@torch.no_grad()
def batch_invariance(policy, records: list[Record], sizes=(1, 3, 8)) -> dict:
    """The engine's model scoring each sequence in batches of other sizes: max |Δ log q| against batches of 1."""
    ref = torch.cat([x for x in _logits(policy, records, batch_size=1)])
    worst, equal = 0.0, 1.0
    for size in sizes[1:]:
        got = torch.cat([x for x in _logits(policy, records, batch_size=size)])
        a, b = torch.log_softmax(ref, -1), torch.log_softmax(got, -1)
        worst = max(worst, float((a - b).abs().max()))
        equal = min(equal, float((a == b).all(-1).double().mean()))
    return {"sizes": list(sizes), "max_abs_dlogq": worst, "bitwise_fraction": equal}


def audit_engine(model, prompts: list[list[int]], *, engine: str = "builtin", params: SamplingParams | None = None,
                 max_new_tokens: int = 16, seed: int = 0, eos_ids=(), pad_id: int = 0, model_dir=None,
                 wrap=None, batch_tolerance: float = 1e-3, max_kl: float = 1e-3,
                 engine_kwargs: dict | None = None) -> tuple[dict, list[Record]]:
    """Sample ``prompts`` with the engine, audit the records, then the live checks. ``wrap``: a function applied
    to the engine (tests plant faults with it). Returns (the audit, the records)."""
    policy = load_policy(model)
    params = params or SamplingParams()
    if engine == "vllm":  # the engine's context: what the prompts and responses need, not the checkpoint's 8k
        engine_kwargs = {"max_model_len": max(map(len, prompts)) + max_new_tokens, **(engine_kwargs or {})}
    eng = make_engine(engine, policy, eos_ids=eos_ids, pad_id=pad_id, model_dir=model_dir, engine_kwargs=engine_kwargs)
    if wrap is not None:
        eng = wrap(eng)
    state = policy.state_dict()
    eng.load(Snapshot(state, 0))
    records = _sample(eng, prompts, params, max_new_tokens, seed)
    result = audit_records(policy, records, max_kl=max_kl, policy_label=str(model) if isinstance(model, (str, Path))
                           else None)
    result["engine"] = engine
    if engine == "vllm":  # its kernels run inside the engine, which scores no given sequence
        result["checks"].append({"name": "batch-invariance", "passed": None,
                                 "what": "not judged: vLLM's forward cannot be run on a given sequence from here "
                                         "(the built-in and transformers engines are)"})
    else:
        inv = batch_invariance(getattr(eng, "policy", policy), records)
        result["checks"].append({"name": "batch-invariance", "passed": inv["max_abs_dlogq"] <= batch_tolerance,
                                 "tolerance": batch_tolerance, **inv,
                                 "what": "a sequence's log q alone vs in batches of other sizes"})
    # weight-sync: a known change through the engine's own update path; the new log q must fit the new weights
    new_state = perturbed(state)
    new_policy = copy.deepcopy(policy)
    new_policy.load_state_dict(new_state)
    eng.load(Snapshot(new_state, 1))
    after = _sample(eng, prompts, params, max_new_tokens, seed + 1)
    fit_new = audit_records(new_policy, after, max_kl=float("inf"))
    fit_old = audit_records(policy, after, max_kl=float("inf"))
    new_res = next(c for c in fit_new["checks"] if c["name"] == "weights")["mean_abs_residual"]
    old_res = next(c for c in fit_old["checks"] if c["name"] == "weights")["mean_abs_residual"]
    synced = new_res < 0.2 * old_res and next(c for c in fit_new["checks"] if c["name"] == "weights")["passed"]
    result["checks"].append({"name": "weight-sync", "passed": bool(synced), "perturbation": 0.05,
                             "mean_abs_residual_new_weights": new_res, "mean_abs_residual_old_weights": old_res,
                             "what": ("after the update the engine samples from the new weights" if synced else
                                      "after the update the engine's log q fits the old weights: the update was "
                                      "dropped or a cache built under the old weights was reused")})
    routes = None
    if getattr(policy, "route_shape", None) is not None and hasattr(eng, "generate"):
        from driftless.rollout.scoring import routed_forward

        eng.load(Snapshot(state, 2))
        batch = eng.generate(prompts, params, max_new_tokens, seed=seed)
        if batch.sampler_routes is not None:
            with torch.no_grad():
                _, own = routed_forward(policy, batch)
            mask = batch.action_mask
            sets_a = batch.sampler_routes[mask].sort(-1).values
            sets_b = own[mask].sort(-1).values
            flips = (sets_a != sets_b).any(-1).double().mean(0)  # per layer
            routes = {"name": "routes", "passed": bool(flips.max() <= 0.01), "flip_fraction_by_layer": flips.tolist(),
                      "what": "the share of tokens whose expert set differs between engine and trainer, per layer"}
    result["checks"].append(routes or {"name": "routes", "passed": None, "what": "not judged: a dense model"})
    result["passed"] = all(c["passed"] is not False for c in result["checks"])
    return result, records


# ------------------------------------------------------------------------------------------------ report
def write_report(result: dict, out_dir) -> Path:
    """``audit.json``, ``audit.md`` and ``dlogp_by_position.png`` in ``out_dir``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "audit.json").write_text(json.dumps(result, indent=2, default=float) + "\n")
    mark = {True: "passed", False: "**FAILED**", None: "not judged"}
    lines = [f"# driftless audit: {result['model']}", "",
             f"{result['records']} records, {result['tokens']} tokens"
             + (f", engine `{result['engine']}`" if "engine" in result else "")
             + f"; best explanation: the {result['explanation']['token']} token under the "
               f"{result['explanation']['convention']} convention.", "",
             "| check | result | what it found |", "|---|---|---|"]
    for c in result["checks"]:
        lines.append(f"| `{c['name']}` | {mark[c['passed']]} | {c['what']} |")
    lines += ["", "## Numbers", ""]
    for c in result["checks"]:
        nums = {k: v for k, v in c.items() if k not in ("name", "passed", "what")}
        lines.append(f"- `{c['name']}`: " + json.dumps(nums, default=float))
    lines += ["", "![mean |Δ log p| per response position](dlogp_by_position.png)", ""]
    (out / "audit.md").write_text("\n".join(lines))
    fig, ax = plt.subplots(figsize=(6, 3))
    ys = result["residual_by_position"]
    ax.semilogy(range(len(ys)), [max(y, 1e-12) if math.isfinite(y) else float("nan") for y in ys], "o-")
    ax.set_xlabel("response position")
    ax.set_ylabel("mean |log q − log p|")
    ax.set_title("recorded vs the checkpoint, best explanation")
    fig.tight_layout()
    fig.savefig(out / "dlogp_by_position.png", dpi=90)
    plt.close(fig)
    return out / "audit.md"
