"""Run configuration: dataclasses loaded from YAML, with ``a.b=c`` overrides.

The schema in one place, with no domain imports: every field's type (``Literal`` choices
included) and range is checked by one function, ``_check_fields``, from its annotation and its
``field(metadata=...)``; what depends on two settings (which runtime accepts which setting) is
checked in ``RunConfig.__post_init__``. What needs the domain to check (an objective's
parameters, a mismatch view's spec, a task's knobs) is checked where it is built,
``driftless.train.build.check``, before anything runs. Unknown keys and bad values are refused
with a ValueError that names the key and the value.

The dataclass defaults are the learning reference: ``configs/default.yaml`` writes them out
(a test keeps the two equal).
"""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Literal

import yaml

Runtime = Literal["sync", "thread", "process", "ray"]
ASYNC_RUNTIMES = ("thread", "process", "ray")
RefreshPolicy = Literal["pin", "recompute", "retain"]
Engine = Literal["driftless", "vllm"]
TaskName = Literal["countdown", "arithmetic", "first-token", "dataset"]
RewardMode = Literal["+1/0", "±1", "±1-centered"]
Estimator = Literal["group-mean", "grpo", "leave-one-out", "none"]
TrainerNumerics = Literal["fp", "fwd-fq", "fwd-bwd-fq", "native"]
Schedule = Literal["constant", "linear", "cosine"]
LoggerName = Literal["jsonl", "tensorboard", "wandb", "tune"]


def _at_least(default, low, **kw):
    return field(default=default, metadata={"min": low, **kw})


def _positive(default):
    return _at_least(default, 1)


# ---------------------------------------------------------------------------------------- the checks
def _coerce(key: str, value, annotation):
    """Check (and gently coerce) a value against a field's annotation; the one type check of the schema."""
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        return _coerce(key, value, inner[0])
    if origin is Literal:
        if isinstance(value, int) and not isinstance(value, bool) and str(value) in args:
            value = str(value)
        if value not in args:
            raise ValueError(f"{key} must be one of {', '.join(map(str, args))}, got {value!r}")
        return value
    if annotation is bool:
        if not isinstance(value, bool):
            raise ValueError(f"{key} must be true or false, got {value!r}")
        return value
    if annotation is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"{key} must be an integer, got {value!r}")
        return value
    if annotation is float:
        if isinstance(value, str):  # YAML 1.1 reads 1e-3 (no dot) as a string
            try:
                return float(value)
            except ValueError:
                raise ValueError(f"{key} must be a number, got {value!r}") from None
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(f"{key} must be a number, got {value!r}")
        return float(value)
    if annotation is str:
        if isinstance(value, int) and not isinstance(value, bool):  # YAML reads `7` as a number
            return str(value)
        if not isinstance(value, str):
            raise ValueError(f"{key} must be a string, got {value!r}")
        return value
    if origin is list:
        if isinstance(value, str):  # a=b,c on the command line
            value = [v.strip() for v in value.split(",") if v.strip()]
        if not isinstance(value, list):
            raise ValueError(f"{key} must be a list, got {value!r}")
        return [_coerce(f"{key}[{i}]", v, args[0]) for i, v in enumerate(value)] if args else list(value)
    if annotation is dict or origin is dict:
        if not isinstance(value, dict):
            raise ValueError(f"{key} must be a mapping, got {value!r}")
        return dict(value)
    return value


def _check_fields(obj, section: str) -> None:
    """Every field of ``obj`` against its annotation and its ``min`` / ``above`` metadata."""
    hints = typing.get_type_hints(type(obj))
    for f in dataclasses.fields(obj):
        key = f"{section}.{f.name}"
        value = _coerce(key, getattr(obj, f.name), hints[f.name])
        setattr(obj, f.name, value)
        if value is None:
            continue
        if "min" in f.metadata and value < f.metadata["min"]:
            what = "a positive integer" if f.metadata["min"] == 1 and isinstance(value, int) else \
                f">= {f.metadata['min']}"
            raise ValueError(f"{key} must be {what}, got {value!r}")
        if "above" in f.metadata and not value > f.metadata["above"]:
            raise ValueError(f"{key} must be > {f.metadata['above']}, got {value!r}")


class _Section:
    _name = ""

    def __post_init__(self):
        _check_fields(self, self._name)


# ---------------------------------------------------------------------------------------- sections
@dataclass
class ModelSection(_Section):
    _name = "model"
    kind: Literal["tiny", "hf"] = "tiny"
    execution: Literal["fast", "aligned"] = "fast"  # aligned: tiny only
    d_model: int = _positive(192)
    n_layer: int = _positive(4)
    n_head: int = _positive(3)
    n_kv_head: int = _positive(1)
    d_ff: int = _positive(512)
    max_seq_len: int = _positive(64)
    n_experts: int = _at_least(0, 0)  # tiny only: 0 dense; else a mixture of this many SwiGLU experts per layer
    experts_per_token: int = _positive(2)  # the router's top-k (a float32 softmax over all experts, no capacity drop)
    norm_topk_prob: bool = True  # the k gate weights renormalized to sum to 1 (Qwen3-MoE's default)
    hf_path: str | None = None  # a local transformers directory; None = a tiny random Qwen3 config
    warm_start: bool = True  # tiny only: start from the cached supervised warm start

    def __post_init__(self):
        super().__post_init__()
        if self.kind == "hf" and self.execution == "aligned":
            raise ValueError("model.execution 'aligned' needs model.kind 'tiny'")
        if self.kind == "hf" and self.n_experts:
            raise ValueError(f"model.n_experts={self.n_experts} builds TinyLM's mixture of experts (model.kind "
                             "'tiny'); a transformers MoE checkpoint is read from model.hf_path as it is")
        if self.n_experts and self.experts_per_token > self.n_experts:
            raise ValueError(f"model.experts_per_token={self.experts_per_token} must be at most model.n_experts="
                             f"{self.n_experts}")


@dataclass
class TaskSection(_Section):
    _name = "task"
    name: TaskName = "countdown"
    n_numbers: int = 2  # two numbers: the search is small enough for a 1.6M-parameter model to learn by RL
    min_number: int = 1
    max_number: int = 12  # 393 training / 48 held-out problems; 9 left only 26 held-out (docs/calibration.md)
    max_target: int = 100
    ops: str = "+-*/"
    max_operand: int = 20  # arithmetic only
    target: str = "7"  # first-token only: the rewarded first character
    # dataset: the user's file (docs/own-model.md)
    path: str | None = None  # JSONL, JSON or Parquet (read with Hugging Face datasets, local files only)
    eval_path: str | None = None  # the held-out file; None: a hash split of path by eval_fraction
    eval_fraction: float = field(default=0.1, metadata={"above": 0})
    prompt_key: str = "prompt"  # a string or a list of {role, content} messages
    answer_key: str | None = None  # the reference answer column (exact, math)
    completion_key: str | None = None  # a reference completion column (supervised warm starts)
    reward: str | None = None  # countdown | exact | math | "module.path:function" | "file.py:function"
    rewards: list = field(default_factory=list)  # several: [{name, weight}], each logged as reward/<name>
    # how prompts reach the model (any task)
    chat_template: Literal["auto", "none"] = "auto"  # auto: chat messages through the tokenizer's template if it has one
    system_prompt: str | None = None  # put first in chat-message prompts
    truncate_prompts: bool = False  # a prompt without room for rollout.max_new_tokens: refused (false) or left-truncated


@dataclass
class RolloutSection(_Section):
    _name = "rollout"
    prompts_per_step: int = _positive(32)
    group_size: int = _positive(8)
    max_new_tokens: int = _positive(24)
    temperature: float = 1.0
    top_k: int = _at_least(0, 0)
    top_p: float = 1.0
    head_k: int = _at_least(32, 0)  # the sampler's top-k head recorded per token (0: none)
    runtime: Runtime = "sync"  # where batches come from: sync (inline) | thread | process | ray (docs/async.md)
    staleness_bound: int | None = _at_least(None, 0)  # η of the asynchronous runtimes; None: 1 there
    lag: int = _at_least(0, 0)  # sync: batch s is sampled from version max(0, s − lag) (a deterministic virtual clock)
    refresh: RefreshPolicy = "pin"  # in-flight weight refresh: pin | recompute | retain
    refresh_every: int | None = _at_least(None, 1)  # tokens between refresh checks; None: 8 when refresh != pin
    reward_latency: float = _at_least(0.0, 0.0)  # seconds of injected wait per prompt group (tool calls, verifiers)
    decode_latency: float = _at_least(0.0, 0.0)  # seconds of injected wait per decode step (a larger model's token time)
    workers: int = _positive(1)  # process | ray: rollout workers producing batches in turn
    ray_num_cpus: int | None = _at_least(None, 1)  # ray: CPUs for ray.init when no cluster is connected; None: 2
    engine: Engine = "driftless"  # driftless (built-in Sampler) | vllm (a vLLM engine; model.kind=hf, docs/vllm.md)
    stop: list[str] = field(default_factory=list)  # stop strings: a response ends with the token that completes one
    draws: Literal["batch", "row"] = "batch"  # batch: one generator per step's batch | row: each row its own stream
    shard_across_ranks: bool = False  # learner ranks > 1: each rank generates its share of the groups, then gather
    ignore_eos: bool = False  # every response runs to max_new_tokens (an end id is sampled as any token): fixed lengths, for benchmarks

    @property
    def eta(self) -> int:
        """The staleness bound of an asynchronous runtime, in versions."""
        return 1 if self.staleness_bound is None else self.staleness_bound

    @property
    def tokens_between_refreshes(self) -> int:
        return 8 if self.refresh_every is None else self.refresh_every

    @property
    def ray_cpus(self) -> int:
        return 2 if self.ray_num_cpus is None else self.ray_num_cpus


@dataclass
class MismatchSection(_Section):
    _name = "mismatch"
    view: str = "none"  # sampler view spec, e.g. "w8a8+kv:int8", "noise:0.05" (driftless.mismatch)
    staleness: int = _at_least(0, 0)  # sync: refresh the sampler every staleness + 1 steps (composes with lag)
    trainer_numerics: TrainerNumerics = "fp"  # fp | fwd-fq | fwd-bwd-fq | native (needs a quantized view)


@dataclass
class ObjectiveSection(_Section):
    _name = "objective"
    name: str = "pg"  # a preset of driftless.objectives (docs/objectives.md)
    params: dict = field(default_factory=dict)
    reward_mode: RewardMode = "±1"
    advantage: Estimator = "group-mean"


@dataclass
class OptimSection(_Section):
    _name = "optim"
    name: Literal["sgd", "adamw"] = "adamw"
    lr: float = field(default=2.0e-4, metadata={"above": 0})  # 1e-3 collapses within 10 steps
    weight_decay: float = _at_least(0.0, 0.0)
    beta1: float = 0.9
    beta2: float = 0.999
    grad_clip: float = _at_least(1.0, 0.0)  # 0 = off
    schedule: Schedule = "linear"  # constant | linear (to 0 at the last optimizer step) | cosine


@dataclass
class WarmStartConfig(_Section):
    """Supervised warm start of the built-in model (driftless.train.warmstart)."""

    _name = "warm_start"
    steps: int = _positive(300)  # held-out 0.36-0.48 over seeds: headroom, and RL finds reward from each
    batch_size: int = _positive(64)
    lr: float = field(default=3e-3, metadata={"above": 0})
    weight_decay: float = _at_least(0.01, 0.0)
    seed: int = 0
    eval_problems: int = _positive(256)


@dataclass
class WarmStartSection(WarmStartConfig):
    """The warm start's settings plus where its cache lives."""

    cache_dir: str = "runs/warmstart"

    def settings(self) -> WarmStartConfig:
        return WarmStartConfig(**{f.name: getattr(self, f.name) for f in dataclasses.fields(WarmStartConfig)})


@dataclass
class TrainSection(_Section):
    _name = "train"
    steps: int = _positive(160)
    seed: int = 0
    eval_every: int = _positive(20)
    eval_problems: int = _positive(256)
    eval_samples: int = _at_least(0, 0)  # 0: greedy, one per held-out problem; N: N samples each under the rollout's transform
    checkpoint_every: int = _positive(40)
    run_dir: str = "runs/default"
    progress: bool = True
    ppo_epochs: int = _positive(1)  # optimizer passes over each batch (PPO epochs; the anchor π0 is fixed before the first)
    minibatches: int = _positive(1)  # optimizer steps per pass (rows split into contiguous minibatches)
    micro_batch_tokens: int | None = _at_least(None, 1)  # gradient accumulation: at most this many tokens a forward
    activation_checkpointing: bool = False  # model.kind=hf: keep each layer's input only, recompute it in the backward
    malloc_mmap_threshold: int | None = None  # glibc: the learner's allocations of at least this many bytes are mmapped, freed back (train.allocator)
    reproducible: bool = False  # every operation of the run with the same bits on any CPU (driftless.ops.reproducible)
    precision: Literal["fp32", "bf16"] = "fp32"  # bf16: the learner's forward under autocast, float32 master weights
    learner_ranks: int = _positive(1)  # data-parallel learner processes under torchrun (driftless.train.parallel)
    parallel: Literal["ddp", "fsdp"] = "ddp"  # with learner_ranks > 1: whole copies, or FSDP2-sharded (train.shard)
    device: Literal["auto", "cpu", "cuda"] = "auto"  # the learner's device; auto: cuda when available (aligned: cpu)
    routing: Literal["recompute", "replay"] = "recompute"  # MoE: the trainer's own experts, or the sampler's (R3)
    loggers: list[LoggerName] = field(default_factory=lambda: ["jsonl"])
    trace: bool = False  # record every consumed batch under RUN/trace/ (driftless replay)
    learner_runtime: Literal["local", "ray"] = "local"  # ray: the learner in a Ray actor (rollout.runtime=ray)


@dataclass
class DiagnosticsSection(_Section):
    _name = "diagnostics"
    decomposition: bool = True  # Eq. 1 every update: weight movement vs same-version disagreement (docs/diagnostics.md)
    keep_versions: int | None = _at_least(None, 0)  # past versions' weights kept for it; None: what lag / η need


@dataclass
class RunConfig:
    model: ModelSection = field(default_factory=ModelSection)
    task: TaskSection = field(default_factory=TaskSection)
    rollout: RolloutSection = field(default_factory=RolloutSection)
    mismatch: MismatchSection = field(default_factory=MismatchSection)
    objective: ObjectiveSection = field(default_factory=ObjectiveSection)
    optim: OptimSection = field(default_factory=OptimSection)
    warm_start: WarmStartSection = field(default_factory=WarmStartSection)
    train: TrainSection = field(default_factory=TrainSection)
    diagnostics: DiagnosticsSection = field(default_factory=DiagnosticsSection)

    def __post_init__(self):
        refusal = runtime_refusal(self)
        if refusal:
            raise ValueError(refusal)

    @property
    def asynchronous(self) -> bool:
        return self.rollout.runtime in ASYNC_RUNTIMES

    def to_dict(self) -> dict:
        return asdict(self)

    def versions_to_keep(self) -> int:
        """How many past versions' weights Eq. 1 needs: one more than the most updates a token can lag."""
        if self.diagnostics.keep_versions is not None:
            return self.diagnostics.keep_versions
        r = self.rollout
        behind = r.eta if self.asynchronous else r.lag + self.mismatch.staleness
        return behind + 1 if behind else 0


@dataclass(frozen=True)
class Rule:
    """One cross-field refusal: ``when`` the config asks for it, ``why`` says so naming ``keys`` (each rule exists
    once, here, checked once when a config is made; capabilities of this machine are ``build.check``'s)."""

    name: str
    keys: tuple[str, ...]
    when: Callable[[RunConfig], bool]
    why: Callable[[RunConfig], str]


def _fsdp_versions(c: RunConfig) -> str:
    return (f"train.parallel=fsdp keeps no past versions' weights for Eq. 1 (this run needs {c.versions_to_keep()}: "
            "lag or staleness); set diagnostics.decomposition=false or train.parallel=ddp")


def _dense(c: RunConfig) -> bool:
    return c.model.kind == "tiny" and not c.model.n_experts


# The rule table (docs/async.md has the runtime matrix): in the order a config is checked, the first one tripped is
# the refusal. The asynchronous runtimes' staleness comes from timing, bounded by η; lag and mismatch.staleness are
# the synchronous runtime's virtual clock; in-flight refresh needs newer weights to arrive mid-response.
RULES: tuple[Rule, ...] = (
    Rule("lag-is-sync", ("rollout.lag", "rollout.runtime"), lambda c: c.asynchronous and c.rollout.lag > 0,
         lambda c: (f"rollout.lag={c.rollout.lag} is the sync runtime's virtual clock; with rollout.runtime="
                    f"{c.rollout.runtime} staleness comes from timing, bounded by rollout.staleness_bound (or use "
                    "rollout.runtime=sync)")),
    Rule("staleness-is-sync", ("mismatch.staleness", "rollout.runtime"),
         lambda c: c.asynchronous and c.mismatch.staleness > 0,
         lambda c: (f"mismatch.staleness={c.mismatch.staleness} refreshes a synchronous sampler every staleness + 1 "
                    f"steps; with rollout.runtime={c.rollout.runtime} use rollout.staleness_bound (or "
                    "rollout.runtime=sync)")),
    Rule("sync-refresh-needs-lag", ("rollout.refresh", "rollout.lag"),
         lambda c: not c.asynchronous and c.rollout.refresh != "pin" and not c.rollout.lag,
         lambda c: (f"rollout.refresh={c.rollout.refresh} needs newer weights to arrive mid-response: with "
                    "rollout.runtime=sync set rollout.lag >= 1, or use rollout.runtime=thread|process|ray")),
    Rule("sync-refresh-without-staleness", ("rollout.refresh", "mismatch.staleness"),
         lambda c: not c.asynchronous and c.rollout.refresh != "pin" and c.mismatch.staleness > 0,
         lambda c: (f"rollout.refresh={c.rollout.refresh} with mismatch.staleness={c.mismatch.staleness}: the "
                    "sampler would not know which version is next; use rollout.lag alone with in-flight refresh")),
    Rule("staleness-bound-is-async", ("rollout.staleness_bound", "rollout.runtime"),
         lambda c: not c.asynchronous and c.rollout.staleness_bound is not None,
         lambda c: (f"rollout.staleness_bound={c.rollout.staleness_bound} bounds the asynchronous runtimes; with "
                    "rollout.runtime=sync the staleness is rollout.lag (+ mismatch.staleness): use those, or "
                    "rollout.runtime=thread|process|ray")),
    Rule("refresh-every-needs-refresh", ("rollout.refresh_every", "rollout.refresh"),
         lambda c: c.rollout.refresh == "pin" and c.rollout.refresh_every is not None,
         lambda c: (f"rollout.refresh_every={c.rollout.refresh_every} needs rollout.refresh=recompute or retain (pin "
                    "never refreshes)")),
    Rule("workers-need-processes", ("rollout.workers", "rollout.runtime"),
         lambda c: c.rollout.workers > 1 and c.rollout.runtime not in ("process", "ray"),
         lambda c: f"rollout.workers={c.rollout.workers} needs rollout.runtime=process or ray (got {c.rollout.runtime!r})"),
    Rule("ray-cpus-need-ray", ("rollout.ray_num_cpus", "rollout.runtime"),
         lambda c: c.rollout.ray_num_cpus is not None and c.rollout.runtime != "ray",
         lambda c: (f"rollout.ray_num_cpus={c.rollout.ray_num_cpus} sizes a local Ray cluster; it needs "
                    f"rollout.runtime=ray (got {c.rollout.runtime!r})")),
    Rule("reproducible", ("train.reproducible",), lambda c: c.train.reproducible and bool(reproducible_refusal(c)),
         lambda c: reproducible_refusal(c)),
    Rule("bf16-is-not-aligned", ("train.precision", "model.execution"),
         lambda c: c.train.precision == "bf16" and c.model.execution == "aligned",
         lambda c: ("train.precision=bf16 with model.execution=aligned: aligned execution is float32 by construction "
                    "(its bits are the promise); use train.precision=fp32 or model.execution=fast")),
    Rule("cuda-is-not-aligned", ("train.device", "model.execution"),
         lambda c: c.train.device == "cuda" and c.model.execution == "aligned",
         lambda c: ("train.device=cuda with model.execution=aligned: aligned execution runs driftless's own CPU "
                    "kernels (its bits are the promise); use train.device=cpu or model.execution=fast")),
    Rule("fsdp-is-not-aligned", ("train.parallel", "model.execution"),
         lambda c: c.train.parallel == "fsdp" and c.model.execution == "aligned",
         lambda c: ("train.parallel=fsdp with model.execution=aligned: FSDP's collectives sum in their own order; "
                    "use train.parallel=ddp or model.execution=fast")),
    Rule("fsdp-reads-no-whole-weights", ("train.parallel", "mismatch.trainer_numerics"),
         lambda c: c.train.parallel == "fsdp" and c.mismatch.trainer_numerics != "fp",
         lambda c: (f"train.parallel=fsdp with mismatch.trainer_numerics={c.mismatch.trainer_numerics!r}: the "
                    "trainer's fake-quantized views read whole weights, which FSDP shards; use train.parallel=ddp")),
    Rule("fsdp-needs-ranks", ("train.parallel", "train.learner_ranks"),
         lambda c: c.train.parallel == "fsdp" and c.train.learner_ranks == 1,
         lambda c: "train.parallel=fsdp shards over learner ranks: it needs train.learner_ranks > 1 (under torchrun)"),
    Rule("fsdp-keeps-no-versions", ("train.parallel", "diagnostics.decomposition"),
         lambda c: c.train.parallel == "fsdp" and c.diagnostics.decomposition and c.versions_to_keep() > 0,
         _fsdp_versions),
    Rule("ranks-need-torchrun-or-ray", ("train.learner_ranks", "rollout.runtime"),
         lambda c: c.train.learner_ranks > 1 and c.rollout.runtime not in ("sync", "ray"),
         lambda c: (f"train.learner_ranks={c.train.learner_ranks} runs under torchrun with rollout.runtime=sync, or "
                    "as Ray actors with rollout.runtime=ray and train.learner_runtime=ray (got rollout.runtime="
                    f"{c.rollout.runtime!r})")),
    Rule("ray-ranks-are-actors", ("train.learner_ranks", "train.learner_runtime"),
         lambda c: c.train.learner_ranks > 1 and c.rollout.runtime == "ray" and c.train.learner_runtime != "ray",
         lambda c: (f"train.learner_ranks={c.train.learner_ranks} with rollout.runtime=ray runs the ranks as Ray "
                    "actors: set train.learner_runtime=ray (a local learner in the Ray driver is one process)")),
    Rule("row-draws-are-the-built-in-samplers", ("rollout.draws", "rollout.engine"),
         lambda c: c.rollout.draws == "row" and c.rollout.engine != "driftless",
         lambda c: (f"rollout.draws=row draws each row from its own stream in the built-in sampler; rollout.engine="
                    f"{c.rollout.engine} draws inside its own loop: use rollout.draws=batch")),
    Rule("sharding-needs-ranks", ("rollout.shard_across_ranks", "train.learner_ranks"),
         lambda c: c.rollout.shard_across_ranks and c.train.learner_ranks == 1,
         lambda c: ("rollout.shard_across_ranks=true shares a step's generation among learner ranks: it needs "
                    "train.learner_ranks > 1 (under torchrun)")),
    Rule("sharding-is-torchruns", ("rollout.shard_across_ranks", "rollout.runtime"),
         lambda c: c.rollout.shard_across_ranks and c.rollout.runtime != "sync",
         lambda c: ("rollout.shard_across_ranks=true shares generation among torchrun's ranks with rollout.runtime="
                    f"sync (got {c.rollout.runtime!r}: its rollout workers are its own)")),
    Rule("sharding-needs-row-draws", ("rollout.shard_across_ranks", "rollout.draws"),
         lambda c: c.rollout.shard_across_ranks and c.rollout.draws != "row",
         lambda c: ("rollout.shard_across_ranks=true needs rollout.draws=row: a rank generates only its share of "
                    "the rows, and each row must draw from its own stream for the ranks to gather the batch one "
                    "process would sample")),
    Rule("sharding-pins-weights", ("rollout.shard_across_ranks", "rollout.refresh"),
         lambda c: c.rollout.shard_across_ranks and c.rollout.refresh != "pin",
         lambda c: (f"rollout.shard_across_ranks=true with rollout.refresh={c.rollout.refresh}: a refresh "
                    "mid-response is timed by the whole batch's decode steps; use rollout.refresh=pin")),
    Rule("sharding-needs-a-group-a-rank", ("rollout.shard_across_ranks", "rollout.prompts_per_step"),
         lambda c: c.rollout.shard_across_ranks and c.rollout.prompts_per_step < c.train.learner_ranks,
         lambda c: (f"rollout.shard_across_ranks=true with rollout.prompts_per_step={c.rollout.prompts_per_step} < "
                    f"train.learner_ranks={c.train.learner_ranks}: every rank generates at least one whole prompt "
                    "group")),
    Rule("ray-learner-needs-ray", ("train.learner_runtime", "rollout.runtime"),
         lambda c: c.train.learner_runtime == "ray" and c.rollout.runtime != "ray",
         lambda c: f"train.learner_runtime=ray needs rollout.runtime=ray, got rollout.runtime={c.rollout.runtime!r}"),
    Rule("replay-needs-experts", ("train.routing", "model.n_experts"),
         lambda c: c.train.routing == "replay" and _dense(c),
         lambda c: ("train.routing=replay replays a mixture of experts' recorded expert ids: it needs "
                    f"model.n_experts > 0 (got {c.model.n_experts}, a dense model)")),
    Rule("router-noise-needs-experts", ("mismatch.view", "model.n_experts"),
         lambda c: "router-noise:" in c.mismatch.view and _dense(c),
         lambda c: (f"mismatch.view={c.mismatch.view} perturbs a mixture of experts' routers: it needs "
                    f"model.n_experts > 0 (got {c.model.n_experts}, a dense model); use noise:SCALE")),
    Rule("vllm-runs-in-the-driver", ("rollout.engine", "rollout.runtime"),
         lambda c: c.rollout.engine == "vllm" and c.rollout.runtime not in ("sync", "thread"),
         lambda c: ("rollout.engine=vllm runs in the driver's process (rollout.runtime=sync or thread), got "
                    f"rollout.runtime={c.rollout.runtime!r}")),
    Rule("vllm-decodes-itself", ("rollout.engine", "rollout.decode_latency"),
         lambda c: c.rollout.engine == "vllm" and c.rollout.decode_latency > 0,
         lambda c: (f"rollout.decode_latency={c.rollout.decode_latency} is not supported by rollout.engine=vllm (its "
                    "decode loop runs inside vLLM); use rollout.engine=driftless")),
    Rule("vllm-pins-weights", ("rollout.engine", "rollout.refresh"),
         lambda c: c.rollout.engine == "vllm" and c.rollout.refresh != "pin",
         lambda c: (f"rollout.refresh={c.rollout.refresh!r} is not supported by rollout.engine=vllm (it cannot swap "
                    "weights inside one generate call); use pin")),
    Rule("checkpointing-is-transformers", ("train.activation_checkpointing", "model.kind"),
         lambda c: c.train.activation_checkpointing and c.model.kind != "hf",
         lambda c: (f"train.activation_checkpointing recomputes a transformers model's layers (model.kind=hf); "
                    f"model.kind={c.model.kind!r} keeps its activations (lower train.micro_batch_tokens instead)")),
    Rule("trainer-numerics-are-tinylms", ("mismatch.trainer_numerics", "model.kind"),
         lambda c: c.mismatch.trainer_numerics != "fp" and c.model.kind == "hf",
         lambda c: (f"mismatch.trainer_numerics={c.mismatch.trainer_numerics!r} needs TinyLM's numerics hook; with "
                    "model.kind=hf the trainer runs at full precision (fp) and the sampler's view alone quantizes")),
    Rule("native-views-are-tinylms", ("mismatch.view", "model.kind"),
         lambda c: c.model.kind == "hf" and "native" in (c.mismatch.view or "").replace(" ", "").split("+"),
         lambda c: (f"mismatch.view={c.mismatch.view!r}: native views (codes with exact accumulation) need TinyLM's "
                    "numerics hook, not model.kind=hf; drop +native (fake quantization)")),
    Rule("vllm-runs-transformers", ("rollout.engine", "model.kind"),
         lambda c: c.rollout.engine == "vllm" and c.model.kind != "hf",
         lambda c: f"rollout.engine=vllm needs model.kind=hf (vLLM runs transformers models), got {c.model.kind!r}"),
)


def refusals(config: RunConfig) -> list[Rule]:
    """Every rule ``config`` trips, in the table's order."""
    return [rule for rule in RULES if rule.when(config)]


def runtime_refusal(config: RunConfig) -> str | None:
    """Why ``config`` asks for something a runtime or setting does not do: the first rule it trips (None: every
    setting is honoured)."""
    tripped = refusals(config)
    return tripped[0].why(config) if tripped else None


def reproducible_refusal(config: RunConfig) -> str | None:
    """Why ``train.reproducible=true`` cannot hold for ``config`` (None: it can)."""
    m, r, t = config.model, config.rollout, config.train
    lead = "train.reproducible=true runs every operation with the same bits on any CPU"
    if m.kind != "tiny":
        return f"{lead}; model.kind={m.kind!r} runs transformers' kernels, which do not: use model.kind=tiny"
    if m.execution != "aligned":
        return f"{lead}; it needs model.execution=aligned (the machine-independent forward), got {m.execution!r}"
    if r.runtime != "sync":
        return (f"{lead}; rollout.runtime={r.runtime!r} schedules by timing (which rows arrive when), so the batches "
                "differ from run to run: use rollout.runtime=sync")
    if r.engine != "driftless":
        return f"{lead}; rollout.engine={r.engine!r} runs its own kernels: use rollout.engine=driftless"
    if t.precision != "fp32":
        return f"{lead}; train.precision={t.precision!r}: it is float32 by construction"
    if t.learner_ranks > 1:
        return (f"{lead}; train.learner_ranks={t.learner_ranks} sums gradients in the collective's own order: "
                "use one learner rank")
    if m.n_experts:
        return (f"{lead}; model.n_experts={m.n_experts}: the mixture of experts' routing (sort, gather, index_add) "
                "has no reproducible rules yet: use model.n_experts=0 or train.reproducible=false")
    if config.mismatch.trainer_numerics != "fp":
        return (f"{lead}; mismatch.trainer_numerics={config.mismatch.trainer_numerics!r} has no reproducible "
                "backward yet: use fp")
    return None


# ---------------------------------------------------------------------------------------- loading
# Keys that were renamed: refused with what to write instead.
_RUNTIME_OF_OLD = {("sync", "local"): "sync", ("async", "local"): "thread", ("async", "process"): "process",
                   ("async", "ray"): "ray"}


def _refuse_old_keys(data: dict) -> None:
    rollout = data.get("rollout")
    if not isinstance(rollout, dict):
        return
    if "mode" in rollout:
        mode, runtime = rollout.get("mode"), rollout.get("runtime", "local")
        new = _RUNTIME_OF_OLD.get((mode, runtime), "sync | thread | process | ray")
        raise ValueError(f"rollout.mode was replaced by rollout.runtime: instead of mode: {mode!r}"
                         f"{f', runtime: {runtime!r}' if 'runtime' in rollout else ''}, write "
                         f"rollout.runtime: {new}")
    if rollout.get("runtime") == "local":
        raise ValueError("rollout.runtime 'local' was renamed: write rollout.runtime: thread (a rollout worker "
                         "thread) or sync (the learner and the worker taking turns)")


def _build(cls, data: dict, prefix: str):
    if not isinstance(data, dict):
        raise ValueError(f"{prefix or 'config'} must be a mapping, got {data!r}")
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - names)
    if unknown:
        where = f"{prefix}." if prefix else ""
        near = difflib.get_close_matches(str(unknown[0]), sorted(names), n=1, cutoff=0.6)
        hint = f"did you mean {where}{near[0]}? " if near else ""
        raise ValueError(f"unknown config key {where}{unknown[0]}: {hint}known keys: {', '.join(sorted(names))}")
    kwargs = {}
    for name, value in data.items():
        key = f"{prefix}.{name}" if prefix else name
        hint = hints[name]
        kwargs[name] = _build(hint, value or {}, key) if dataclasses.is_dataclass(hint) else value
    return cls(**kwargs)


def apply_overrides(data: dict, overrides: list[str]) -> dict:
    for item in overrides:
        if "=" not in item:
            raise ValueError(f"override {item!r} must look like key.sub=value")
        key, raw = item.split("=", 1)
        value = yaml.safe_load(raw) if raw != "" else ""
        node = data
        parts = key.split(".")
        for part in parts[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ValueError(f"override {item!r}: {part!r} is not a section")
        node[parts[-1]] = value
    return data


def read_yaml(path: Path, what: str) -> dict:
    """A YAML mapping from a file; a parse error or another top level names the file, line and column."""
    try:
        data = yaml.safe_load(Path(path).read_text()) or {}
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f", line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = getattr(err, "problem", None) or str(err)
        raise ValueError(f"{what} {path}{where}: not valid YAML ({problem})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{what} {path}: the top level must be a mapping of sections, not {type(data).__name__}")
    return data


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> RunConfig:
    data = {}
    if path is not None:
        path = Path(path)
        if not path.exists():
            raise ValueError(f"config file {path} does not exist")
        data = read_yaml(path, "config file")
    data = apply_overrides(data, overrides or [])
    _refuse_old_keys(data)
    return _build(RunConfig, data, "")


def dump_config(config: RunConfig) -> str:
    return yaml.safe_dump(config.to_dict(), sort_keys=False, allow_unicode=True)
