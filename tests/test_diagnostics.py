"""The evidence a correction is chosen by: Eq. 1's parts, Rényi D2, ratio quantiles and tails, the
head; DPPO's trust region on hand-computed tokens."""

from __future__ import annotations

import json
import math
from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from driftless.diagnostics.evidence import eq1_decomposition, eq1_parts, head_diagnostics, ratio_diagnostics
from driftless.objectives import make
from driftless.train import load_config
from driftless.train.loop import TIMING_KEYS, Run

SMALL = ["model.warm_start=false", "model.d_model=64", "model.n_layer=2", "model.n_head=2", "model.n_kv_head=1",
         "model.d_ff=128", "model.max_seq_len=16", "task.name=first-token", "rollout.prompts_per_step=8",
         "rollout.group_size=8", "rollout.max_new_tokens=2", "rollout.head_k=8", "train.eval_every=1000",
         "train.eval_problems=32", "train.checkpoint_every=1000", "optim.name=adamw", "optim.schedule=constant", "optim.lr=1e-2",
         "train.progress=false"]


def rows(run_dir):
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


# ---------------------------------------------------------------- closed forms
def test_ratio_diagnostics_on_four_tokens():
    w = torch.tensor([[1.0, 2.0, 4.0, 0.25, 9.0]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1, 1, 0]])  # the last token is not an action
    lq = torch.full_like(w, math.log(0.01))
    d = ratio_diagnostics(lq + w.log(), lq, mask)
    assert d["renyi_d2"] == pytest.approx(math.log((1 + 4 + 16 + 1 / 16) / 4), rel=1e-12)
    # linear interpolation between order statistics 0.25, 1, 2, 4
    assert d["ratio_p50"] == pytest.approx(1.5) and d["ratio_p01"] == pytest.approx(0.25 + 0.03 * 0.75)
    assert d["ratio_p99"] == pytest.approx(2 + 0.97 * 2)
    assert (d["ratio_frac_gt2"], d["ratio_frac_gt10"], d["ratio_frac_lt0p5"]) == (0.25, 0.0, 0.25)


def test_renyi_d2_equals_the_closed_form_when_samples_follow_q():
    """Over a 3-token vocabulary, tokens in exact proportion to q: the estimate is log Σ p²/q."""
    q = torch.tensor([0.5, 0.25, 0.25], dtype=torch.float64)
    p = torch.tensor([0.2, 0.3, 0.5], dtype=torch.float64)
    tokens = torch.tensor([[0, 0, 1, 2]])
    d = ratio_diagnostics(p.log()[tokens], q.log()[tokens], torch.ones_like(tokens))
    assert d["renyi_d2"] == pytest.approx(math.log(float((p * p / q).sum())), rel=1e-12)
    same = ratio_diagnostics(q.log()[tokens], q.log()[tokens], torch.ones_like(tokens))
    assert same["renyi_d2"] == 0.0 and same["ratio_p01"] == same["ratio_p99"] == 1.0


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(*[st.floats(-20.0, -2.0 ** -10, width=32)] * 3), min_size=1, max_size=40))
def test_eq1_parts_sum_exactly_to_the_total(triples):
    lp, lv, lq = (torch.tensor([t[i] for t in triples], dtype=torch.float32)[None] for i in range(3))
    total, movement, disagreement = eq1_parts(lp, lv, lq)
    assert torch.equal(movement + disagreement, total)
    d = eq1_decomposition(lp, lv, lq, torch.ones_like(lp))
    assert d["eq1_movement_mean"] + d["eq1_disagreement_mean"] == pytest.approx(d["log_ratio_mean"], abs=1e-12)


def test_head_diagnostics():
    tokens = torch.tensor([[5, 2, 7]])
    ids = torch.tensor([[[5, 1], [3, 4], [7, 2]]])
    logq = torch.tensor([[[0.6, 0.3], [0.5, 0.2], [0.9, 0.05]]]).log()
    logp = torch.tensor([[[0.5, 0.3], [0.4, 0.4], [0.8, 0.1]]]).log()
    d = head_diagnostics(tokens, ids, logq, logp, torch.tensor([[1, 1, 1]]))
    assert d["head_mass_q"] == pytest.approx((0.9 + 0.7 + 0.95) / 3)
    assert d["head_mass_p"] == pytest.approx((0.8 + 0.8 + 0.9) / 3)
    assert d["in_head_fraction"] == pytest.approx(2 / 3)  # token 2 is not in its row's head
    one = head_diagnostics(tokens, ids, logq, logp[..., :1], torch.tensor([[1, 1, 1]]))  # a shorter trainer head
    assert one["head_mass_q"] == pytest.approx((0.6 + 0.5 + 0.9) / 3) and one["in_head_fraction"] == pytest.approx(2 / 3)


# ---------------------------------------------------------------- Eq. 1 in real runs
def test_movement_is_exactly_zero_without_lag_and_disagreement_exactly_zero_when_aligned(tmp_path):
    Run(load_config(None, [*SMALL, "train.steps=3", "mismatch.view=noise:0.05"]), tmp_path / "noisy").run()
    noisy = rows(tmp_path / "noisy")
    assert all(r["eq1_movement_abs"] == 0.0 and r["eq1_disagreement_abs"] > 0 for r in noisy)
    assert all(r["log_ratio_mean"] == r["eq1_disagreement_mean"] for r in noisy)
    # aligned execution, no view, lag 2: every bit of p/q is weight movement
    Run(load_config(None, [*SMALL, "train.steps=4", "rollout.lag=2", "model.execution=aligned"]),
        tmp_path / "lag").run()
    lag = rows(tmp_path / "lag")
    assert all(r["eq1_disagreement_abs"] == 0.0 and r["eq1_unscored_fraction"] == 0.0 for r in lag)
    assert lag[0]["eq1_movement_abs"] == 0.0 and all(r["eq1_movement_abs"] > 0 for r in lag[1:])
    assert all(r["log_ratio_mean"] == pytest.approx(r["eq1_movement_mean"], abs=1e-12) for r in lag)
    assert {"renyi_d2", "ratio_p01", "ratio_p50", "ratio_p99", "ratio_frac_gt2", "ratio_frac_gt10",
            "ratio_frac_lt0p5", "head_mass_q", "head_mass_p", "in_head_fraction", "sampler_age_p50",
            "sampler_age_max", "ratio_ess", "truncated_fraction", "masked_fraction"} <= set(lag[-1])


def test_too_few_kept_versions_are_reported_not_guessed(tmp_path):
    Run(load_config(None, [*SMALL, "train.steps=4", "rollout.lag=2", "diagnostics.keep_versions=1"]),
        tmp_path).run()
    lines = rows(tmp_path)
    assert lines[0]["eq1_unscored_fraction"] == 0.0  # version 0 is the learner's own at step 0
    assert all(r["eq1_unscored_fraction"] == 1.0 for r in lines[2:])  # versions 1, 2 behind: not kept


def test_decomposition_can_be_switched_off(tmp_path):
    Run(load_config(None, [*SMALL, "train.steps=2", "rollout.lag=1", "diagnostics.decomposition=false"]),
        tmp_path).run()
    assert not any(k.startswith("eq1_") for r in rows(tmp_path) for k in r)
    with pytest.raises(ValueError, match="diagnostics.keep_versions must be >= 0, got -1"):
        load_config(None, ["diagnostics.keep_versions=-1"])


def test_lag_decomposition_resumes_exactly(tmp_path):
    """The kept versions travel in the checkpoint: a resumed lagged run logs the same Eq. 1 parts."""
    from conftest import run_until_killed

    extra = [*SMALL, "rollout.lag=2", "train.steps=6", "train.checkpoint_every=3", "mismatch.view=noise:0.05"]
    Run(load_config(None, extra), tmp_path / "a").run()
    run_until_killed(Run(load_config(None, extra), tmp_path / "b"), 3)
    Run(load_config(None, extra), tmp_path / "b").run(resume=True)
    strip = lambda rs: [{k: v for k, v in r.items() if k not in TIMING_KEYS} for r in rs]
    a, b = strip(rows(tmp_path / "a")), strip(rows(tmp_path / "b"))
    assert a == b and all(r["eq1_movement_abs"] > 0 and r["eq1_disagreement_abs"] > 0 for r in a[1:])


# ---------------------------------------------------------------- DPPO
def _dppo(name, mu, p, adv, **params):
    lp = torch.tensor([p], dtype=torch.float64).log().requires_grad_()
    batch = SimpleNamespace(sampler_logp=torch.tensor([mu], dtype=torch.float64).log(),
                            action_mask=torch.ones(1, len(p), dtype=torch.bool),
                            advantage=torch.tensor([adv], dtype=torch.float64))
    objective = make(name, **params)
    loss, metrics = objective(SimpleNamespace(logp=lp), batch)
    loss.backward()
    return lp.grad[0], metrics


@pytest.mark.parametrize("delta_low,delta_high,expected", [
    # t0: A>0, p−μ=+0.25 > δ_high: masked    t1: A<0, p−μ=−0.30 < −δ_low: masked
    # t2: A>0, +0.10: kept                     t3: A<0, −0.30: masked
    # t4: A<0 but moved up (+0.15): kept       t5: A>0 but moved down (−0.10): kept
    # t6: A<0, moved up (+0.29): kept, weight min(p/μ = 30, cap 20) = 20
    (0.2, 0.2, [0, 0, 1, 0, 1, 1, 1]),
    (0.35, 0.2, [0, 1, 1, 1, 1, 1, 1]),  # only δ_low gates negative advantages
    (0.2, 0.3, [1, 0, 1, 0, 1, 1, 1]),  # only δ_high gates positive ones
])
def test_dppo_tv_masks_by_advantage_sign(delta_low, delta_high, expected):
    mu = [0.10, 0.40, 0.50, 0.70, 0.30, 0.60, 0.01]
    p = [0.35, 0.10, 0.60, 0.40, 0.45, 0.50, 0.30]
    adv = [1.0, -1.0, 1.0, -1.0, -1.0, 1.0, -1.0]
    grad, metrics = _dppo("dppo-tv", mu, p, adv, delta_low=delta_low, delta_high=delta_high)
    weight = [min(b / a, 20.0) for a, b in zip(mu, p)]
    # loss = token-mean of −w · m · A · log p: d loss / d log p = −w m A / n
    want = torch.tensor([-w * m * a / len(p) for w, m, a in zip(weight, expected, adv)], dtype=torch.float64)
    assert torch.allclose(grad, want, rtol=1e-12, atol=0)
    assert metrics["masked_fraction"] == pytest.approx(expected.count(0) / len(p))
    assert metrics["truncated_fraction"] == pytest.approx(1 / len(p))  # t6's p/μ = 30 > 20


def test_dppo_kl_masks_by_binary_kl_and_direction():
    # binary KL(μ‖p) at μ = 0.5: p = 0.8 or 0.2 → 0.223 (outside 0.05); p = 0.55 or 0.45 → 0.005 (inside)
    mu = [0.5] * 6
    p = [0.8, 0.8, 0.55, 0.2, 0.2, 0.45]
    adv = [1.0, -1.0, 1.0, -1.0, 1.0, -1.0]
    expected = [0, 1, 1, 0, 1, 1]  # masked only when outside and moved the way A pushes
    grad, metrics = _dppo("dppo-kl", mu, p, adv)
    kl = [a * math.log(a / b) + (1 - a) * math.log((1 - a) / (1 - b)) for a, b in zip(mu, p)]
    assert [k > 0.05 for k in kl] == [True, True, False, True, True, False]
    want = torch.tensor([-(b / a) * m * s / 6 for a, b, m, s in zip(mu, p, expected, adv)], dtype=torch.float64)
    assert torch.allclose(grad, want, rtol=1e-12, atol=0)
    assert metrics["masked_fraction"] == pytest.approx(2 / 6)


def test_dppo_parameters_are_checked_by_name():
    with pytest.raises(ValueError, match="delta_low and delta_high must be > 0"):
        make("dppo-tv", delta_low=0.0)
    with pytest.raises(ValueError, match="preset 'dppo-kl' has no parameter 'eps_low'"):
        make("dppo-kl", eps_low=0.2)


def test_dppo_matches_verls_policy_loss_where_installed():
    core = pytest.importorskip("verl.trainer.ppo.core_algos", reason="verl is not installed here")
    g = torch.Generator().manual_seed(0)
    mu = torch.rand(4, 16, generator=g, dtype=torch.float64) * 0.98 + 0.01
    p = (mu + (torch.rand(4, 16, generator=g, dtype=torch.float64) - 0.5) * 0.6).clamp(0.01, 0.99)
    adv = torch.randn(4, 1, generator=g, dtype=torch.float64).expand(4, 16).contiguous()
    mask = torch.ones(4, 16)

    class Config(dict):
        clip_ratio, clip_ratio_low, clip_ratio_high, global_batch_info = 0.15, 0.15, 0.15, {}
    for name, fn in (("dppo-tv", core.compute_policy_loss_dppo_tv), ("dppo-kl", core.compute_policy_loss_dppo_kl)):
        delta = 0.15 if name == "dppo-tv" else 0.05
        Config.clip_ratio = Config.clip_ratio_low = Config.clip_ratio_high = delta
        theirs, _ = fn(mu.log(), p.log(), adv, mask, "token-mean", Config(clip_ratio_c=20.0))
        batch = SimpleNamespace(sampler_logp=mu.log(), action_mask=mask.bool(), advantage=adv)
        ours, _ = make(name)(SimpleNamespace(logp=p.log()), batch)
        assert float(ours) == pytest.approx(float(theirs), rel=1e-9)
