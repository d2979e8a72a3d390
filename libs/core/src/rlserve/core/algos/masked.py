"""Shape checks, guards against padding garbage and overflow, and masked statistics:
what every other algos module builds on.

A mask may hold left padding, right padding or gaps, and entries outside it may hold
anything (even inf/nan), so everything here selects with ``torch.where``: a 0 times an
inf outside the mask would be nan, and ``where`` sends no gradient to what it drops.
"""

from __future__ import annotations

import torch
from torch import Tensor

# Log-ratios are clamped to ±20 nats before exp(): e^20 ≈ 5e8 still fits fp16/bf16
# ranges after multiplication by small advantages, and a real policy step never moves
# a token's log-prob that far, so the clamp only guards against overflow.
LOG_RATIO_CLAMP = 20.0


def check_same_shape(**tensors: Tensor) -> None:
    """Raise ValueError unless all named tensors have the same shape."""
    (first_name, first), *rest = tensors.items()
    for name, tensor in rest:
        if tensor.shape != first.shape:
            raise ValueError(
                f"{name} has shape {tuple(tensor.shape)} but {first_name} has shape "
                f"{tuple(first.shape)}; they must be equal"
            )


def check_2d(name: str, tensor: Tensor) -> None:
    if tensor.dim() != 2:
        raise ValueError(f"{name} must have shape (B, T), got {tuple(tensor.shape)}")


def check_unit_interval(name: str, value: float) -> None:
    if not 0.0 <= value <= 1.0:
        raise ValueError(f"{name} must be in [0, 1], got {value}")


def inside_mask(mask: Tensor, *tensors: Tensor) -> tuple[Tensor, ...]:
    """The tensors with 0 outside the mask, so padding garbage reaches neither a value
    nor a gradient (``where`` sends no gradient to the entries it drops)."""
    return tuple(torch.where(mask, t, torch.zeros_like(t)) for t in tensors)


def clamped_log_ratio(log_probs: Tensor, old_log_probs: Tensor) -> Tensor:
    """log ρ = log π_θ - log π_old, clamped so exp() cannot overflow."""
    return torch.clamp(log_probs - old_log_probs, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)


def masked_sum(values: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Sum of ``values`` where ``mask`` is 1.

    Args:
        values: Any shape.
        mask: Same shape as ``values``; 0/1 (bool, int or float).
        dim: Dimension to reduce; ``None`` reduces everything to a 0-dim tensor.

    Returns:
        The masked sum. Shape: ``values.shape`` without ``dim`` (0-dim if ``None``).

    Raises:
        ValueError: If shapes differ.
    """
    check_same_shape(values=values, mask=mask)
    # where() rather than multiply: 0 * inf would be nan for garbage outside the mask
    selected = torch.where(mask.bool(), values, torch.zeros_like(values))
    return selected.sum() if dim is None else selected.sum(dim=dim)


def masked_mean(values: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Mean of ``values`` over the entries where ``mask`` is 1.

    Args:
        values: Any shape.
        mask: Same shape as ``values``; 0/1 (bool, int or float).
        dim: Dimension to reduce; ``None`` reduces everything to a 0-dim tensor.

    Returns:
        The masked mean. Shape: ``values.shape`` without ``dim`` (0-dim if ``None``).
        With ``dim`` given, a slice with no valid entry has mean 0 (e.g. a padding row).

    Raises:
        ValueError: If shapes differ, or ``dim`` is ``None`` and the mask is all zero.
    """
    total = masked_sum(values, mask, dim)
    if dim is None:
        count = mask.bool().sum()
        if not bool(count > 0):
            raise ValueError("masked_mean: the mask is all zero, the mean is undefined")
        # plain mean over the valid entries
        return total / count
    count = mask.bool().sum(dim=dim)
    # clamp the count so empty slices give 0 / 1 = 0 instead of nan
    return total / count.clamp(min=1)


def masked_var(values: Tensor, mask: Tensor, unbiased: bool = True) -> Tensor:
    """Variance of ``values`` over all entries where ``mask`` is 1.

    Args:
        values: Any shape.
        mask: Same shape as ``values``; 0/1 (bool, int or float).
        unbiased: Apply Bessel's correction (divide by n - 1 instead of n).

    Returns:
        The masked variance. Shape: () (0-dim).

    Raises:
        ValueError: If shapes differ, or fewer than 2 (unbiased) / 1 valid entries.
    """
    check_same_shape(values=values, mask=mask)
    count = mask.bool().sum()
    needed = 2 if unbiased else 1
    if not bool(count >= needed):
        raise ValueError(
            f"masked_var: needs at least {needed} valid entries "
            f"({'unbiased' if unbiased else 'biased'}), the mask has {int(count)}"
        )
    mean = masked_mean(values, mask)
    # squared deviations from the masked mean, summed over valid entries only
    sum_sq = masked_sum((values - mean) ** 2, mask)
    # Bessel's correction: n - 1 degrees of freedom remain after estimating the mean
    return sum_sq / (count - 1 if unbiased else count)


def masked_whiten(
    values: Tensor, mask: Tensor, shift_mean: bool = True, eps: float = 1e-8
) -> Tensor:
    """Normalise ``values`` to unit variance (and zero mean) over the mask.

    Args:
        values: Any shape.
        mask: Same shape as ``values``; 0/1 (bool, int or float).
        shift_mean: If False, the masked mean is added back (only the scale changes).
        eps: Added to the variance before the square root.

    Returns:
        Whitened values, 0 outside the mask. Shape: ``values.shape``.

    Raises:
        ValueError: If shapes differ or the mask has fewer than 2 valid entries.
    """
    mean = masked_mean(values, mask)
    var = masked_var(values, mask, unbiased=True)
    # (x - μ) / σ over the valid entries
    whitened = (values - mean) * torch.rsqrt(var + eps)
    if not shift_mean:
        # keep the original mean, rescale only (used when the sign of the mean matters)
        whitened = whitened + mean
    return torch.where(mask.bool(), whitened, torch.zeros_like(whitened))
