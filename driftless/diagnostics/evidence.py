"""The per-step diagnostics a correction is chosen by (all over action tokens, detached, floats).

- ``ratio_diagnostics``: Rényi D2, quantiles and tail fractions of the token ratio w = p/q.
- ``eq1_decomposition``: Eq. 1 of [mismatch], per token,

      log p_θ(a)/q(a) = [log p_θ(a) − log p_v(a)]  +  [log p_v(a) − log q(a)]
                         weight movement since v      same-version disagreement

  where v is the version that generated the token and p_v the trainer's forward at v.
- ``head_diagnostics``: how much of q and of p the sampler's top-k head holds, and how often
  the sampled token is inside it.
- ``routing_diagnostics``: a mixture of experts' fourth source of disagreement, the experts the
  sampler and the trainer select for the forward that gives each action token its probability.

The Rényi divergence of order 2 is logged as ``renyi_d2 = log E_q[w²]`` (the plug-in estimate over
the batch's sampled tokens of D2(p‖q) = log Σ_a p(a)²/q(a), [mismatch] Eq. 10): 0 when p = q, and
``exp(renyi_d2)`` is the second moment that bounds the variance of an importance-weighted estimate.
"""

from __future__ import annotations

import torch

from driftless.diagnostics.metrics import LOG_RATIO_CLAMP, kl_k3, masked_mean

RATIO_QUANTILES = {"ratio_p01": 0.01, "ratio_p50": 0.5, "ratio_p99": 0.99}
RATIO_TAILS = {"ratio_frac_gt2": (">", 2.0), "ratio_frac_gt10": (">", 10.0), "ratio_frac_lt0p5": ("<", 0.5)}


def ratio_diagnostics(trainer_logp: torch.Tensor, sampler_logp: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
    """``renyi_d2``, ``ratio_p01/p50/p99`` and the fractions of tokens with w > 2, w > 10, w < 0.5."""
    on = mask.bool()
    log_w = (trainer_logp.detach().double() - sampler_logp.detach().double())[on].clamp(-LOG_RATIO_CLAMP,
                                                                                        LOG_RATIO_CLAMP)
    if log_w.numel() == 0:
        return {"renyi_d2": 0.0, **dict.fromkeys(RATIO_QUANTILES, 1.0), **dict.fromkeys(RATIO_TAILS, 0.0)}
    # log mean(w²) = logsumexp(2 log w) − log n: no overflow for large ratios
    count = torch.tensor(float(log_w.numel()), dtype=torch.float64)
    out = {"renyi_d2": float(torch.logsumexp(2 * log_w, 0) - torch.log(count))}  # torch.log: exact under train.reproducible
    w = log_w.exp()
    qs = torch.quantile(w, torch.tensor(list(RATIO_QUANTILES.values()), dtype=w.dtype))
    out.update({name: float(v) for name, v in zip(RATIO_QUANTILES, qs)})
    for name, (op, bound) in RATIO_TAILS.items():
        out[name] = float(((w > bound) if op == ">" else (w < bound)).double().mean())
    return out


def eq1_parts(current_logp: torch.Tensor, version_logp: torch.Tensor, sampler_logp: torch.Tensor):
    """Per token, in float64: (total log p_θ/q, movement log p_θ/p_v, disagreement log p_v/q).

    The differences of float32 log-probabilities are exact in float64, and so is their sum: the
    two parts add up to the total bit for bit."""
    lp, lv, lq = (x.detach().double() for x in (current_logp, version_logp, sampler_logp))
    return lp - lq, lp - lv, lv - lq


def eq1_decomposition(current_logp: torch.Tensor, version_logp: torch.Tensor, sampler_logp: torch.Tensor,
                      mask: torch.Tensor) -> dict[str, float]:
    """``log_ratio_mean``, ``eq1_movement_mean/abs``, ``eq1_disagreement_mean/abs`` over action tokens."""
    total, movement, disagreement = eq1_parts(current_logp, version_logp, sampler_logp)
    m = mask.double()
    return {"log_ratio_mean": masked_mean(total, m),
            "eq1_movement_mean": masked_mean(movement, m), "eq1_movement_abs": masked_mean(movement.abs(), m),
            "eq1_disagreement_mean": masked_mean(disagreement, m),
            "eq1_disagreement_abs": masked_mean(disagreement.abs(), m)}


def head_diagnostics(tokens: torch.Tensor, sampler_topk_ids: torch.Tensor, sampler_topk_logp: torch.Tensor,
                     trainer_head_logp: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
    """``head_mass_q`` (Σ_H q), ``head_mass_p`` (Σ_H p on the same ids), ``in_head_fraction`` (sampled token ∈ H).

    ``trainer_head_logp`` may hold fewer ids than the sampler recorded (the trainer's head_k): the head
    is then its first k entries on both sides."""
    k = trainer_head_logp.shape[-1]
    ids, logq = sampler_topk_ids[..., :k], sampler_topk_logp[..., :k]
    m = mask.double()
    in_head = (ids == tokens[..., None]).any(-1)
    return {"head_mass_q": masked_mean(logq.double().exp().sum(-1), m),
            "head_mass_p": masked_mean(trainer_head_logp.detach().double().exp().sum(-1), m),
            "in_head_fraction": masked_mean(in_head.double(), m)}


def age_diagnostics(ages: torch.Tensor) -> dict[str, float]:
    """``sampler_age_p50`` and ``sampler_age_max`` (versions) of action tokens' ages."""
    if ages.numel() == 0:
        return {"sampler_age_p50": 0.0, "sampler_age_max": 0}
    return {"sampler_age_p50": float(ages.double().quantile(0.5)), "sampler_age_max": int(ages.max())}


def routing_diagnostics(sampler_routes: torch.Tensor, trainer_routes: torch.Tensor, trainer_logp: torch.Tensor,
                        sampler_logp: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
    """Expert selection, sampler against trainer, at the input position whose forward scores each action
    token (position j − 1 for the token at j; both routes ``[B, L, layers, k]``):

    - ``routing_set_disagreement``: token-layers whose expert *sets* differ (and ``…_layer{i}`` per layer);
    - ``routing_order_only``: token-layers with the same set in another order (harmless to the output up
      to the order of a sum; counted apart);
    - ``routing_token_any``: action tokens with a different set in at least one layer;
    - ``routing_layers_per_token``: layers with a different set, per action token;
    - ``kl_k3_routed_alike`` / ``kl_k3_routed_apart``: KL(q‖p) (k3) over the tokens routed alike in every
      layer / differently in some, with ``routing_alike_fraction`` the first set's share."""
    on = mask[:, 1:].bool()  # the token at j+1 is scored by the forward at input position j
    sampler, trainer = sampler_routes[:, :-1][on].long(), trainer_routes[:, :-1][on].long()  # [N, layers, k]
    out: dict[str, float] = {}
    if sampler.numel() == 0:
        return out
    same_set = (sampler.sort(-1).values == trainer.sort(-1).values).all(-1)  # [N, layers]
    same_order = (sampler == trainer).all(-1)
    out["routing_set_disagreement"] = float((~same_set).double().mean())
    out["routing_order_only"] = float((same_set & ~same_order).double().mean())
    apart = (~same_set).any(-1)  # [N]
    out["routing_token_any"] = float(apart.double().mean())
    out["routing_layers_per_token"] = float((~same_set).double().sum(-1).mean())
    for i in range(same_set.shape[1]):
        out[f"routing_set_disagreement_layer{i}"] = float((~same_set[:, i]).double().mean())
    # the per-token KL split by routing: tokens placed back in [B, L] masks
    token_apart = torch.zeros_like(mask, dtype=torch.bool)
    token_apart[:, 1:][on] = apart
    alike_mask, apart_mask = mask.bool() & ~token_apart, mask.bool() & token_apart
    out["routing_alike_fraction"] = float(alike_mask.sum()) / max(int(mask.bool().sum()), 1)
    out["kl_k3_routed_alike"] = kl_k3(trainer_logp, sampler_logp, alike_mask.double())
    out["kl_k3_routed_apart"] = kl_k3(trainer_logp, sampler_logp, apart_mask.double())
    return out
