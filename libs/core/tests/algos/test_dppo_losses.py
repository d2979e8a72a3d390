"""Tests for rlserve.core.algos.dppo_losses: DPPO-TV and DPPO-KL.

Tiny tensors whose expected values are worked out by hand in the comments, and
"fast version equals the obvious version" checks against plain Python loops
(the shared mask layouts, prompt groups and references are conftest.py's fixtures).
"""

from __future__ import annotations

import math

import torch

from rlserve.core.algos.dppo_losses import dppo_kl_loss, dppo_tv_loss


def test_dppo_tv_by_hand(close):
    old = torch.log(torch.tensor([[0.5, 0.5, 0.5, 0.1]]))
    new = torch.log(torch.tensor([[0.6, 0.8, 0.2, 0.45]])).requires_grad_()
    adv = torch.tensor([[1.0, 1.0, -1.0, 1.0]])
    mask = torch.ones(1, 4)
    loss, metrics = dppo_tv_loss(
        old, new, adv, mask, clip_ratio_low=0.2, clip_ratio_high=0.2, dppo_max_ratio=4.0
    )
    # changes +0.1 (inside), +0.3 (outside, A > 0), -0.3 (outside, A < 0), +0.35 (outside)
    # only token 0 trains: weight ρ = 1.2 -> loss -1.2 / 4
    close(loss, -0.3)
    close(metrics["pg_clipfrac"], 0.75)
    loss.backward()
    close(new.grad, [[-0.3, 0.0, 0.0, 0.0]])
    # a wider region lets token 3 in; its ratio 4.5 is capped at 4
    loss, metrics = dppo_tv_loss(
        old, new, adv, mask, clip_ratio_low=0.2, clip_ratio_high=0.4, dppo_max_ratio=4.0
    )
    close(loss, (-1.2 - 1.6 - 4.0) / 4)
    close(metrics["pg_clipfrac_lower"], 0.25)


def test_dppo_tv_matches_loop(check_policy_loss):
    low, high, cap = 0.05, 0.08, 1.5

    def ref(old, new, adv, mask):
        losses, grads = [], []
        for o, n, a, m in zip(old, new, adv, mask, strict=True):
            change = math.exp(n) - math.exp(o)
            inside = change <= high if a > 0 else change >= -low
            if not (m and inside):
                losses.append(0.0)
                grads.append(0.0)
                continue
            w = min(math.exp(n - o), cap)
            losses.append(-a * w)
            grads.append(-a * w)
        return losses, grads

    kwargs = {"clip_ratio_low": low, "clip_ratio_high": high, "dppo_max_ratio": cap}
    check_policy_loss(dppo_tv_loss, kwargs, ref, "dppo_tv", probabilities=True)


def ref_binary_kl(p_old, p):
    return p_old * math.log(p_old / p) + (1 - p_old) * math.log((1 - p_old + 1e-8) / (1 - p + 1e-8))


def test_dppo_kl_by_hand(close):
    old = torch.log(torch.tensor([[0.5, 0.5, 0.5]]))
    new = torch.log(torch.tensor([[0.6, 0.9, 0.1]])).requires_grad_()
    adv = torch.tensor([[1.0, 1.0, 1.0]])
    mask = torch.ones(1, 3)
    loss, metrics = dppo_kl_loss(old, new, adv, mask, clip_ratio_low=0.1, clip_ratio_high=0.1)
    # D(0.5‖0.6) ≈ 0.0204 inside; D(0.5‖0.9) ≈ 0.511 outside; p 0.1 < p_old: against
    # the push, inside whatever D (ratio 0.2)
    assert ref_binary_kl(0.5, 0.6) < 0.1 < ref_binary_kl(0.5, 0.9)
    close(loss, (-1.2 - 0.2) / 3)
    close(metrics["pg_clipfrac"], 1 / 3)
    loss.backward()
    close(new.grad, [[-0.4, 0.0, -0.2 / 3]])


def test_dppo_kl_matches_loop(check_policy_loss):
    low, high, cap = 0.01, 0.02, 1.5

    def ref(old, new, adv, mask):
        losses, grads = [], []
        for o, n, a, m in zip(old, new, adv, mask, strict=True):
            if not m:
                losses.append(0.0)
                grads.append(0.0)
                continue
            p_old, p = math.exp(o), math.exp(n)
            d = ref_binary_kl(p_old, p)
            inside = (d <= high or p <= p_old) if a > 0 else (d <= low or p >= p_old)
            w = min(math.exp(n - o), cap) if inside else 0.0
            losses.append(-a * w)
            grads.append(-a * w)
        return losses, grads

    kwargs = {"clip_ratio_low": low, "clip_ratio_high": high, "dppo_max_ratio": cap}
    check_policy_loss(dppo_kl_loss, kwargs, ref, "dppo_kl", probabilities=True)
