"""`driftless audit`: each planted fault is caught by its named check and by nothing else; a clean file passes."""

from __future__ import annotations

import copy
import json

import pytest
import torch

from driftless.audit import (
    IgnoresUpdates,
    Record,
    audit_engine,
    audit_records,
    perturbed,
    read_records,
    write_records,
    write_report,
)
from driftless.cli import main
from driftless.models import TinyLM, TinyLMConfig
from driftless.models.io import save_model
from driftless.rollout.sampling import SamplingParams, sampling_logprobs

PARAMS = SamplingParams(temperature=0.7, top_k=20, top_p=0.95)


@pytest.fixture(scope="module")
def model():
    m = TinyLM(TinyLMConfig(d_model=32, n_layer=1, n_head=2, n_kv_head=1, d_ff=64, init_std=0.1))
    m.reset_parameters(seed=3)
    return m.eval()


@pytest.fixture(scope="module")
def prompts():
    g = torch.Generator().manual_seed(0)
    return [torch.randint(2, 64, (5,), generator=g).tolist() for _ in range(12)]


@pytest.fixture(scope="module")
def clean(model, prompts):
    result, records = audit_engine(model, prompts, engine="builtin", params=PARAMS, max_new_tokens=12)
    return result, records


def verdicts(result) -> dict:
    return {c["name"]: c["passed"] for c in result["checks"]}


def failed(result) -> set:
    return {n for n, p in verdicts(result).items() if p is False}


@torch.no_grad()
def rewritten(model, records, fn, mode=None) -> list[Record]:
    """Records whose values are ``fn(logits [R, V], record) -> [R]`` instead of what the engine recorded."""
    out = []
    for r in records:
        tokens = torch.tensor([r.prompt_ids + r.response_ids])
        p = len(r.prompt_ids)
        x = model(tokens[:, :-1])[0, p - 1:].float()
        out.append(Record(r.prompt_ids, r.response_ids, fn(x, r).double().tolist(), r.temperature, r.top_k, r.top_p,
                          mode or r.logprobs_mode))
    return out


def own(lp, r):
    return lp.gather(1, torch.tensor(r.response_ids)[:, None])[:, 0]


def test_a_clean_engine_passes_every_check(clean):
    result, records = clean
    assert verdicts(result) == {"sampled-token": True, "sampling-transform": True, "weights": True,
                                "numerics": True, "batch-invariance": True, "weight-sync": True, "routes": None}
    assert result["passed"] and result["explanation"] == {"convention": "processed", "token": "sampled"}
    numerics = next(c for c in result["checks"] if c["name"] == "numerics")
    assert numerics["kl_k3"] < 1e-8 and numerics["tokens"] == sum(len(r.response_ids) for r in records)


def test_top_ranked_values_fail_the_sampled_token_check_only(model, clean):
    records = rewritten(model, clean[1], lambda x, r: sampling_logprobs(x, r.params).max(-1).values)
    result = audit_records(model, records)
    assert failed(result) == {"sampled-token"}
    assert next(c for c in result["checks"] if c["name"] == "sampled-token")["fits_best"] == "top-ranked"


def test_a_shifted_position_fails_the_sampled_token_check_only(model, clean):
    def shifted(x, r):
        v = own(sampling_logprobs(x, r.params), r)
        return torch.cat([v[1:], v[-1:]])  # each position holds the next token's value (off by one)
    result = audit_records(model, rewritten(model, clean[1], shifted))
    assert failed(result) == {"sampled-token"}


@pytest.mark.parametrize("values, declared, follows", [
    ("processed", "raw_logprobs", "processed"),    # processed values declared raw
    ("raw", "processed_logprobs", "raw"),          # raw values declared processed (temperature not applied either)
    ("scaled", "processed_logprobs", "scaled"),    # temperature applied, top-k / top-p renormalisation not
])
def test_a_convention_other_than_the_declared_one_fails_the_transform_check_only(model, clean, values, declared,
                                                                                 follows):
    fns = {"processed": lambda x, r: own(sampling_logprobs(x, r.params), r),
           "raw": lambda x, r: own(torch.log_softmax(x, -1), r),
           "scaled": lambda x, r: own(torch.log_softmax(x / r.temperature, -1), r)}
    result = audit_records(model, rewritten(model, clean[1], fns[values], mode=declared))
    assert failed(result) == {"sampling-transform"}
    check = next(c for c in result["checks"] if c["name"] == "sampling-transform")
    assert check["follows"] == follows
    if values == "processed":  # a trainer normalising over the whole vocabulary sees a biased ratio
        assert check["full_vocabulary_ratio_outside_0.9_1.1"] > 0.05


def test_values_from_other_weights_fail_the_weights_check_and_name_them(model, clean):
    other = copy.deepcopy(model)
    other.load_state_dict(perturbed(model.state_dict(), 0.1))
    records = rewritten(other, clean[1], lambda x, r: own(sampling_logprobs(x, r.params), r))
    result = audit_records(model, records, also_model=other)
    assert failed(result) == {"weights"}
    weights = next(c for c in result["checks"] if c["name"] == "weights")
    assert weights["fits"] == "also_model" and weights["mean_abs_residual"] > weights["bound"]
    assert verdicts(result)["numerics"] is None  # not judged


def test_an_engine_that_ignores_a_weight_update_fails_weight_sync_only(model, prompts):
    result, _ = audit_engine(model, prompts, engine="builtin", params=PARAMS, max_new_tokens=12, wrap=IgnoresUpdates)
    assert failed(result) == {"weight-sync"}
    check = next(c for c in result["checks"] if c["name"] == "weight-sync")
    assert check["mean_abs_residual_old_weights"] < check["mean_abs_residual_new_weights"]


def test_the_command_line_reads_a_file_writes_the_report_and_exits_by_verdict(model, clean, tmp_path, capsys):
    save_model(model, tmp_path / "m.safetensors")
    write_records(clean[1], tmp_path / "clean.jsonl")
    assert main(["audit", "records", "--model", str(tmp_path / "m.safetensors"), "--records",
                 str(tmp_path / "clean.jsonl"), "--report", str(tmp_path / "rep")]) == 0
    saved = json.loads((tmp_path / "rep/audit.json").read_text())
    assert [c["name"] for c in saved["checks"]] == ["sampled-token", "sampling-transform", "weights", "numerics"]
    assert (tmp_path / "rep/audit.md").exists() and (tmp_path / "rep/dlogp_by_position.png").exists()
    wrong = [json.loads(x) for x in (tmp_path / "clean.jsonl").read_text().splitlines()]
    for row in wrong:
        row["logprobs_mode"] = "raw_logprobs"
    (tmp_path / "wrong.jsonl").write_text("".join(json.dumps(r) + "\n" for r in wrong))
    assert main(["audit", "records", "--model", str(tmp_path / "m.safetensors"), "--records",
                 str(tmp_path / "wrong.jsonl")]) == 1
    assert "sampling-transform" in capsys.readouterr().out
    (tmp_path / "bad.jsonl").write_text(json.dumps({"prompt_ids": [1, 2], "response_ids": [3, 4],
                                                    "response_logprobs": [-0.5]}) + "\n")
    assert main(["audit", "records", "--model", str(tmp_path / "m.safetensors"), "--records",
                 str(tmp_path / "bad.jsonl")]) == 2
    assert "bad.jsonl line 1: field 'response_logprobs' holds 1 values for 2 response_ids" in capsys.readouterr().err
    with pytest.raises(ValueError, match="line 1: field 'logprobs_mode' = 'logits'"):
        (tmp_path / "m2.jsonl").write_text(json.dumps({**wrong[0], "logprobs_mode": "logits"}) + "\n")
        read_records(tmp_path / "m2.jsonl")
    write_report(saved, tmp_path / "again")


def test_transformers_generate_as_the_engine_records_processed_log_probabilities(prompts):
    pytest.importorskip("transformers")
    from driftless.models.hf import HFPolicy, tiny_qwen3_config

    cfg = tiny_qwen3_config()
    cfg.initializer_range = 0.1  # peaked, so that the conventions differ
    torch.manual_seed(0)
    policy = HFPolicy(cfg)
    result, records = audit_engine(policy, prompts[:6], engine="hf", params=PARAMS, max_new_tokens=8)
    assert failed(result) == set(), result["checks"]
    assert result["explanation"] == {"convention": "processed", "token": "sampled"}
    assert all(r.logprobs_mode == "processed_logprobs" and len(r.response_ids) == 8 for r in records)
