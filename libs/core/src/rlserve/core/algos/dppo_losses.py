"""DPPO (Qi et al. 2026, "Rethinking the Trust Region in LLM Reinforcement Learning",
arXiv:2602.04879): a trust region on the sampled token's probability rather than on its
ratio, measured by total variation (DPPO-TV) or by binary KL (DPPO-KL)."""

from __future__ import annotations

import torch
from torch import Tensor

from rlserve.core.algos.aggregation import aggregate_loss
from rlserve.core.algos.masked import clamped_log_ratio, inside_mask, masked_mean
from rlserve.core.algos.notes import AlgorithmNote
from rlserve.core.algos.policy_loss_registry import register_policy_loss
from rlserve.core.algos.policy_losses import check_policy_inputs, policy_metrics


def _divergence_masked_loss(
    log_probs: Tensor,
    log_ratio: Tensor,
    advantages: Tensor,
    mask: Tensor,
    inside: Tensor,
    max_ratio: float,
    loss_agg_mode: str,
) -> tuple[Tensor, dict[str, Tensor]]:
    """DPPO's shared step: policy gradient weighted by the truncated ratio on the tokens
    ``inside`` the trust region, none elsewhere."""
    ratio = torch.exp(log_ratio)
    # sg[min(ρ, C)]·∇log π = ∇ρ below the cap: the unclipped surrogate's gradient
    weight = torch.clamp(ratio, max=max_ratio).detach()
    score_function = torch.exp(log_probs - log_probs.detach())
    kept = inside.to(log_probs.dtype)
    losses = -advantages * weight * kept * score_function
    loss = aggregate_loss(losses, mask, loss_agg_mode)
    outside = masked_mean(1 - kept, mask)
    capped = masked_mean(((ratio > max_ratio) & inside).to(log_probs.dtype), mask)
    return loss, policy_metrics(loss, log_ratio, mask, outside, capped)


def _check_dppo(clip_ratio_low: float, clip_ratio_high: float, dppo_max_ratio: float) -> None:
    if clip_ratio_low < 0 or clip_ratio_high < 0:
        raise ValueError(
            f"DPPO divergence thresholds must be >= 0, got {clip_ratio_low} and {clip_ratio_high}"
        )
    if not dppo_max_ratio > 0:
        raise ValueError(f"dppo_max_ratio must be > 0, got {dppo_max_ratio}")


@register_policy_loss(
    "dppo_tv",
    note=AlgorithmNote(
        "policy gradient only where the token's probability moved less than "
        "clip_ratio_low/high (total variation, default 0.15), ratio capped at "
        "actor.dppo_max_ratio",
        'Qi et al. 2026, "Rethinking the Trust Region in LLM RL", arXiv:2602.04879',
    ),
    default_clip_ratios=(0.15, 0.15),
)
def dppo_tv_loss(
    old_log_probs: Tensor,
    log_probs: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    *,
    clip_ratio_low: float = 0.15,
    clip_ratio_high: float = 0.15,
    dppo_max_ratio: float = 20.0,
    loss_agg_mode: str = "token-mean",
) -> tuple[Tensor, dict[str, Tensor]]:
    """DPPO-Binary-TV: a trust region on the sampled token's probability, not its ratio
    (Qi et al., 2026, "Rethinking the Trust Region in LLM Reinforcement Learning",
    arXiv:2602.04879).

    PPO's ratio clip is loose for likely tokens (p 0.9 → 1.0 is ratio 1.1) and harsh for
    rare ones (p 0.001 → 0.01 is ratio 10). DPPO bounds the change of probability
    itself, the total variation of the binary (token, not token) distribution, on the
    side the advantage pushes::

        inside_t = p_t - p_old,t <= δ_high   where A_t > 0
                   p_t - p_old,t >= -δ_low   otherwise
        L_t = -A_t · sg[min(ρ_t, C)] · ∇log π_θ(y_t) · inside_t    (value -A·sg[min(ρ, C)])

    ``C`` truncates the importance weight (the paper uses it instead of a dual clip;
    keep it large: truncation biases the gradient).

    Args:
        old_log_probs: Log-probs under the sampling policy. Shape: (B, T).
        log_probs: Log-probs under the current policy (with grad). Shape: (B, T).
        advantages: Per-token advantages. Shape: (B, T).
        response_mask: 1 for response tokens. Shape: (B, T).
        clip_ratio_low: δ_low, the most a negative-advantage token's probability may fall.
        clip_ratio_high: δ_high, the most a positive-advantage token's probability may rise.
        dppo_max_ratio: C > 0, the cap on the importance weight.
        loss_agg_mode: See :func:`aggregate_loss`.

    Returns:
        ``(loss, metrics)`` as :func:`policy_loss`; ``"pg_clipfrac"`` is the fraction of
        response tokens outside the trust region, ``"pg_clipfrac_lower"`` of those inside
        whose weight was capped.

    Raises:
        ValueError: On bad shapes, negative thresholds, a cap <= 0, an unknown mode or an
            empty mask.
    """
    check_policy_inputs(old_log_probs, log_probs, advantages, response_mask)
    _check_dppo(clip_ratio_low, clip_ratio_high, dppo_max_ratio)
    mask = response_mask.bool()
    old_log_probs, log_probs, advantages = inside_mask(mask, old_log_probs, log_probs, advantages)
    log_ratio = clamped_log_ratio(log_probs, old_log_probs)
    change = (torch.exp(log_probs) - torch.exp(old_log_probs)).detach()
    inside = torch.where(advantages > 0, change <= clip_ratio_high, change >= -clip_ratio_low)
    return _divergence_masked_loss(
        log_probs, log_ratio, advantages, mask, inside, dppo_max_ratio, loss_agg_mode
    )


@register_policy_loss(
    "dppo_kl",
    note=AlgorithmNote(
        "dppo_tv with the binary KL of the token's probability as the trust region (default 0.05)",
        'Qi et al. 2026, "Rethinking the Trust Region in LLM RL", arXiv:2602.04879',
    ),
    default_clip_ratios=(0.05, 0.05),
)
def dppo_kl_loss(
    old_log_probs: Tensor,
    log_probs: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    *,
    clip_ratio_low: float = 0.05,
    clip_ratio_high: float = 0.05,
    dppo_max_ratio: float = 20.0,
    loss_agg_mode: str = "token-mean",
) -> tuple[Tensor, dict[str, Tensor]]:
    """DPPO-Binary-KL (Qi et al., 2026, arXiv:2602.04879): :func:`dppo_tv_loss` with the
    KL divergence of the binary distributions (p_old, 1 - p_old) ‖ (p, 1 - p) as the
    trust region::

        D_t = p_old·log(p_old/p) + (1 - p_old)·log((1 - p_old)/(1 - p))
        inside_t = D_t <= δ_high or p <= p_old   where A_t > 0
                   D_t <= δ_low  or p >= p_old   otherwise

    A token moving against its advantage's push stays inside whatever its divergence
    (the update would bring it back). The default δ = 0.05 is rlserve's: by Pinsker's
    inequality a TV of 0.15 (the paper's DPPO-TV threshold) is a binary KL of at least
    2·0.15² = 0.045.

    Args:
        old_log_probs: Log-probs under the sampling policy. Shape: (B, T).
        log_probs: Log-probs under the current policy (with grad). Shape: (B, T).
        advantages: Per-token advantages. Shape: (B, T).
        response_mask: 1 for response tokens. Shape: (B, T).
        clip_ratio_low: δ_low, the divergence allowed to a negative-advantage token.
        clip_ratio_high: δ_high, the divergence allowed to a positive-advantage token.
        dppo_max_ratio: C > 0, the cap on the importance weight.
        loss_agg_mode: See :func:`aggregate_loss`.

    Returns:
        ``(loss, metrics)`` as :func:`dppo_tv_loss`.

    Raises:
        ValueError: On bad shapes, negative thresholds, a cap <= 0, an unknown mode or an
            empty mask.
    """
    check_policy_inputs(old_log_probs, log_probs, advantages, response_mask)
    _check_dppo(clip_ratio_low, clip_ratio_high, dppo_max_ratio)
    mask = response_mask.bool()
    old_log_probs, log_probs, advantages = inside_mask(mask, old_log_probs, log_probs, advantages)
    log_ratio = clamped_log_ratio(log_probs, old_log_probs)
    new_logprob = log_probs.detach()
    p_old, p = torch.exp(old_log_probs), torch.exp(new_logprob)
    # the 1e-8 keeps log(1 - p) finite for a token of probability 1
    divergence = p_old * (old_log_probs - new_logprob) + (1 - p_old) * (
        torch.log(1 - p_old + 1e-8) - torch.log(1 - p + 1e-8)
    )
    inside = torch.where(
        advantages > 0,
        (divergence <= clip_ratio_high) | (p <= p_old),
        (divergence <= clip_ratio_low) | (p >= p_old),
    )
    return _divergence_masked_loss(
        log_probs, log_ratio, advantages, mask, inside, dppo_max_ratio, loss_agg_mode
    )
