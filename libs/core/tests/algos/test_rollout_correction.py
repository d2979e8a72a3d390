"""Tests for rlserve.core.algos.rollout_correction: truncated importance
weights.

Tiny tensors whose expected values are worked out by hand in the comments, and
"fast version equals the obvious version" checks against plain Python loops
(the shared mask layouts, prompt groups and references are conftest.py's fixtures).
"""

from __future__ import annotations

import math

import pytest
import torch

from rlserve.core.algos.rollout_correction import truncated_is_weights

LN2 = math.log(2.0)


def test_truncated_is_weights_by_hand(close):
    old = torch.tensor([[math.log(0.5), math.log(0.9), 0.0]])
    rollout = torch.tensor([[math.log(0.25), math.log(0.9), float("nan")]])
    mask = torch.tensor([[1, 1, 0]])
    weights, metrics = truncated_is_weights(old, rollout, mask, cap=1.5)
    # ratios 2 (capped at 1.5) and 1; padding 0
    close(weights, [[1.5, 1.0, 0.0]])
    close(metrics["is_weight_mean"], 1.5)
    close(metrics["capped_fraction"], 0.5)
    close(metrics["mismatch_kl"], -LN2 / 2)
    with pytest.raises(ValueError, match="cap"):
        truncated_is_weights(old, rollout, mask, cap=0.0)


def test_truncated_is_weights_match_loop(all_masks, policy_batch):
    for seed, kind, gen, mask in all_masks():
        old, rollout, _ = policy_batch(gen, mask)
        weights, _ = truncated_is_weights(old, rollout, mask, cap=1.3)
        expected = [
            [min(math.exp(o - r), 1.3) if m else 0.0 for o, r, m in zip(ro, rr, rm, strict=True)]
            for ro, rr, rm in zip(
                old.tolist(), rollout.detach().tolist(), mask.tolist(), strict=True
            )
        ]
        torch.testing.assert_close(
            weights, torch.tensor(expected, dtype=torch.float64), msg=f"seed={seed} {kind}"
        )
