"""The config's rule table (driftless.train.config.RULES): every cross-field refusal exists once, as a named rule,
and each is tripped here by the smallest config that asks for it, its message naming its keys."""

from __future__ import annotations

import pytest

from driftless.train import load_config
from driftless.train.config import RULES, refusals

HF = ["model.kind=hf", "model.hf_path=some/checkpoint"]
SHARD = ["rollout.shard_across_ranks=true", "rollout.draws=row", "train.learner_ranks=2"]
TRIPS = {
    "lag-is-sync": ["rollout.runtime=thread", "rollout.lag=1"],
    "staleness-is-sync": ["rollout.runtime=thread", "mismatch.staleness=1"],
    "sync-refresh-needs-lag": ["rollout.refresh=retain"],
    "sync-refresh-without-staleness": ["rollout.refresh=retain", "rollout.lag=1", "mismatch.staleness=1"],
    "staleness-bound-is-async": ["rollout.staleness_bound=2"],
    "refresh-every-needs-refresh": ["rollout.refresh_every=4"],
    "workers-need-processes": ["rollout.workers=2"],
    "ray-cpus-need-ray": ["rollout.ray_num_cpus=2"],
    "reproducible": ["train.reproducible=true", "model.execution=fast"],
    "bf16-is-not-aligned": ["train.precision=bf16", "model.execution=aligned"],
    "cuda-is-not-aligned": ["train.device=cuda", "model.execution=aligned"],
    "fsdp-is-not-aligned": ["train.parallel=fsdp", "train.learner_ranks=2", "model.execution=aligned"],
    "fsdp-reads-no-whole-weights": ["train.parallel=fsdp", "train.learner_ranks=2", "mismatch.trainer_numerics=fwd-fq"],
    "fsdp-needs-ranks": ["train.parallel=fsdp"],
    "fsdp-keeps-no-versions": ["train.parallel=fsdp", "train.learner_ranks=2", "rollout.lag=1"],
    "ranks-need-torchrun-or-ray": ["train.learner_ranks=2", "rollout.runtime=thread"],
    "ray-ranks-are-actors": ["train.learner_ranks=2", "rollout.runtime=ray"],
    "row-draws-are-the-built-in-samplers": ["rollout.draws=row", "rollout.engine=vllm", *HF],
    "sharding-needs-ranks": [*SHARD, "train.learner_ranks=1"],
    "sharding-is-torchruns": [*SHARD, "rollout.runtime=ray", "train.learner_runtime=ray"],
    "sharding-needs-row-draws": [*SHARD, "rollout.draws=batch"],
    "sharding-pins-weights": [*SHARD, "rollout.lag=1", "rollout.refresh=retain"],
    "sharding-needs-a-group-a-rank": [*SHARD, "rollout.prompts_per_step=1"],
    "ray-learner-needs-ray": ["train.learner_runtime=ray"],
    "replay-needs-experts": ["train.routing=replay"],
    "router-noise-needs-experts": ["mismatch.view=router-noise:1.0"],
    "vllm-runs-in-the-driver": ["rollout.engine=vllm", "rollout.runtime=process", *HF],
    "checkpointing-is-transformers": ["train.activation_checkpointing=true"],
    "vllm-decodes-itself": ["rollout.engine=vllm", "rollout.decode_latency=0.1", *HF],
    "vllm-pins-weights": ["rollout.engine=vllm", "rollout.lag=1", "rollout.refresh=retain", *HF],
    "vllm-runs-transformers": ["rollout.engine=vllm"],
    "trainer-numerics-are-tinylms": ["mismatch.trainer_numerics=fwd-fq", "mismatch.view=w8a8", *HF],
    "native-views-are-tinylms": ["mismatch.view=w8a8+native", *HF],
}


def test_every_rule_has_a_config_that_trips_it_and_the_names_are_unique():
    names = [rule.name for rule in RULES]
    assert len(set(names)) == len(names)
    assert set(TRIPS) == set(names)


@pytest.mark.parametrize("rule", RULES, ids=lambda r: r.name)
def test_each_rule_refuses_its_config_first_naming_its_keys(rule, monkeypatch):
    with pytest.raises(ValueError) as err:
        load_config(None, TRIPS[rule.name])
    message = str(err.value)
    for key in rule.keys:
        assert key in message, (rule.name, key, message)
    import driftless.train.config as schema

    monkeypatch.setattr(schema, "runtime_refusal", lambda config: None)  # the same config, made without the check
    config = load_config(None, TRIPS[rule.name])
    assert refusals(config)[0] is rule and rule.why(config) == message  # this rule is the first it trips


def test_the_default_config_trips_no_rule():
    assert refusals(load_config(None, [])) == []


def test_the_schema_imports_no_torch():
    import subprocess
    import sys

    code = ("import sys; import driftless.train.config as c; "
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert out == "False"
