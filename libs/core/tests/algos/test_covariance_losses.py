"""Tests for rlserve.core.algos.covariance_losses: Clip-Cov and KL-Cov.

Tiny tensors whose expected values are worked out by hand in the comments, and
"fast version equals the obvious version" checks against plain Python loops
(the shared mask layouts, prompt groups and references are conftest.py's fixtures).
"""

from __future__ import annotations

import math

import torch

from rlserve.core.algos.aggregation import aggregate_loss
from rlserve.core.algos.covariance_losses import clip_cov_loss, kl_cov_loss


def cov_batch():
    # A = (1, 1, -1, -1), log π = (-1, -3, -1, -3.5): mean A = 0, mean log π = -2.125
    # Cov = A·(log π + 2.125) = (1.125, -0.875, -1.125, 1.375)
    log_probs = torch.tensor([[-1.0, -3.0, -1.0, -3.5, 0.0]], requires_grad=True)
    adv = torch.tensor([[1.0, 1.0, -1.0, -1.0, float("nan")]])
    mask = torch.tensor([[1, 1, 1, 1, 0]])
    return log_probs, adv, mask


def test_clip_cov_by_hand(close):
    log_probs, adv, mask = cov_batch()
    old = log_probs.detach().clone()  # ρ = 1: the ε clip is inactive
    # eligible: Cov in (1, 5) -> tokens 0 and 3; fraction 0.5 of 4 tokens -> both picked
    loss, metrics = clip_cov_loss(
        old, log_probs, adv, mask, clip_cov_fraction=0.5, clip_cov_low=1.0
    )
    # -A·ρ = (-1, -1, 1, 1) with tokens 0 and 3 zeroed -> token mean 0
    close(loss, 0.0)
    close(metrics["pg_cov_frac"], 0.5)
    loss.backward()
    close(log_probs.grad, [[0.0, -0.25, 0.25, 0.0, 0.0]])
    # fraction 0.25 -> one token, at random among the eligible 0 and 3
    loss, metrics = clip_cov_loss(old, log_probs, adv, mask, clip_cov_fraction=0.25)
    close(metrics["pg_cov_frac"], 0.25)
    assert float(loss.detach()) in (
        0.25,
        -0.25,
    )  # token 0 (-1) or token 3 (+1) left out of (-1-1+1+1)


def test_kl_cov_by_hand(close):
    log_probs, adv, mask = cov_batch()
    old = log_probs.detach() - torch.tensor([[0.1, 0.2, 0.3, 0.4, 0.0]])
    loss, metrics = kl_cov_loss(old, log_probs, adv, mask, kl_cov_fraction=0.25, kl_cov_coef=2.0)
    # top-1 Cov is token 3 (1.375): it pays 2·|0.4|; all pay -A·e^{log ρ}
    values = [-math.exp(0.1), -math.exp(0.2), math.exp(0.3), math.exp(0.4) + 0.8]
    close(loss, sum(values) / 4)
    close(metrics["pg_cov_frac"], 0.25)
    loss.backward()
    close(
        log_probs.grad,
        [[-math.exp(0.1) / 4, -math.exp(0.2) / 4, math.exp(0.3) / 4, (math.exp(0.4) + 2) / 4, 0]],
    )


def ref_covariance(adv, log_probs, mask):
    valid = [
        (a, lp)
        for ra, rl, rm in zip(adv, log_probs, mask, strict=True)
        for a, lp, m in zip(ra, rl, rm, strict=True)
        if m
    ]
    mean_a = sum(a for a, _ in valid) / len(valid)
    mean_l = sum(lp for _, lp in valid) / len(valid)
    return [
        [(a - mean_a) * (lp - mean_l) if m else 0.0 for a, lp, m in zip(ra, rl, rm, strict=True)]
        for ra, rl, rm in zip(adv, log_probs, mask, strict=True)
    ]


def test_clip_cov_matches_loop(close, all_masks, policy_batch):
    fraction, cov_low, cov_high = 0.3, 0.0, 2.0
    for seed, kind, gen, mask in all_masks():
        old, new, adv = policy_batch(gen, mask, spread_=0.3)
        o, n, a, m = old.tolist(), new.detach().tolist(), adv.tolist(), mask.tolist()
        cov = ref_covariance(a, n, m)
        keys = torch.rand(mask.shape, generator=torch.Generator().manual_seed(seed)).tolist()
        losses, eligible = [], []
        for b in range(len(m)):
            losses.append([])
            for t in range(len(m[b])):
                if not m[b][t]:
                    losses[-1].append(0.0)
                    continue
                rho = math.exp(n[b][t] - o[b][t])
                unclipped, clipped = -a[b][t] * rho, -a[b][t] * min(max(rho, 0.8), 1.2)
                losses[-1].append(max(unclipped, clipped))
                if clipped <= unclipped and cov_low < cov[b][t] < cov_high:
                    eligible.append((keys[b][t], b, t))
        k = max(1, math.floor(fraction * sum(map(sum, m))))
        for _, b, t in sorted(eligible, reverse=True)[:k]:
            losses[b][t] = 0.0
        loss, metrics = clip_cov_loss(
            old,
            new,
            adv,
            mask,
            clip_cov_fraction=fraction,
            clip_cov_low=cov_low,
            clip_cov_high=cov_high,
            generator=torch.Generator().manual_seed(seed),
        )
        expected = aggregate_loss(torch.tensor(losses, dtype=torch.float64), mask, "token-mean")
        torch.testing.assert_close(loss, expected, msg=f"{seed} {kind}")
        picked = min(k, len(eligible)) / sum(map(sum, m))
        close(metrics["pg_cov_frac"], picked)


def test_kl_cov_matches_loop(all_masks, policy_batch, ref_loss_and_grad):
    fraction, coef = 0.3, 1.5
    for seed, kind, gen, mask in all_masks():
        old, new, adv = policy_batch(gen, mask)
        o, n, a, m = old.tolist(), new.detach().tolist(), adv.tolist(), mask.tolist()
        cov = ref_covariance(a, n, m)
        k = max(1, math.floor(fraction * sum(map(sum, m))))
        ranked = sorted(
            ((cov[b][t], b, t) for b in range(len(m)) for t in range(len(m[b])) if m[b][t]),
            reverse=True,
        )
        top = {(b, t) for _, b, t in ranked[:k]}
        losses, grads = [], []
        for b in range(len(m)):
            losses.append([])
            grads.append([])
            for t in range(len(m[b])):
                if not m[b][t]:
                    losses[-1].append(0.0)
                    grads[-1].append(0.0)
                    continue
                x = n[b][t] - o[b][t]
                penalty = coef * abs(x) if (b, t) in top else 0.0
                losses[-1].append(-a[b][t] * math.exp(x) + penalty)
                slope = coef * math.copysign(1.0, x) if (b, t) in top else 0.0
                grads[-1].append(-a[b][t] * math.exp(x) + slope)
        for mode in ("token-mean", "seq-mean-token-mean"):
            new.grad = None
            loss, _ = kl_cov_loss(
                old, new, adv, mask, kl_cov_fraction=fraction, kl_cov_coef=coef, loss_agg_mode=mode
            )
            loss.backward()
            value, grad = ref_loss_and_grad(losses, grads, m, mode)
            where = f"{seed} {kind} {mode}"
            torch.testing.assert_close(
                loss.detach(), torch.tensor(value, dtype=torch.float64), msg=where
            )
            torch.testing.assert_close(new.grad, torch.tensor(grad, dtype=torch.float64), msg=where)
