"""Run configuration: dataclasses loaded from YAML, with ``a.b=c`` overrides.

Unknown keys and bad values are refused with a ValueError that names the key.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from dataclasses import asdict, dataclass, field
from pathlib import Path

import yaml

from driftless.objectives import ESTIMATORS, REWARD_MODES, make
from driftless.ops.numerics import TRAINER_NUMERICS
from driftless.train.warmstart import WarmStartConfig


def _positive(section: str, obj, *names):
    for name in names:
        value = getattr(obj, name)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{section}.{name} must be a positive integer, got {value!r}")


@dataclass
class ModelSection:
    kind: str = "tiny"  # tiny | hf
    execution: str = "fast"  # fast | aligned (tiny only)
    d_model: int = 192
    n_layer: int = 4
    n_head: int = 3
    n_kv_head: int = 1
    d_ff: int = 512
    max_seq_len: int = 64
    hf_path: str | None = None  # a local transformers directory; None = a tiny random Qwen3 config
    warm_start: bool = True  # tiny only: start from the cached supervised warm start

    def __post_init__(self):
        if self.kind not in ("tiny", "hf"):
            raise ValueError(f"model.kind must be 'tiny' or 'hf', got {self.kind!r}")
        if self.execution not in ("fast", "aligned"):
            raise ValueError(f"model.execution must be 'fast' or 'aligned', got {self.execution!r}")
        if self.kind == "hf" and self.execution == "aligned":
            raise ValueError("model.execution 'aligned' needs model.kind 'tiny'")
        _positive("model", self, "d_model", "n_layer", "n_head", "n_kv_head", "d_ff", "max_seq_len")


TASKS = ("countdown", "arithmetic", "first-token")


@dataclass
class TaskSection:
    name: str = "countdown"  # countdown | arithmetic | first-token
    n_numbers: int = 3
    min_number: int = 1
    max_number: int = 9
    max_target: int = 100
    ops: str = "+-*/"
    max_operand: int = 20  # arithmetic only
    target: str = "7"  # first-token only: the rewarded first character

    def __post_init__(self):
        if self.name not in TASKS:
            raise ValueError(f"task.name must be one of {', '.join(TASKS)}, got {self.name!r}")
        self.build()  # validates the task's own knobs

    def build(self):
        from driftless.tasks import Arithmetic, Countdown, CountdownConfig, FirstToken

        if self.name == "arithmetic":
            return Arithmetic(self.max_operand)
        if self.name == "first-token":
            return FirstToken(self.target)
        return Countdown(CountdownConfig(self.n_numbers, self.min_number, self.max_number, self.max_target, self.ops))


@dataclass
class RolloutSection:
    prompts_per_step: int = 16
    group_size: int = 8
    max_new_tokens: int = 24
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    head_k: int = 32
    mode: str = "sync"  # sync | async (a rollout worker thread; staleness bounded by `staleness_bound`)
    staleness_bound: int = 1  # async: η, the most versions a consumed token may be behind the learner
    lag: int = 0  # sync: batch s is sampled from version max(0, s − lag) (a deterministic virtual clock)
    refresh: str = "pin"  # in-flight weight refresh: pin | recompute | retain
    refresh_every: int = 8  # tokens between refresh checks
    reward_latency: float = 0.0  # seconds of injected wait per prompt group (tool calls, verifiers)
    runtime: str = "local"  # async: local (a thread) | process (spawned processes) | ray (actors)
    ray_num_cpus: int = 2  # CPUs given to ray.init when no cluster is connected
    workers: int = 1  # runtime=process|ray: rollout workers (processes / actors) producing batches in turn
    engine: str = "driftless"  # driftless (built-in Sampler) | vllm (a vLLM engine; model.kind=hf, docs/vllm.md)

    def __post_init__(self):
        _positive("rollout", self, "prompts_per_step", "group_size", "max_new_tokens", "refresh_every", "workers")
        if self.runtime not in ("local", "process", "ray"):
            raise ValueError(f"rollout.runtime must be 'local', 'process' or 'ray', got {self.runtime!r}")
        from driftless.rollout.worker import ENGINES

        if self.engine not in ENGINES:
            raise ValueError(f"rollout.engine must be one of {', '.join(ENGINES)}, got {self.engine!r}")
        if self.engine == "vllm" and self.refresh != "pin":
            raise ValueError(f"rollout.refresh={self.refresh!r} is not supported by rollout.engine=vllm (it cannot "
                             "swap weights inside one generate call); use pin")
        if self.engine == "vllm" and self.runtime != "local":
            raise ValueError(f"rollout.engine=vllm runs with rollout.runtime=local (the engine in the driver's "
                             f"process), got {self.runtime!r}")
        if self.workers > 1 and (self.mode, self.runtime) not in (("async", "process"), ("async", "ray")):
            raise ValueError(f"rollout.workers={self.workers} needs rollout.mode=async with rollout.runtime=process "
                             f"or ray (got mode {self.mode!r}, runtime {self.runtime!r})")
        if self.mode not in ("sync", "async"):
            raise ValueError(f"rollout.mode must be 'sync' or 'async', got {self.mode!r}")
        if self.refresh not in ("pin", "recompute", "retain"):
            raise ValueError(f"rollout.refresh must be pin, recompute or retain, got {self.refresh!r}")
        for name in ("staleness_bound", "lag"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 0:
                raise ValueError(f"rollout.{name} must be an integer >= 0, got {getattr(self, name)!r}")
        if not self.reward_latency >= 0:
            raise ValueError(f"rollout.reward_latency must be >= 0, got {self.reward_latency!r}")
        if not isinstance(self.head_k, int) or self.head_k < 0:
            raise ValueError(f"rollout.head_k must be an integer >= 0, got {self.head_k!r}")
        try:
            self.sampling()
        except ValueError as err:
            raise ValueError(f"rollout: {err}") from None

    def sampling(self):
        from driftless.rollout import SamplingParams

        return SamplingParams(temperature=self.temperature, top_k=self.top_k, top_p=self.top_p)


@dataclass
class MismatchSection:
    view: str = "none"  # sampler view spec, e.g. "w8a8+kv:int8", "noise:0.05" (driftless.mismatch)
    staleness: int = 0  # refresh the sampler every staleness + 1 steps
    trainer_numerics: str = "fp"  # fp | fwd-fq | fwd-bwd-fq | native

    def __post_init__(self):
        from driftless.mismatch import SyncPolicy, parse_view

        try:
            view = parse_view(self.view)
        except ValueError as err:
            raise ValueError(f"mismatch.view: {err}") from None
        SyncPolicy(self.staleness)
        if self.trainer_numerics not in TRAINER_NUMERICS:
            raise ValueError(f"mismatch.trainer_numerics must be one of {TRAINER_NUMERICS}, got {self.trainer_numerics!r}")
        if self.trainer_numerics != "fp" and view.quant is None:
            raise ValueError(f"mismatch.trainer_numerics {self.trainer_numerics!r} needs a quantized mismatch.view")


@dataclass
class ObjectiveSection:
    name: str = "pg"
    params: dict = field(default_factory=dict)
    reward_mode: str = "±1"  # +1/0 | ±1 | ±1-centered
    advantage: str = "group-mean"  # group-mean | grpo | leave-one-out | none

    def __post_init__(self):
        if self.reward_mode not in REWARD_MODES:
            raise ValueError(f"objective.reward_mode must be one of {REWARD_MODES}, got {self.reward_mode!r}")
        if self.advantage not in ESTIMATORS:
            raise ValueError(f"objective.advantage must be one of {ESTIMATORS}, got {self.advantage!r}")
        try:
            self.build()
        except ValueError as err:
            raise ValueError(f"objective: {err}") from None

    def build(self):
        return make(self.name, **(self.params or {}))


SCHEDULES = ("constant", "linear", "cosine")


@dataclass
class OptimSection:
    name: str = "sgd"  # sgd (plain, as in the paper) | adamw
    lr: float = 0.5
    weight_decay: float = 0.0
    beta1: float = 0.9
    beta2: float = 0.999
    grad_clip: float = 1.0  # 0 = off
    schedule: str = "constant"  # constant | linear (to 0 at the last optimizer step) | cosine

    def __post_init__(self):
        if self.schedule not in SCHEDULES:
            raise ValueError(f"optim.schedule must be one of {', '.join(SCHEDULES)}, got {self.schedule!r}")
        if self.name not in ("sgd", "adamw"):
            raise ValueError(f"optim.name must be 'sgd' or 'adamw', got {self.name!r}")
        if not self.lr > 0:
            raise ValueError(f"optim.lr must be > 0, got {self.lr!r}")
        if self.grad_clip < 0:
            raise ValueError(f"optim.grad_clip must be >= 0, got {self.grad_clip!r}")


@dataclass
class WarmStartSection(WarmStartConfig):
    """The warm start's settings (driftless.train.warmstart) plus where its cache lives."""

    cache_dir: str = "runs/warmstart"

    def settings(self) -> WarmStartConfig:
        return WarmStartConfig(**{f.name: getattr(self, f.name) for f in dataclasses.fields(WarmStartConfig)})


@dataclass
class TrainSection:
    steps: int = 60
    seed: int = 0
    eval_every: int = 10
    eval_problems: int = 128
    checkpoint_every: int = 20
    run_dir: str = "runs/default"
    progress: bool = True
    ppo_epochs: int = 1  # optimizer passes over each batch (PPO epochs; the anchor π0 is fixed before the first)
    minibatches: int = 1  # optimizer steps per pass (rows split into contiguous minibatches)
    loggers: list[str] = field(default_factory=lambda: ["jsonl"])  # jsonl | tensorboard | wandb
    trace: bool = False  # async runs: record every consumed batch under RUN/trace/ (driftless replay)
    learner_runtime: str = "local"  # local (in the driver) | ray (a Ray actor; needs rollout.runtime=ray)

    def __post_init__(self):
        _positive("train", self, "steps", "eval_every", "eval_problems", "checkpoint_every", "ppo_epochs",
                  "minibatches")
        from driftless.train.sinks import LOGGERS

        if self.learner_runtime not in ("local", "ray"):
            raise ValueError(f"train.learner_runtime must be 'local' or 'ray', got {self.learner_runtime!r}")

        bad = [name for name in self.loggers if name not in LOGGERS]
        if bad:
            raise ValueError(f"train.loggers: unknown logger(s) {bad}; choose from {', '.join(LOGGERS)}")


@dataclass
class DiagnosticsSection:
    decomposition: bool = True  # Eq. 1 every update: weight movement vs same-version disagreement (docs/diagnostics.md)
    keep_versions: int | None = None  # past versions' weights kept for it; None: what staleness / lag / η need

    def __post_init__(self):
        if self.keep_versions is not None and (not isinstance(self.keep_versions, int) or self.keep_versions < 0):
            raise ValueError(f"diagnostics.keep_versions must be an integer >= 0 (or null), got {self.keep_versions!r}")


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
        if self.train.learner_runtime == "ray" and (self.rollout.mode, self.rollout.runtime) != ("async", "ray"):
            raise ValueError("train.learner_runtime=ray needs rollout.mode=async and rollout.runtime=ray, got "
                             f"rollout.mode={self.rollout.mode!r}, rollout.runtime={self.rollout.runtime!r}")
        if self.rollout.engine == "vllm":
            if self.model.kind != "hf":
                raise ValueError(f"rollout.engine=vllm needs model.kind=hf (vLLM runs transformers models), "
                                 f"got model.kind={self.model.kind!r}")
            from driftless.mismatch import parse_view

            quant = parse_view(self.mismatch.view).quant
            if quant is not None and (quant.act is not None or quant.kv is not None):
                raise ValueError(f"mismatch.view={self.mismatch.view!r}: with rollout.engine=vllm only weight-only "
                                 "views and noise apply (activation / KV views need TinyLM's numerics hook)")

    def to_dict(self) -> dict:
        return asdict(self)

    def versions_to_keep(self) -> int:
        """How many past versions' weights Eq. 1 needs: one more than the most updates a token can lag."""
        if self.diagnostics.keep_versions is not None:
            return self.diagnostics.keep_versions
        r = self.rollout
        behind = max(r.lag, self.mismatch.staleness, r.staleness_bound if r.mode == "async" else 0)
        return behind + 1 if behind else 0


def _coerce(key: str, value, annotation):
    """Check (and gently coerce) a YAML value against a dataclass field's type."""
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        return _coerce(key, value, inner[0])
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


def _build(cls, data: dict, prefix: str):
    if not isinstance(data, dict):
        raise ValueError(f"{prefix or 'config'} must be a mapping, got {data!r}")
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - names)
    if unknown:
        where = f"{prefix}." if prefix else ""
        raise ValueError(f"unknown config key {where}{unknown[0]!r}; known keys: {', '.join(sorted(names))}")
    kwargs = {}
    for name, value in data.items():
        key = f"{prefix}.{name}" if prefix else name
        hint = hints[name]
        if dataclasses.is_dataclass(hint):
            kwargs[name] = _build(hint, value or {}, key)
        else:
            kwargs[name] = _coerce(key, value, hint)
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


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> RunConfig:
    data = {}
    if path is not None:
        path = Path(path)
        if not path.exists():
            raise ValueError(f"config file {path} does not exist")
        data = yaml.safe_load(path.read_text()) or {}
    data = apply_overrides(data, overrides or [])
    return _build(RunConfig, data, "")


def dump_config(config: RunConfig) -> str:
    return yaml.safe_dump(config.to_dict(), sort_keys=False, allow_unicode=True)
