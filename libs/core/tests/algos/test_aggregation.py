"""Tests for rlserve.core.algos.aggregation: entropy, loss aggregation,
mini-batch normalisation.

Tiny tensors whose expected values are worked out by hand in the comments, and
"fast version equals the obvious version" checks against plain Python loops
(the shared mask layouts, prompt groups and references are conftest.py's fixtures).
"""

from __future__ import annotations

import functools
import math

import pytest
import torch

from rlserve.core.algos.aggregation import (
    LOSS_AGG_MODES,
    aggregate_loss,
    entropy_from_logits,
    mini_batch_loss_scale,
)


def test_entropy_by_hand(close):
    # uniform over 4 -> ln 4; one-hot-ish (huge logit gap) -> 0;
    # logits (0, ln 3) -> p = (1/4, 3/4): H = 0.25 ln 4 + 0.75 ln(4/3) = 0.562335
    logits = torch.tensor(
        [
            [
                [0.0, 0.0, 0.0, 0.0],
                [1000.0, 0.0, 0.0, 0.0],
                [0.0, math.log(3.0), -math.inf, -math.inf],
            ]
        ]
    )
    close(entropy_from_logits(logits), [[math.log(4.0), 0.0, 0.562335]])


def test_entropy_stable_for_large_logits_and_matches_loop():
    gen = torch.Generator().manual_seed(0)
    logits = 50.0 * torch.randn(3, 4, 6, generator=gen, dtype=torch.float64) + 1e4
    entropy = entropy_from_logits(logits)
    assert torch.isfinite(entropy).all()
    expected = []
    for row in logits.tolist():
        out_row = []
        for z in row:
            top = max(z)
            weights = [math.exp(v - top) for v in z]
            total = sum(weights)
            out_row.append(-sum(w / total * math.log(w / total) for w in weights if w > 0))
        expected.append(out_row)
    torch.testing.assert_close(entropy, torch.tensor(expected, dtype=torch.float64))


def test_entropy_gradient_finite_with_masked_vocab():
    logits = torch.tensor([[[0.5, -math.inf, 1.0]]], requires_grad=True)
    entropy_from_logits(logits).sum().backward()
    assert torch.isfinite(logits.grad).all()


def test_aggregate_loss_by_hand(close):
    loss = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0], [7.0, 8.0, 9.0]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0], [0, 0, 0]])  # last row: padding only
    # token-mean: (1 + 2 + 4) / 3
    close(aggregate_loss(loss, mask, "token-mean"), 7 / 3)
    # seq sums 3 and 4 -> mean 3.5 (the empty row is not a sequence)
    close(aggregate_loss(loss, mask, "seq-mean-token-sum"), 3.5)
    # seq means 1.5 and 4 -> 2.75
    close(aggregate_loss(loss, mask, "seq-mean-token-mean"), 2.75)
    # token-sum: 1 + 2 + 4
    close(aggregate_loss(loss, mask, "token-sum"), 7.0)
    # Dr. GRPO: seq sums 3 and 4 over T = 3 -> (1 + 4/3) / 2; over a constant 10 -> 0.35
    close(aggregate_loss(loss, mask, "seq-mean-token-sum-norm"), (1 + 4 / 3) / 2)
    close(aggregate_loss(loss, mask, "seq-mean-token-sum-norm", norm_tokens=10), 0.35)


def test_aggregate_loss_matches_loop(all_masks):
    for seed, kind, gen, mask in all_masks():
        loss = torch.randn(mask.shape, generator=gen, dtype=torch.float64)
        rows = [
            [x for x, m in zip(r, mr, strict=True) if m]
            for r, mr in zip(loss.tolist(), mask.tolist(), strict=True)
        ]
        rows = [r for r in rows if r]
        expected = {
            "token-mean": sum(map(sum, rows)) / sum(map(len, rows)),
            "seq-mean-token-sum": sum(sum(r) for r in rows) / len(rows),
            "seq-mean-token-mean": sum(sum(r) / len(r) for r in rows) / len(rows),
            "token-sum": sum(map(sum, rows)),
            # Dr. GRPO: token sums over the constant T (the padded length), mean over rows
            "seq-mean-token-sum-norm": sum(sum(r) / mask.shape[1] for r in rows) / len(rows),
        }
        assert set(expected) == set(LOSS_AGG_MODES)
        for mode, value in expected.items():
            torch.testing.assert_close(
                aggregate_loss(loss, mask, mode),
                torch.tensor(value, dtype=torch.float64),
                msg=f"{seed} {kind} {mode}",
            )


def test_aggregate_loss_errors(close):
    x = torch.ones(2, 3)
    with pytest.raises(
        ValueError, match="valid modes: token-mean, seq-mean-token-sum, seq-mean-token-mean"
    ):
        aggregate_loss(x, x, "seq-sum")
    for mode in LOSS_AGG_MODES:
        if mode == "token-sum":  # a sum over nothing is 0, not undefined
            close(aggregate_loss(x, torch.zeros(2, 3), mode), 0.0)
            continue
        with pytest.raises(ValueError, match="all zero"):
            aggregate_loss(x, torch.zeros(2, 3), mode)
    with pytest.raises(ValueError, match="norm_tokens must be > 0"):
        aggregate_loss(x, x, "seq-mean-token-sum-norm", norm_tokens=0)


def test_mini_batch_loss_scale_by_hand(close):
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])  # 3 tokens, 2 sequences
    scale = functools.partial(mini_batch_loss_scale, mini_batch_tokens=12, mini_batch_sequences=8)
    # 2 ranks × 2 micro-batches average 4 losses: 3/12 of the tokens -> 3/12 · 4 = 1
    close(scale(mask, "token-mean", ranks=2, accumulation_steps=2), 1.0)
    # 2 of 8 sequences, averaged over 4 -> 1
    close(scale(mask, "seq-mean-token-mean", ranks=2, accumulation_steps=2), 1.0)
    close(scale(mask, "seq-mean-token-sum-norm", ranks=1, accumulation_steps=2), 0.5)
    close(scale(mask, "token-sum", ranks=2, accumulation_steps=3), 6.0)
    with pytest.raises(ValueError, match="mini_batch_tokens"):
        mini_batch_loss_scale(
            mask,
            "token-mean",
            mini_batch_tokens=0,
            mini_batch_sequences=1,
            ranks=1,
            accumulation_steps=1,
        )


def test_mini_batch_loss_scale_makes_the_loss_independent_of_the_split(all_masks):
    """Σ over ranks and micro-batches of scale · loss / (ranks · steps), what the engine
    backpropagates, equals the loss of the whole mini-batch, value and gradient."""
    for seed, kind, gen, mask in all_masks(batch=8, length=6):
        if kind == "random_with_empty_row":
            continue  # every row must hold a token
        for mode in LOSS_AGG_MODES:
            for ranks, steps in ((1, 1), (1, 4), (2, 2), (4, 2)):
                values = torch.randn(8, 6, generator=gen, dtype=torch.float64)
                values.requires_grad_()
                whole = aggregate_loss(values, mask, mode)
                (expected_grad,) = torch.autograd.grad(whole, values)
                tokens, sequences = float(mask.sum()), float(mask.any(dim=1).sum())
                rows = 8 // (ranks * steps)
                total = torch.zeros((), dtype=torch.float64)
                for piece in range(ranks * steps):
                    part = slice(piece * rows, (piece + 1) * rows)
                    scale = mini_batch_loss_scale(
                        mask[part],
                        mode,
                        mini_batch_tokens=tokens,
                        mini_batch_sequences=sequences,
                        ranks=ranks,
                        accumulation_steps=steps,
                    )
                    loss = aggregate_loss(values[part], mask[part], mode, norm_tokens=6)
                    total = total + scale * loss / (ranks * steps)
                (grad,) = torch.autograd.grad(total, values)
                where = f"seed={seed} {kind} {mode} ranks={ranks} steps={steps}"
                torch.testing.assert_close(total, whole.detach(), msg=where)
                torch.testing.assert_close(grad, expected_grad, msg=where)
