"""The covariance losses of Cui et al. 2025 ("The Entropy Mechanism of Reinforcement
Learning for Reasoning Language Models", arXiv:2505.22617): Clip-Cov and KL-Cov hold
back the few tokens whose log-prob and advantage co-vary most, where entropy falls."""

from __future__ import annotations

import math

import torch
from torch import Tensor

from rlserve.core.algos.aggregation import aggregate_loss
from rlserve.core.algos.masked import (
    check_unit_interval,
    clamped_log_ratio,
    inside_mask,
    masked_mean,
)
from rlserve.core.algos.notes import AlgorithmNote
from rlserve.core.algos.policy_loss_registry import PPO_CLIP_RATIOS, register_policy_loss
from rlserve.core.algos.policy_losses import (
    check_clip_ratios,
    check_policy_inputs,
    policy_metrics,
)


def _token_covariance(advantages: Tensor, log_probs: Tensor, mask: Tensor) -> Tensor:
    """Per-token centred product ``(A_t - mean A)·(log π_t - mean log π)``, means over
    the response tokens, detached. Shape: (B, T); 0 outside the mask."""
    advantages, log_probs = advantages.detach(), log_probs.detach()
    covariance = (advantages - masked_mean(advantages, mask)) * (
        log_probs - masked_mean(log_probs, mask)
    )
    return torch.where(mask, covariance, torch.zeros_like(covariance))


def _top_k_mask(candidates: Tensor, score: Tensor, k: Tensor) -> Tensor:
    """The (at most) k candidates with the highest score; ties go to the earlier
    position (row-major). Shape: candidates'. No host sync: k may be a tensor."""
    flat_score = torch.where(candidates, score, torch.full_like(score, -math.inf)).flatten()
    order = torch.argsort(flat_score, descending=True, stable=True)
    rank = torch.empty_like(order)
    rank[order] = torch.arange(order.numel(), device=order.device)
    return candidates & (rank.view(candidates.shape) < k)


def _covariance_token_count(mask: Tensor, fraction: float) -> Tensor:
    """max(1, ⌊fraction · response tokens⌋), as a tensor."""
    return torch.clamp(torch.floor(fraction * mask.sum().to(torch.float64)), min=1)


@register_policy_loss(
    "clip_cov",
    note=AlgorithmNote(
        "PPO clip, and a random few tokens with advantage-logprob covariance in "
        "(clip_cov_low, clip_cov_high) get no gradient",
        'Cui et al. 2025, "The Entropy Mechanism of RL for Reasoning LMs", arXiv:2505.22617',
    ),
    default_clip_ratios=PPO_CLIP_RATIOS,
)
def clip_cov_loss(
    old_log_probs: Tensor,
    log_probs: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    *,
    clip_ratio_low: float = 0.2,
    clip_ratio_high: float = 0.2,
    clip_cov_fraction: float = 2e-4,
    clip_cov_low: float = 1.0,
    clip_cov_high: float = 5.0,
    loss_agg_mode: str = "token-mean",
    generator: torch.Generator | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Clip-Cov (Cui et al., 2025, "The Entropy Mechanism of Reinforcement Learning for
    Reasoning Language Models", arXiv:2505.22617).

    Entropy falls where a token's log-prob and advantage co-vary: a likely token with a
    high advantage gets likelier. Clip-Cov takes the PPO clipped loss (:func:`policy_loss`
    without dual clip), computes each token's centred product
    ``Cov_t = (A_t - mean A)·(log π_t - mean log π)`` (means over the batch's response
    tokens), and among the tokens the ε clip left alone whose ``clip_cov_low < Cov_t <
    clip_cov_high`` picks ``max(1, ⌊clip_cov_fraction · N⌋)`` at random (N response tokens). The
    picked tokens' loss is set to 0: no value, no gradient (the paper's "else 0").
    The paper runs it with a wide ε clip; ε here is ``clip_ratio_low/high``.

    Args:
        old_log_probs: Log-probs under the sampling policy. Shape: (B, T).
        log_probs: Log-probs under the current policy (with grad). Shape: (B, T).
        advantages: Per-token advantages. Shape: (B, T).
        response_mask: 1 for response tokens. Shape: (B, T).
        clip_ratio_low: ε_low of the PPO clip.
        clip_ratio_high: ε_high of the PPO clip.
        clip_cov_fraction: Fraction of the response tokens to exclude (the paper's r, 2e-4).
        clip_cov_low: Lower covariance bound ω_low (exclusive).
        clip_cov_high: Upper covariance bound ω_high (exclusive).
        loss_agg_mode: See :func:`aggregate_loss`.
        generator: Random source of the pick; None = torch's global one.

    Returns:
        ``(loss, metrics)`` as :func:`policy_loss`, plus ``"pg_cov_frac"``: the fraction
        of response tokens picked.

    Raises:
        ValueError: On bad shapes or settings, an unknown mode or an empty mask.
    """
    check_policy_inputs(old_log_probs, log_probs, advantages, response_mask)
    check_clip_ratios(clip_ratio_low, clip_ratio_high)
    check_unit_interval("clip_cov_fraction", clip_cov_fraction)
    if not clip_cov_low < clip_cov_high:
        raise ValueError(
            f"clip_cov_low must be < clip_cov_high, got {clip_cov_low} and {clip_cov_high}"
        )
    mask = response_mask.bool()
    old_log_probs, log_probs, advantages = inside_mask(mask, old_log_probs, log_probs, advantages)
    log_ratio = clamped_log_ratio(log_probs, old_log_probs)
    ratio = torch.exp(log_ratio)
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1 - clip_ratio_low, 1 + clip_ratio_high)
    losses = torch.maximum(unclipped, clipped)
    clipped_tokens = mask & (clipped > unclipped)
    covariance = _token_covariance(advantages, log_probs, mask)
    # tokens in the covariance band the ε clip has not already silenced
    eligible = mask & ~clipped_tokens & (covariance > clip_cov_low) & (covariance < clip_cov_high)
    # a uniform random subset: the k eligible tokens with the largest random keys
    keys = torch.rand(mask.shape, generator=generator, device=mask.device)
    picked = _top_k_mask(eligible, keys, _covariance_token_count(mask, clip_cov_fraction))
    losses = torch.where(picked, torch.zeros_like(losses), losses)
    loss = aggregate_loss(losses, mask, loss_agg_mode)
    metrics = policy_metrics(
        loss, log_ratio, mask, masked_mean(clipped_tokens.to(ratio.dtype), mask)
    )
    metrics["pg_cov_frac"] = masked_mean(picked.to(ratio.dtype), mask).detach()
    return loss, metrics


@register_policy_loss(
    "kl_cov",
    note=AlgorithmNote(
        "unclipped surrogate, plus kl_cov_coef·|log ratio| on the top kl_cov_fraction "
        "tokens by advantage-logprob covariance",
        'Cui et al. 2025, "The Entropy Mechanism of RL for Reasoning LMs", arXiv:2505.22617',
    ),
)
def kl_cov_loss(
    old_log_probs: Tensor,
    log_probs: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    *,
    kl_cov_fraction: float = 2e-3,
    kl_cov_coef: float = 1.0,
    loss_agg_mode: str = "token-mean",
) -> tuple[Tensor, dict[str, Tensor]]:
    """KL-Cov (Cui et al., 2025, "The Entropy Mechanism of Reinforcement Learning for
    Reasoning Language Models", arXiv:2505.22617).

    No ratio clip: every token has the plain surrogate ``-A_t·ρ_t``, and the
    ``k = max(1, ⌊kl_cov_fraction · N⌋)`` response tokens with the largest centred product
    ``Cov_t = (A_t - mean A)·(log π_t - mean log π)`` also pay ``β·|log ρ_t|``, a KL
    penalty that holds exactly those tokens near the sampling policy::

        L_t = -A_t·ρ_t + β·|log ρ_t|·[t in top-k by Cov]

    Args:
        old_log_probs: Log-probs under the sampling policy. Shape: (B, T).
        log_probs: Log-probs under the current policy (with grad). Shape: (B, T).
        advantages: Per-token advantages. Shape: (B, T).
        response_mask: 1 for response tokens. Shape: (B, T).
        kl_cov_fraction: Fraction of the response tokens penalised (the paper's k: 2e-3 for
            7B models, 2e-4 for 32B).
        kl_cov_coef: β (>= 0), the paper's 1.
        loss_agg_mode: See :func:`aggregate_loss`.

    Returns:
        ``(loss, metrics)`` as :func:`policy_loss`, plus ``"pg_cov_frac"``: the fraction
        of response tokens penalised.

    Raises:
        ValueError: On bad shapes or settings, an unknown mode or an empty mask.
    """
    check_policy_inputs(old_log_probs, log_probs, advantages, response_mask)
    check_unit_interval("kl_cov_fraction", kl_cov_fraction)
    if kl_cov_coef < 0:
        raise ValueError(f"kl_cov_coef must be >= 0, got {kl_cov_coef}")
    mask = response_mask.bool()
    old_log_probs, log_probs, advantages = inside_mask(mask, old_log_probs, log_probs, advantages)
    log_ratio = clamped_log_ratio(log_probs, old_log_probs)
    covariance = _token_covariance(advantages, log_probs, mask)
    picked = _top_k_mask(mask, covariance, _covariance_token_count(mask, kl_cov_fraction))
    # the plain surrogate, plus β·|log ρ| on the highest-covariance tokens
    penalty = kl_cov_coef * log_ratio.abs()
    losses = -advantages * torch.exp(log_ratio) + torch.where(
        picked, penalty, torch.zeros_like(penalty)
    )
    loss = aggregate_loss(losses, mask, loss_agg_mode)
    metrics = policy_metrics(loss, log_ratio, mask)
    metrics["pg_cov_frac"] = masked_mean(picked.to(log_ratio.dtype), mask).detach()
    return loss, metrics
