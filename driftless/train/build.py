"""Everything made from a config, in one place: tokenizer, task, objective, view, policy, learner, worker.

The initial weights are made once (``initial_state``: the cached supervised warm start for
TinyLM, a seeded random initialisation otherwise) and handed to every part: the learner's policy
and each rollout worker's own copy (``make_worker``, the same function in the driver, a worker
process or a Ray actor). No part launches a warm start of its own.

``check(config)`` builds what is cheap (task, objective, view, sampling transform) so that a
setting the domain refuses is refused by name before a run starts; the schema
(driftless.train.config) checks types and ranges without importing any of it.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path

import torch

from driftless.mismatch import parse_view
from driftless.rollout import SamplingParams
from driftless.rollout.text import TextCodec
from driftless.rollout.worker import RolloutSettings, RolloutWorker
from driftless.tasks import Arithmetic, CharTokenizer, Countdown, CountdownConfig, FirstToken
from driftless.train.allocator import mmap_threshold_refusal, set_mmap_threshold
from driftless.train.config import RunConfig
from driftless.train.learner import Learner, make_optimizer
from driftless.train.parallel import Ranks, fully_shard_policy


class Parts:
    """What one run makes from its config, each made once and shared: the tokenizer, the text codec, the task
    (a ``DatasetTask`` reads the user's file once), the objective, the sampler's view and sampling transform.
    A worker in another process or Ray actor makes its own ``Parts`` from the config it is sent."""

    # shared with a worker thread: tasks, objectives and sampling params hold no mutable state; the view is applied
    # by the worker alone (WeightNoise fills a cache on its first application), the trainer reads only its numerics
    SHARED_ACROSS_THREADS = ("task", "objective", "view", "sampling")

    def __init__(self, config: RunConfig):
        self.config = config

    def for_thread(self) -> Parts:
        """The parts a worker on another thread uses: the same task, objective and view, its own tokenizer and
        codec (a Rust tokenizer is not to be shared between threads: "Already borrowed")."""
        other = Parts(self.config)
        for name in self.SHARED_ACROSS_THREADS:
            other.__dict__[name] = getattr(self, name)
        return other

    @functools.cached_property
    def tokenizer(self):
        return tokenizer(self.config)

    @functools.cached_property
    def codec(self) -> TextCodec:
        return codec(self.config, self.tokenizer)

    @functools.cached_property
    def task(self):
        return task(self.config)

    @functools.cached_property
    def objective(self):
        return objective(self.config)

    @functools.cached_property
    def view(self):
        return view(self.config)

    @functools.cached_property
    def sampling(self) -> SamplingParams:
        return sampling(self.config)


def tokenizer(config: RunConfig | None = None):
    """The model's tokenizer: a checkpoint's own (model.kind=hf with model.hf_path), else TinyLM's characters."""
    if config is not None and config.model.kind == "hf" and config.model.hf_path:
        from driftless.models.hf_tokenizer import HFTokenizer

        return HFTokenizer(config.model.hf_path)
    return CharTokenizer()


def codec(config: RunConfig, tok=None) -> TextCodec:
    """Prompts to ids and ids to text, through the model's tokenizer and (for chat messages) its chat template."""
    t = config.task
    return TextCodec(tok or tokenizer(config), chat_template=t.chat_template, system_prompt=t.system_prompt,
                     context=config.model.max_seq_len, max_new_tokens=config.rollout.max_new_tokens,
                     truncate=t.truncate_prompts)


def task(config: RunConfig):
    t = config.task
    if t.name == "dataset":
        from driftless.tasks.dataset import DatasetTask

        return DatasetTask(t.path, prompt_key=t.prompt_key, answer_key=t.answer_key, eval_path=t.eval_path,
                           eval_fraction=t.eval_fraction, reward=t.reward, rewards=t.rewards,
                           completion_key=t.completion_key)
    if t.name == "arithmetic":
        return Arithmetic(t.max_operand)
    if t.name == "first-token":
        return FirstToken(t.target)
    return Countdown(CountdownConfig(t.n_numbers, t.min_number, t.max_number, t.max_target, t.ops))


def objective(config: RunConfig):
    from driftless.objectives import make

    return make(config.objective.name, **(config.objective.params or {}))


def view(config: RunConfig):
    return parse_view(config.mismatch.view)


def sampling(config: RunConfig) -> SamplingParams:
    r = config.rollout
    return SamplingParams(temperature=r.temperature, top_k=r.top_k, top_p=r.top_p)


def _check_text(config: RunConfig) -> None:
    """Settings of the model's text interface that cannot work together, refused by name."""
    m, t, r = config.model, config.task, config.rollout
    if r.max_new_tokens >= m.max_seq_len:
        raise ValueError(f"rollout.max_new_tokens={r.max_new_tokens} leaves no room for a prompt in "
                         f"model.max_seq_len={m.max_seq_len}")
    if t.name == "dataset" and m.kind == "tiny" and m.warm_start:
        raise ValueError("task.name=dataset with model.kind=tiny: TinyLM's warm start trains on the built-in tasks' "
                         "generated solutions; set model.warm_start=false, or bring a checkpoint (model.kind=hf, "
                         "model.hf_path; driftless make-model builds one)")
    if t.name != "dataset":
        for key in ("path", "eval_path", "answer_key", "completion_key", "reward", "system_prompt"):
            if getattr(t, key) is not None:
                raise ValueError(f"task.{key} needs task.name=dataset (the built-in {t.name} task gives string "
                                 "prompts and scores them itself)")
        if t.rewards:
            raise ValueError(f"task.rewards needs task.name=dataset (the built-in {t.name} task scores itself)")
    if m.kind == "hf" and not m.hf_path and t.name == "dataset":
        raise ValueError("task.name=dataset with model.kind=hf needs model.hf_path (a checkpoint with its tokenizer); "
                         "without it the random tiny Qwen3 uses TinyLM's character tokenizer")


def check(config: RunConfig, parts: Parts | None = None) -> RunConfig:
    """Refuse, by name, what the domain cannot build from ``config`` (before anything runs); what it builds is
    kept in ``parts`` when given (the run's own, so that nothing is built twice). The config's cross-field rules
    were checked when it was made (``config.RULES``); these are what this machine and its packages can do."""
    if config.train.device == "cuda" and not torch.cuda.is_available():
        raise ValueError("train.device=cuda but torch.cuda.is_available() is False (a CPU build of torch, or no GPU "
                         "visible): use train.device=cpu or auto")
    _check_text(config)
    why = mmap_threshold_refusal(config.train.malloc_mmap_threshold)
    if why:
        raise ValueError(why)
    parts = parts or Parts(config)
    for section, name in (("task", "task"), ("objective", "objective"), ("mismatch.view", "view"),
                          ("rollout", "sampling")):
        try:
            made = getattr(parts, name)
        except ValueError as err:
            raise ValueError(f"{section}: {err}") from None
        if section == "mismatch.view":
            numerics = config.mismatch.trainer_numerics
            if numerics != "fp" and made.quant is None:
                raise ValueError(f"mismatch.trainer_numerics {numerics!r} needs a quantized mismatch.view")
            if config.rollout.engine == "vllm" and made.quant is not None and (made.quant.act is not None
                                                                             or made.quant.kv is not None):
                raise ValueError(f"mismatch.view={config.mismatch.view!r}: with rollout.engine=vllm only weight-only "
                                 "views and noise apply (activation / KV views need the built-in sampler's numerics "
                                 "hook)")
    if config.train.routing == "replay" and config.rollout.engine == "vllm":
        from driftless.rollout.vllm import routes_unavailable

        why = routes_unavailable()  # an ImportError names the missing extra
        if why:
            raise ValueError(f"train.routing=replay with rollout.engine=vllm: {why}; use rollout.engine=driftless")
    return config


# ---------------------------------------------------------------------------------------- policies
def tiny_config(config: RunConfig, vocab_size: int):
    from driftless.models import TinyLMConfig

    m = config.model
    return TinyLMConfig(vocab_size=vocab_size, d_model=m.d_model, n_layer=m.n_layer, n_head=m.n_head,
                        n_kv_head=m.n_kv_head, d_ff=m.d_ff, max_seq_len=m.max_seq_len, n_experts=m.n_experts,
                        experts_per_token=m.experts_per_token, norm_topk_prob=m.norm_topk_prob)


def _hf_policy(config: RunConfig, tok):
    """The transformers model of ``config``: the checkpoint at model.hf_path, else a tiny random Qwen3."""
    from driftless.models.hf import HFPolicy, tiny_qwen3_config

    m = config.model
    if not m.hf_path:
        return HFPolicy(tiny_qwen3_config(vocab_size=tok.vocab_size, max_positions=m.max_seq_len))
    made = HFPolicy(m.hf_path, max_seq_len=m.max_seq_len)
    if tok.vocab_size > made.vocab_size:
        raise ValueError(f"model.hf_path {m.hf_path!r}: the tokenizer has {tok.vocab_size} tokens but the model's "
                         f"vocabulary is {made.vocab_size}")
    return made


def initial_state(config: RunConfig, tok=None, progress: bool = True, parts: Parts | None = None
                  ) -> tuple[dict, dict | None]:
    """(starting weights, warm-start info or None)."""
    parts = parts or Parts(config)
    tok = tok or parts.tokenizer
    if config.model.kind == "hf":
        torch.manual_seed(config.train.seed)  # a random init without model.hf_path; a checkpoint's weights with it
        return _hf_policy(config, tok).state_dict(), None
    from driftless.models import TinyLM

    model_config = tiny_config(config, tok.vocab_size)
    if config.model.warm_start:
        from driftless.train.warmstart import warm_start

        ws = config.warm_start
        base, info = warm_start(model_config, parts.task, tok, ws.settings(),
                                max_new_tokens=config.rollout.max_new_tokens, cache_dir=ws.cache_dir,
                                progress=progress, reproducible=config.train.reproducible)
        return base.state_dict(), info
    base = TinyLM(model_config)
    base.reset_parameters(seed=config.train.seed)
    return base.state_dict(), None


def policy(config: RunConfig, state: dict | str | Path, tok=None, *, adopt: bool = False):
    """A policy of ``config.model`` holding ``state`` (a state dict or a safetensors file); ``adopt``: ``state``'s
    tensors become the policy's own (no copy), so the caller must not need them unchanged afterwards."""
    tok = tok or tokenizer(config)
    if isinstance(state, (str, Path)):
        from driftless.models.io import load_weights

        state = load_weights(state)
    if config.model.kind == "hf":
        made = _hf_policy(config, tok)
    else:
        from driftless.models import TinyLM

        made = TinyLM(tiny_config(config, tok.vocab_size), execution=config.model.execution)
    if adopt:
        from driftless.models.io import adopt_state

        adopt_state(made, state)
    else:
        made.load_state_dict(state)
    return made


# ---------------------------------------------------------------------------------------- parts
def learner(config: RunConfig, state: dict, parts: Parts | None = None) -> Learner:
    """The learner of ``config`` on weights ``state``: policy (with the trainer's numerics) on its device, sharded
    over the learner ranks under ``train.parallel=fsdp``, objective, optimizer."""
    parts = parts or Parts(config)
    if config.train.malloc_mmap_threshold is not None:
        set_mmap_threshold(config.train.malloc_mmap_threshold)  # this process: the learner's (a Ray actor's too)
    # the initial weights are the learner's to train (Run hands every other user its own copy, or these same
    # tensors to sample from); FSDP shards its own copy
    trained = policy(config, state, parts.tokenizer, adopt=config.train.parallel != "fsdp").to(device(config))
    if config.train.activation_checkpointing:
        trained.checkpoint_activations()
    if config.mismatch.trainer_numerics != "fp":
        trained.numerics = parts.view.quant.numerics.for_trainer(config.mismatch.trainer_numerics)
    o, t = config.optim, config.train
    ranks = Ranks.from_env(t.learner_ranks)
    if t.parallel == "fsdp":
        fully_shard_policy(trained, ranks, t.precision)
    optimizer = make_optimizer([p for p in trained.parameters() if p.requires_grad], o.name, o.lr, o.weight_decay,
                               (o.beta1, o.beta2), exact=t.reproducible)
    return Learner(trained, parts.objective, optimizer, grad_clip=o.grad_clip,
                   head_k=config.rollout.head_k or None, ppo_epochs=t.ppo_epochs, minibatches=t.minibatches,
                   schedule=o.schedule, total_steps=t.steps * t.ppo_epochs * t.minibatches,
                   decomposition=config.diagnostics.decomposition, keep_versions=config.versions_to_keep(),
                   micro_batch_tokens=t.micro_batch_tokens, ranks=ranks, precision=t.precision, routing=t.routing)


def device(config: RunConfig) -> torch.device:
    """``train.device``: auto is cuda when available (aligned execution: always the CPU); cuda without CUDA refused."""
    asked = config.train.device
    if asked == "cuda" and not torch.cuda.is_available():
        raise ValueError("train.device=cuda but torch.cuda.is_available() is False (a CPU build of torch, or no GPU "
                         "visible): use train.device=cpu or auto")
    if asked == "auto":
        asked = "cuda" if torch.cuda.is_available() and config.model.execution != "aligned" else "cpu"
    if asked == "cuda" and "LOCAL_RANK" in os.environ:
        return torch.device("cuda", int(os.environ["LOCAL_RANK"]))  # one GPU a rank under torchrun
    return torch.device(asked)


def rollout_settings(config: RunConfig, parts: Parts | None = None) -> RolloutSettings:
    r = config.rollout
    return RolloutSettings(prompts_per_step=r.prompts_per_step, group_size=r.group_size,
                           max_new_tokens=r.max_new_tokens, sampling=(parts or Parts(config)).sampling,
                           reward_mode=config.objective.reward_mode, advantage=config.objective.advantage,
                           head_k=r.head_k, seed=config.train.seed, refresh=r.refresh,
                           refresh_every=r.tokens_between_refreshes, reward_latency=r.reward_latency,
                           decode_latency=r.decode_latency, engine=r.engine, stop=tuple(r.stop),
                           model_dir=config.model.hf_path if config.model.kind == "hf" else None,
                           routes=True if config.train.routing == "replay" else None, draws=r.draws,
                           ignore_eos=r.ignore_eos)


def worker(config: RunConfig, state: dict, parts: Parts | None = None, *, adopt: bool = False) -> RolloutWorker:
    """A rollout worker with its own policy copy on ``state`` (``adopt``: ``state``'s own tensors, the trainer's that
    it samples from unchanged), sampling through the config's mismatch view."""
    parts = parts or Parts(config)
    return RolloutWorker(policy(config, state, parts.tokenizer, adopt=adopt), parts.task, parts.codec,
                         rollout_settings(config, parts), view=parts.view)
