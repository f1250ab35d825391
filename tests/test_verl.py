"""driftless's sampled-token objectives registered as verl policy losses, against the real verl package.

verl is installed without its heavy dependencies (its algorithm modules need tensordict, omegaconf,
codetiming and orjson only); the registry is verl's own (``register_policy_loss`` / ``get_policy_loss_fn``)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("verl")

from omegaconf import OmegaConf
from verl.trainer.ppo.core_algos import agg_loss, get_policy_loss_fn

from driftless.integrations import verl as plugin
from driftless.objectives import REDUCTIONS, make


def padded_batch(seed=0, rows=6, width=9):
    g = torch.Generator().manual_seed(seed)
    mask = torch.rand(rows, width, generator=g) < 0.7
    mask[2] = False  # a response with no tokens
    log_q = -torch.rand(rows, width, generator=g, dtype=torch.float64) * 3
    log_p = (log_q + 0.3 * torch.randn(rows, width, generator=g, dtype=torch.float64)).clamp(max=0)
    advantages = torch.randn(rows, 1, generator=g, dtype=torch.float64).expand(rows, width)
    return log_q, log_p.requires_grad_(), advantages, mask


def test_the_losses_are_found_by_name_after_verl_loads_its_plugins():
    import importlib.metadata

    names = {ep.name: ep.value for ep in importlib.metadata.entry_points(group="verl.plugins")}
    assert names.get("driftless") == "driftless.integrations.verl"  # verl's own discovery imports the module
    for preset in plugin.PRESETS:
        assert get_policy_loss_fn(f"driftless/{preset}").__name__.startswith("driftless_")


@pytest.mark.parametrize("preset", plugin.PRESETS)
@pytest.mark.parametrize("mode", REDUCTIONS)
def test_each_loss_is_the_objective_on_the_same_tensors(preset, mode):
    log_q, log_p, advantages, mask = padded_batch()
    config = OmegaConf.create({"global_batch_info": {}})
    loss, metrics = get_policy_loss_fn(f"driftless/{preset}")(
        old_log_prob=log_q, log_prob=log_p, advantages=advantages, response_mask=mask, loss_agg_mode=mode,
        config=config)
    batch = {"sampler_logp": torch.where(mask, log_q, 0.0), "anchor_logp": torch.where(mask, log_q, 0.0),
             "action_mask": mask, "advantage": advantages}
    from driftless.objectives.reductions import Totals

    counts = mask.sum(-1)
    nonempty = int((counts > 0).sum())
    totals = Totals(int(counts.sum()), nonempty, nonempty, mask.shape[-1])  # verl counts non-empty sequences
    expected, expected_metrics = make(preset, reduction=mode)({"logp": log_p}, batch, totals=totals)
    assert float(loss) == pytest.approx(float(expected), rel=1e-12, abs=1e-15)
    for key, value in expected_metrics.items():
        assert metrics[f"driftless/{key}"] == pytest.approx(value, rel=1e-12, abs=1e-15), key
    if mode in ("token-mean", "token-sum", "seq-mean-token-sum"):  # the plain reduction, verl's own agg_loss
        lp = log_p.detach()
        surrogate = -advantages * lp if preset == "pg" else None
        if surrogate is not None:
            assert float(agg_loss(surrogate, mask.double(), mode)) == pytest.approx(float(loss), rel=1e-12)


@pytest.mark.parametrize("mode", REDUCTIONS)
def test_two_ranks_shares_of_the_global_batch_info_average_to_the_whole_batchs_gradient(mode):
    """verl's data parallelism averages the ranks' gradients; each rank's loss with global_batch_info is
    scaled so the average is the one-rank gradient of the whole batch (as verl's agg_loss does)."""
    log_q, log_p, advantages, mask = padded_batch(rows=8)
    fn = get_policy_loss_fn("driftless/tis")
    whole, _ = fn(old_log_prob=log_q, log_prob=log_p, advantages=advantages, response_mask=mask, loss_agg_mode=mode,
                  config=OmegaConf.create({"global_batch_info": {}}))
    (grad_whole,) = torch.autograd.grad(whole, log_p)
    counts = mask.sum(-1)
    info = {"dp_size": 2, "batch_num_tokens": int(counts.sum()), "global_batch_size": int((counts > 0).sum()),
            "loss_scale_factor": mask.shape[-1]}
    grads = []
    for rows in (slice(0, 3), slice(3, 8)):
        share, _ = fn(old_log_prob=log_q[rows], log_prob=log_p[rows], advantages=advantages[rows],
                      response_mask=mask[rows], loss_agg_mode=mode, config=OmegaConf.create({"global_batch_info": info}))
        grads.append(torch.autograd.grad(share, log_p)[0])
    averaged = (grads[0] + grads[1]) / 2
    assert torch.allclose(averaged, grad_whole, rtol=1e-12, atol=1e-15)


def test_verls_own_weights_are_refused_not_applied_twice():
    log_q, log_p, advantages, mask = padded_batch()
    with pytest.raises(ValueError, match="turn verl's rollout_is weights off"):
        get_policy_loss_fn("driftless/tis")(old_log_prob=log_q, log_prob=log_p, advantages=advantages,
                                             response_mask=mask, config=OmegaConf.create({}),
                                             rollout_is_weights=torch.ones_like(log_q))
    with pytest.raises(ValueError, match="needs config.global_batch_info"):
        get_policy_loss_fn("driftless/tis")(old_log_prob=log_q, log_prob=log_p, advantages=advantages,
                                             response_mask=mask, loss_agg_mode="token-mean",
                                             config=OmegaConf.create({"global_batch_info": {"dp_size": 2}}))
