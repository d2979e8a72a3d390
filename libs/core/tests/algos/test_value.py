"""Tests for rlserve.core.algos.value: the clipped value loss.

Tiny tensors whose expected values are worked out by hand in the comments, and
"fast version equals the obvious version" checks against plain Python loops
(the shared mask layouts, prompt groups and references are conftest.py's fixtures).
"""

from __future__ import annotations

import pytest
import torch

from rlserve.core.algos.aggregation import LOSS_AGG_MODES, aggregate_loss
from rlserve.core.algos.masked import masked_mean
from rlserve.core.algos.value import value_loss


def test_value_loss_by_hand(close):
    values = torch.tensor([[1.0, 2.0, 50.0]], requires_grad=True)
    old_values = torch.tensor([[0.0, 1.9, 0.0]])
    returns = torch.tensor([[1.0, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 0]])
    loss, metrics = value_loss(values, old_values, returns, mask, clip_range=0.2)
    # token 1: clip(1, -0.2, 0.2) = 0.2; errors (1-1)² = 0 and (0.2-1)² = 0.64 -> 0.64
    # token 2: clip(2, 1.7, 2.1) = 2; both errors 4 -> 4 (not counted as clipped)
    # 0.5 * token-mean = 0.5 * (0.64 + 4) / 2 = 1.16
    close(loss, 1.16)
    close(metrics["vf_loss"], 1.16)
    close(metrics["vf_clipfrac"], 0.5)
    loss.backward()
    # token 1 takes the clipped branch (constant in V): 0; token 2: 0.5 * 2 * (2 - 0) / 2 = 1
    close(values.grad, [[0.0, 1.0, 0.0]])


def test_value_loss_matches_loop(all_masks):
    for seed, kind, gen, mask in all_masks():
        old_values = torch.randn(mask.shape, generator=gen, dtype=torch.float64)
        values = old_values + 0.5 * torch.randn(mask.shape, generator=gen, dtype=torch.float64)
        returns = torch.randn(mask.shape, generator=gen, dtype=torch.float64)
        eps = (0.2, 0.5, 0.0)[seed]
        losses, clipped = [], []
        for rv, ro, rr in zip(values.tolist(), old_values.tolist(), returns.tolist(), strict=True):
            losses.append([])
            clipped.append([])
            for v, o, r in zip(rv, ro, rr, strict=True):
                vc = min(max(v, o - eps), o + eps)
                losses[-1].append(max((v - r) ** 2, (vc - r) ** 2))
                clipped[-1].append(float((vc - r) ** 2 > (v - r) ** 2))
        for mode in LOSS_AGG_MODES:
            loss, metrics = value_loss(
                values, old_values, returns, mask, clip_range=eps, loss_agg_mode=mode
            )
            expected = 0.5 * aggregate_loss(torch.tensor(losses, dtype=torch.float64), mask, mode)
            torch.testing.assert_close(loss, expected, msg=f"{seed} {kind} {mode}")
        frac = masked_mean(torch.tensor(clipped, dtype=torch.float64), mask)
        torch.testing.assert_close(metrics["vf_clipfrac"], frac)


def test_value_loss_errors():
    x = torch.zeros(2, 3)
    with pytest.raises(ValueError, match="clip_range must be >= 0"):
        value_loss(x, x, x, torch.ones(2, 3), clip_range=-0.1)
    with pytest.raises(ValueError, match="returns has shape"):
        value_loss(x, x, torch.zeros(3, 3), torch.ones(2, 3))
