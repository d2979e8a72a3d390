"""Tests for rlserve.core.algos.policy_losses: the ratio-based policy losses.

Tiny tensors whose expected values are worked out by hand in the comments, and
"fast version equals the obvious version" checks against plain Python loops
(the shared mask layouts, prompt groups and references are conftest.py's fixtures).
"""

from __future__ import annotations

import math

import pytest
import torch

from rlserve.core.algos.aggregation import LOSS_AGG_MODES, aggregate_loss
from rlserve.core.algos.policy_losses import (
    cispo_loss,
    gmpo_loss,
    gspo_loss,
    policy_loss,
    reinforce_loss,
    sapo_loss,
)

LN2 = math.log(2.0)


def ref_policy_losses(old, new, adv, eps_low, eps_high, dual):
    """Per-token dual-clip PPO loss, one float at a time."""
    ratio = math.exp(new - old)
    loss = max(-adv * ratio, -adv * min(max(ratio, 1 - eps_low), 1 + eps_high))
    if dual is not None and adv < 0:
        loss = min(loss, -adv * dual)
    return loss


def hand_policy_batch():
    # tokens: (A=1, ρ=1.5), (A=-1, ρ=4), (A=-1, ρ=0.5), padding garbage
    old = torch.zeros(1, 4)
    new = torch.tensor([[math.log(1.5), math.log(4.0), math.log(0.5), 50.0]])
    adv = torch.tensor([[1.0, -1.0, -1.0, float("nan")]])
    mask = torch.tensor([[1, 1, 1, 0]])
    return old, new, adv, mask


def test_policy_loss_dual_clip_by_hand(close):
    old, new, adv, mask = hand_policy_batch()
    loss, metrics = policy_loss(old, new, adv, mask, clip_ratio_dual=3.0)
    # token 1: max(-1.5, -1.2) = -1.2            (ε clip active)
    # token 2: max(4, 1.2) = 4 -> min(4, 3) = 3 (dual clip active)
    # token 3: max(0.5, 0.8) = 0.8              (ε clip active)
    # token-mean: (-1.2 + 3 + 0.8) / 3 = 0.866667
    close(loss, 2.6 / 3)
    close(metrics["pg_loss"], 2.6 / 3)
    close(metrics["pg_clipfrac"], 2 / 3)
    close(metrics["pg_clipfrac_lower"], 1 / 3)
    # ppo_kl = mean(old - new) = -(ln 1.5 + ln 4 + ln 0.5) / 3 = -ln 3 / 3
    close(metrics["ppo_kl"], -math.log(3.0) / 3)
    assert all(v.dim() == 0 and not v.requires_grad for v in metrics.values())


def test_policy_loss_without_dual_clip_by_hand(close):
    old, new, adv, mask = hand_policy_batch()
    loss, metrics = policy_loss(old, new, adv, mask, clip_ratio_dual=None)
    # token 2 keeps its loss of 4: (-1.2 + 4 + 0.8) / 3 = 1.2
    close(loss, 1.2)
    close(metrics["pg_clipfrac_lower"], 0.0)


def test_policy_loss_clip_higher_by_hand(close):
    old = torch.zeros(1, 2)
    new = torch.tensor([[math.log(1.25), math.log(1.25)]])
    adv = torch.tensor([[1.0, 2.0]])
    # ε_high = 0.28: ρ = 1.25 is inside the trust region -> loss = -(1.25 + 2.5) / 2
    loss, metrics = policy_loss(old, new, adv, torch.ones(1, 2), clip_ratio_high=0.28)
    close(loss, -1.875)
    close(metrics["pg_clipfrac"], 0.0)
    # ε_high = 0.2 clips at 1.2 -> -(1.2 + 2.4) / 2
    loss, metrics = policy_loss(old, new, adv, torch.ones(1, 2), clip_ratio_high=0.2)
    close(loss, -1.8)
    close(metrics["pg_clipfrac"], 1.0)


def test_policy_loss_gradient_by_hand(close):
    # ρ = 1 and A = 2 on the first token: inside the region, d(-A ρ)/d logp = -A ρ = -2;
    # the second token is clipped (A = 1, ρ = 2 > 1.2): no gradient. Token mean over 2.
    old = torch.zeros(1, 2)
    new = torch.tensor([[0.0, math.log(2.0)]], requires_grad=True)
    adv = torch.tensor([[2.0, 1.0]])
    loss, _ = policy_loss(old, new, adv, torch.ones(1, 2))
    loss.backward()
    close(new.grad, [[-1.0, 0.0]])


def test_policy_loss_matches_loop(all_masks):
    for seed, kind, gen, mask in all_masks():
        old = -torch.rand(mask.shape, generator=gen, dtype=torch.float64) * 3
        new = old + 0.5 * torch.randn(mask.shape, generator=gen, dtype=torch.float64)
        adv = torch.randn(mask.shape, generator=gen, dtype=torch.float64)
        dual = (3.0, None, 1.5)[seed]
        losses = [
            [
                ref_policy_losses(o, n, a, 0.2, 0.28, dual)
                for o, n, a in zip(ro, rn, ra, strict=True)
            ]
            for ro, rn, ra in zip(old.tolist(), new.tolist(), adv.tolist(), strict=True)
        ]
        for mode in LOSS_AGG_MODES:
            loss, metrics = policy_loss(
                old,
                new,
                adv,
                mask,
                clip_ratio_low=0.2,
                clip_ratio_high=0.28,
                clip_ratio_dual=dual,
                loss_agg_mode=mode,
            )
            expected = aggregate_loss(torch.tensor(losses, dtype=torch.float64), mask, mode)
            torch.testing.assert_close(loss, expected, msg=f"{seed} {kind} {mode}")
        # token-level metrics from the loop
        valid = [
            (o, n, a)
            for ro, rn, ra, rm in zip(
                old.tolist(), new.tolist(), adv.tolist(), mask.tolist(), strict=True
            )
            for o, n, a, m in zip(ro, rn, ra, rm, strict=True)
            if m
        ]
        kl = sum(o - n for o, n, _ in valid) / len(valid)
        torch.testing.assert_close(metrics["ppo_kl"], torch.tensor(kl, dtype=torch.float64))


def test_policy_loss_errors():
    x = torch.zeros(2, 3)
    with pytest.raises(ValueError, match=r"clip_ratio_dual must be > 1 \(or None\), got 1.0"):
        policy_loss(x, x, x, torch.ones(2, 3), clip_ratio_dual=1.0)
    with pytest.raises(ValueError, match="clip_ratio_low must be in"):
        policy_loss(x, x, x, torch.ones(2, 3), clip_ratio_low=1.0)
    with pytest.raises(ValueError, match="advantages has shape"):
        policy_loss(x, x, torch.zeros(2, 4), torch.ones(2, 3))
    with pytest.raises(ValueError, match="valid modes"):
        policy_loss(x, x, x, torch.ones(2, 3), loss_agg_mode="sum")


def test_gspo_by_hand(close):
    # sequence 1: log ratios (ln 2, 0) -> s = √2 > 1.2, A = 1: clipped at 1.2, no gradient
    # sequence 2: log ratios (0.1, -0.1) -> s = 1, A = -1: loss 1 per token
    old = torch.zeros(2, 3)
    new = torch.tensor([[LN2, 0.0, 7.0], [0.1, -0.1, 7.0]], requires_grad=True)
    adv = torch.tensor([[1.0, 1.0, 0.0], [-1.0, -1.0, 0.0]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 0]])
    loss, metrics = gspo_loss(old, new, adv, mask, clip_ratio_low=0.2, clip_ratio_high=0.2)
    # seq-mean-token-mean: (-1.2 + 1) / 2
    close(loss, -0.1)
    close(metrics["pg_clipfrac"], 0.5)
    loss.backward()
    # sequence 2: d(-A·s_{i,t})/d log π_t = s_i = 1, weight 1 / (2 sequences × 2 tokens)
    close(new.grad, [[0.0, 0.0, 0.0], [0.25, 0.25, 0.0]])


def test_gspo_matches_loop(check_policy_loss):
    eps_low, eps_high = 0.05, 0.08

    def ref(old, new, adv, mask):
        valid = [n - o for o, n, m in zip(old, new, mask, strict=True) if m]
        s = math.exp(sum(valid) / len(valid)) if valid else 1.0
        losses, grads = [], []
        for a, m in zip(adv, mask, strict=True):
            if not m:
                losses.append(0.0)
                grads.append(0.0)
                continue
            clipped = min(max(s, 1 - eps_low), 1 + eps_high)
            losses.append(max(-a * s, -a * clipped))
            # gradient only through the unclipped branch: -A · s · ∇log π_t
            grads.append(-a * s if -a * s >= -a * clipped else 0.0)
        return losses, grads

    check_policy_loss(
        gspo_loss, {"clip_ratio_low": eps_low, "clip_ratio_high": eps_high}, ref, "gspo"
    )


def test_cispo_by_hand(close):
    old = torch.zeros(1, 4)
    new = torch.tensor(
        [[math.log(1.5), math.log(0.5), math.log(1.1), float("nan")]], requires_grad=True
    )
    adv = torch.tensor([[1.0, -1.0, 2.0, float("inf")]])
    mask = torch.tensor([[1, 1, 1, 0]])
    loss, metrics = cispo_loss(old, new, adv, mask)
    # weights clip(ρ, 0.8, 1.2) = (1.2, 0.8, 1.1); values -ŵ·A = (-1.2, 0.8, -2.2)
    close(loss, -2.6 / 3)
    close(metrics["pg_clipfrac"], 2 / 3)
    loss.backward()
    # every token keeps a gradient, -ŵ·A / 3, even the clipped ones
    close(new.grad, [[-0.4, 0.8 / 3, -2.2 / 3, 0.0]])


def test_cispo_matches_loop(check_policy_loss):
    def ref(old, new, adv, mask):
        losses, grads = [], []
        for o, n, a, m in zip(old, new, adv, mask, strict=True):
            if not m:
                losses.append(0.0)
                grads.append(0.0)
                continue
            w = min(max(math.exp(n - o), 0.8), 1.25)
            losses.append(-w * a)
            grads.append(-w * a)
        return losses, grads

    check_policy_loss(cispo_loss, {"clip_ratio_low": 0.2, "clip_ratio_high": 0.25}, ref, "cispo")


def test_gmpo_by_hand(close):
    # both sequences: token log ratios (ln 2, -ln 2); ε = 0.2 -> log bounds ln 0.8, ln 1.2
    old = torch.zeros(2, 2)
    new = torch.tensor([[LN2, -LN2], [LN2, -LN2]], requires_grad=True)
    adv = torch.tensor([[1.0, 1.0], [-1.0, -1.0]])
    mask = torch.ones(2, 2)
    loss, metrics = gmpo_loss(old, new, adv, mask, clip_ratio_low=0.2, clip_ratio_high=0.2)
    # A > 0: min(x, clip x) = (ln 1.2, -ln 2) -> r = √(1.2 · 0.5) = √0.6
    # A < 0: max(x, clip x) = (ln 2, ln 0.8) -> r = √(2 · 0.8) = √1.6
    # seq-mean-token-mean: (-√0.6 + √1.6) / 2
    close(loss, (-math.sqrt(0.6) + math.sqrt(1.6)) / 2)
    # clip active: sequence 1 token 1 (above), sequence 2 token 2 (below)
    close(metrics["pg_clipfrac"], 0.5)
    loss.backward()
    # d/d log π_t of -A·r (weight 1/4 per token, 2 tokens): -A·r/2 · 2 · 1/4 where unclipped
    close(new.grad, [[0.0, -math.sqrt(0.6) / 4], [math.sqrt(1.6) / 4, 0.0]])


def test_gmpo_matches_loop(check_policy_loss):
    eps_low, eps_high = 0.2, 0.3
    low, high = math.log(1 - eps_low), math.log(1 + eps_high)

    def seq_ratio(xs, sign):
        picked = [
            min(x, min(max(x, low), high)) if sign > 0 else max(x, min(max(x, low), high))
            for x in xs
        ]
        return math.exp(sum(picked) / len(picked)) if picked else 1.0

    def ref(old, new, adv, mask):
        tokens = [(n - o, a) for o, n, a, m in zip(old, new, adv, mask, strict=True) if m]
        xs = [x for x, _ in tokens]
        ratios = {1: seq_ratio(xs, 1), -1: seq_ratio(xs, -1)}
        losses, grads = [], []
        for o, n, a, m in zip(old, new, adv, mask, strict=True):
            if not m:
                losses.append(0.0)
                grads.append(0.0)
                continue
            x = n - o
            losses.append(-a * ratios[1 if a > 0 else -1])
            # every token's loss -A'·r of this row moves with x, unless x is clipped on
            # that token's side: d r / d x = r / |y|
            total = 0.0
            for _, a2 in tokens:
                sign = 1 if a2 > 0 else -1
                clipped = x > high if sign > 0 else x < low
                total += 0.0 if clipped else -a2 * ratios[sign] / len(xs)
            grads.append(total)
        return losses, grads

    check_policy_loss(
        gmpo_loss, {"clip_ratio_low": eps_low, "clip_ratio_high": eps_high}, ref, "gmpo"
    )


def test_reinforce_by_hand(close):
    old = torch.zeros(1, 3)
    new = torch.tensor([[LN2, -LN2, float("nan")]], requires_grad=True)
    adv = torch.tensor([[1.0, -1.0, float("nan")]])
    mask = torch.tensor([[1, 1, 0]])
    loss, metrics = reinforce_loss(old, new, adv, mask)
    # -A·ρ = (-2, 0.5), no clip -> -0.75; gradient -A·ρ / 2 = (-1, 0.25)
    close(loss, -0.75)
    close(metrics["pg_clipfrac"], 0.0)
    loss.backward()
    close(new.grad, [[-1.0, 0.25, 0.0]])


def test_reinforce_matches_loop(check_policy_loss):
    def ref(old, new, adv, mask):
        values = [
            -a * math.exp(n - o) if m else 0.0
            for o, n, a, m in zip(old, new, adv, mask, strict=True)
        ]
        return values, values  # d(-A·e^{x})/dx = -A·e^{x}

    check_policy_loss(reinforce_loss, {}, ref, "reinforce")


def test_sapo_by_hand(close):
    old = torch.zeros(1, 3)
    new = torch.tensor([[0.0, LN2, float("nan")]], requires_grad=True)
    adv = torch.tensor([[1.0, -1.0, float("nan")]])
    mask = torch.tensor([[1, 1, 0]])
    loss, metrics = sapo_loss(old, new, adv, mask, sapo_tau_pos=1.0, sapo_tau_neg=2.0)
    # token 0: ρ = 1 -> gate (4/1)·σ(0) = 2, loss -2; token 1: ρ = 2, τ 2 -> 2·σ(2), loss +2σ(2)
    sig2 = 1 / (1 + math.exp(-2))
    close(loss, (-2 + 2 * sig2) / 2)
    close(metrics["pg_clipfrac"], 0.0)
    loss.backward()
    # d/d log π = -A·4σ(1-σ)·ρ, weight 1/2: token 0 -> -1·1·1/2; token 1 -> 4σ(2)(1-σ(2))·2/2
    close(new.grad, [[-0.5, 4 * sig2 * (1 - sig2), 0.0]])
    with pytest.raises(ValueError, match="tau"):
        sapo_loss(old, new, adv, mask, sapo_tau_pos=0.0)


def test_sapo_matches_loop(check_policy_loss):
    tau_pos, tau_neg = 1.0, 1.5

    def ref(old, new, adv, mask):
        losses, grads = [], []
        for o, n, a, m in zip(old, new, adv, mask, strict=True):
            if not m:
                losses.append(0.0)
                grads.append(0.0)
                continue
            rho = math.exp(n - o)
            tau = tau_pos if a > 0 else tau_neg
            sig = 1 / (1 + math.exp(-tau * (rho - 1)))
            losses.append(-a * sig * 4 / tau)
            grads.append(-a * 4 * sig * (1 - sig) * rho)
        return losses, grads

    check_policy_loss(sapo_loss, {"sapo_tau_pos": tau_pos, "sapo_tau_neg": tau_neg}, ref, "sapo")
