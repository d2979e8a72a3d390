"""The critic's clipped value loss."""

from __future__ import annotations

import torch
from torch import Tensor

from rlserve.core.algos.aggregation import aggregate_loss
from rlserve.core.algos.masked import check_2d, check_same_shape, masked_mean


def value_loss(
    values: Tensor,
    old_values: Tensor,
    returns: Tensor,
    response_mask: Tensor,
    *,
    clip_range: float = 0.2,
    loss_agg_mode: str = "token-mean",
) -> tuple[Tensor, dict[str, Tensor]]:
    """Clipped value loss: ``0.5·max((V - R)², (clip(V, V_old ± ε) - R)²)``.

    Args:
        values: Current critic predictions (with grad). Shape: (B, T).
        old_values: Predictions when the batch was made. Shape: (B, T).
        returns: Targets (see :func:`compute_gae_advantages_returns`). Shape: (B, T).
        response_mask: 1 for response tokens. Shape: (B, T).
        clip_range: ε, in value units (>= 0); predictions move at most ε from
            ``old_values`` before the clipped term takes over.
        loss_agg_mode: See :func:`aggregate_loss`.

    Returns:
        ``(loss, metrics)``; ``loss`` Shape: (). ``metrics`` (detached, 0-dim):
        ``"vf_loss"`` (the loss) and ``"vf_clipfrac"`` (fraction of response tokens
        where the clipped term is the larger one).

    Raises:
        ValueError: On bad shapes, a negative ``clip_range``, an unknown mode or an
            empty mask.
    """
    check_2d("values", values)
    check_same_shape(
        values=values, old_values=old_values, returns=returns, response_mask=response_mask
    )
    if clip_range < 0:
        raise ValueError(f"clip_range must be >= 0, got {clip_range}")
    mask = response_mask.bool()
    # keep the new prediction within ε of the one the advantages were computed with
    clipped_values = torch.clamp(values, old_values - clip_range, old_values + clip_range)
    unclipped_error = (values - returns).square()
    clipped_error = (clipped_values - returns).square()
    # pessimistic: the larger error, so clipping never rewards a big jump
    losses = torch.maximum(unclipped_error, clipped_error)
    # the 0.5 makes the gradient (V - R), the usual squared-error convention
    loss = 0.5 * aggregate_loss(losses, mask, loss_agg_mode)
    clipfrac = masked_mean((clipped_error > unclipped_error).to(values.dtype), mask)
    return loss, {"vf_loss": loss.detach(), "vf_clipfrac": clipfrac.detach()}
