"""Rollout correction: truncated importance weights from the rollout engine's policy to
the trainer's, for responses the engine sampled with slightly different probabilities
than the trainer computes."""

from __future__ import annotations

import torch
from torch import Tensor

from rlserve.core.algos.masked import (
    check_2d,
    check_same_shape,
    clamped_log_ratio,
    inside_mask,
    masked_mean,
)


@torch.no_grad()
def truncated_is_weights(
    old_log_probs: Tensor, rollout_log_probs: Tensor, response_mask: Tensor, cap: float
) -> tuple[Tensor, dict[str, Tensor]]:
    """Truncated importance weights from the rollout engine's policy to the trainer's
    (Yao et al., 2025, "Your Efficient RL Framework Secretly Brings You Off-Policy RL
    Training", fengyao.notion.site/off-policy-rl; VeRL's token-level "rollout_is").

    The engine that sampled a response (vLLM, or hf generation in another dtype or
    batch layout) computes slightly different probabilities than the trainer's forward:
    the samples come from π_rollout, not π_old. Each token's policy-gradient term is
    weighted by ``w_t = min(π_old(y_t)/π_rollout(y_t), cap)``; the cap bounds the
    variance a rare token could add.

    Args:
        old_log_probs: Log-probs under the trainer's policy at generation time. Shape: (B, T).
        rollout_log_probs: Log-probs the rollout engine reported for the same tokens.
            Shape: (B, T).
        response_mask: 1 for response tokens. Shape: (B, T).
        cap: Largest weight (> 0; VeRL's examples use 2).

    Returns:
        ``(weights, metrics)``: weights Shape: (B, T), 0 outside the mask; metrics
        (0-dim): ``"is_weight_mean"`` (before the cap), ``"capped_fraction"`` (tokens at
        the cap), ``"mismatch_kl"`` (mean of log π_rollout - log π_old over tokens: a
        k1 estimate of KL(π_rollout ‖ π_old) on the engine's own samples).

    Raises:
        ValueError: On bad shapes, a cap <= 0 or an empty mask.
    """
    check_2d("old_log_probs", old_log_probs)
    check_same_shape(
        old_log_probs=old_log_probs,
        rollout_log_probs=rollout_log_probs,
        response_mask=response_mask,
    )
    if not cap > 0:
        raise ValueError(f"cap must be > 0, got {cap}")
    mask = response_mask.bool()
    old_log_probs, rollout_log_probs = inside_mask(mask, old_log_probs, rollout_log_probs)
    log_ratio = clamped_log_ratio(old_log_probs, rollout_log_probs)
    ratio = torch.exp(log_ratio)
    weights = torch.where(mask, torch.clamp(ratio, max=cap), torch.zeros_like(ratio))
    metrics = {
        "is_weight_mean": masked_mean(ratio, mask),
        "capped_fraction": masked_mean((ratio > cap).to(ratio.dtype), mask),
        "mismatch_kl": masked_mean(-log_ratio, mask),
    }
    return weights, metrics
