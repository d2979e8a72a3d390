"""Tests for rlserve.core.algos.masked: masked statistics.

Tiny tensors whose expected values are worked out by hand in the comments, and
"fast version equals the obvious version" checks against plain Python loops
(the shared mask layouts, prompt groups and references are conftest.py's fixtures).
"""

from __future__ import annotations

import pytest
import torch

from rlserve.core.algos.masked import masked_mean, masked_sum, masked_var, masked_whiten


def test_masked_sum_and_mean_by_hand(close):
    values = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    mask = torch.tensor([[1, 1, 0], [0, 1, 0]])
    # valid: 1, 2, 5 -> sum 8, mean 8/3; per row: sums (3, 5), means (1.5, 5)
    close(masked_sum(values, mask), 8.0)
    close(masked_mean(values, mask), 8.0 / 3.0)
    close(masked_sum(values, mask, dim=1), [3.0, 5.0])
    close(masked_mean(values, mask, dim=1), [1.5, 5.0])
    # per column: (1, 2+5, 0) / (1, 2, 0->1)
    close(masked_mean(values, mask, dim=0), [1.0, 3.5, 0.0])


def test_masked_mean_ignores_garbage_outside_mask(close):
    values = torch.tensor([[1.0, float("inf"), float("nan")], [3.0, -float("inf"), 5.0]])
    mask = torch.tensor([[True, False, False], [True, False, True]])
    # valid: 1, 3, 5 -> mean 3
    close(masked_mean(values, mask), 3.0)


def test_masked_var_by_hand(close):
    values = torch.tensor([1.0, 2.0, 3.0, 100.0])
    mask = torch.tensor([1.0, 1.0, 1.0, 0.0])
    # valid 1, 2, 3: mean 2, squared deviations 1 + 0 + 1 = 2
    close(masked_var(values, mask), 2.0 / 2)  # unbiased: / (3 - 1)
    close(masked_var(values, mask, unbiased=False), 2.0 / 3)


def test_masked_whiten_by_hand(close):
    values = torch.tensor([[1.0, 2.0], [3.0, 9.0]])
    mask = torch.tensor([[1, 1], [1, 0]])
    # valid 1, 2, 3: mean 2, unbiased var 1 -> (-1, 0, 1), and 0 outside the mask
    close(masked_whiten(values, mask), [[-1.0, 0.0], [1.0, 0.0]], atol=1e-6)
    # shift_mean=False keeps the mean: (-1, 0, 1) + 2
    close(masked_whiten(values, mask, shift_mean=False), [[1.0, 2.0], [3.0, 0.0]], atol=1e-6)


def test_masked_statistics_match_loop(all_masks, ref_whiten):
    for seed, kind, gen, mask in all_masks():
        values = torch.randn(mask.shape, generator=gen, dtype=torch.float64)
        values[~mask] = float("nan")  # garbage outside the mask must not leak
        rows, mrows = values.tolist(), mask.tolist()
        valid = [
            x for r, m in zip(rows, mrows, strict=True) for x, v in zip(r, m, strict=True) if v
        ]
        mean = sum(valid) / len(valid)
        var = sum((x - mean) ** 2 for x in valid) / (len(valid) - 1)
        row_means = [
            sum(x for x, v in zip(r, m, strict=True) if v) / max(1, sum(m))
            for r, m in zip(rows, mrows, strict=True)
        ]
        msg = f"seed={seed} kind={kind}"
        torch.testing.assert_close(
            masked_sum(values, mask), torch.tensor(sum(valid), dtype=torch.float64), msg=msg
        )
        torch.testing.assert_close(
            masked_mean(values, mask), torch.tensor(mean, dtype=torch.float64), msg=msg
        )
        torch.testing.assert_close(
            masked_mean(values, mask, dim=1),
            torch.tensor(row_means, dtype=torch.float64),
            msg=msg,
        )
        torch.testing.assert_close(
            masked_var(values, mask), torch.tensor(var, dtype=torch.float64), msg=msg
        )
        torch.testing.assert_close(
            masked_whiten(values, mask),
            torch.tensor(ref_whiten(rows, mrows), dtype=torch.float64),
            msg=msg,
        )


def test_masked_statistics_errors():
    values = torch.ones(2, 3)
    with pytest.raises(ValueError, match=r"mask has shape \(2, 2\) but values has shape \(2, 3\)"):
        masked_mean(values, torch.ones(2, 2))
    with pytest.raises(ValueError, match="all zero"):
        masked_mean(values, torch.zeros(2, 3))
    with pytest.raises(ValueError, match="at least 2 valid entries"):
        masked_var(values, torch.tensor([[1, 0, 0], [0, 0, 0]]))
    with pytest.raises(ValueError, match="at least 1 valid entries"):
        masked_var(values, torch.zeros(2, 3), unbiased=False)
    with pytest.raises(ValueError, match="at least 2 valid entries"):
        masked_whiten(values, torch.tensor([[1, 0, 0], [0, 0, 0]]))
