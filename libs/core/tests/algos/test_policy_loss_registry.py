"""Tests for rlserve.core.algos.policy_loss_registry: that each entry calls its loss with
the knobs it reads and its default clip range, and keeps padding out of the gradient."""

from __future__ import annotations

import pytest
import torch

from rlserve.core.algos.covariance_losses import clip_cov_loss, kl_cov_loss
from rlserve.core.algos.dppo_losses import dppo_kl_loss, dppo_tv_loss
from rlserve.core.algos.policy_loss_registry import (
    POLICY_LOSSES,
    get_policy_loss,
    resolve_clip_ratios,
)
from rlserve.core.algos.policy_losses import (
    cispo_loss,
    gmpo_loss,
    gspo_loss,
    policy_loss,
    reinforce_loss,
    sapo_loss,
)


def test_new_losses_keep_padding_out_of_gradients(make_mask, policy_batch):
    old, new, adv = policy_batch(
        torch.Generator().manual_seed(0), make_mask("gaps", torch.Generator())
    )
    mask = ~torch.isnan(adv)
    new_garbage = new.detach().clone()
    new_garbage[~mask] = float("inf")
    new_garbage.requires_grad_()
    for name in POLICY_LOSSES:
        new_garbage.grad = None
        loss, metrics = get_policy_loss(name)(old, new_garbage, adv, mask)
        loss.backward()
        assert torch.isfinite(loss), name
        assert torch.isfinite(new_garbage.grad).all(), name
        assert (new_garbage.grad[~mask] == 0).all(), name
        assert all(torch.isfinite(v) for v in metrics.values()), name


def test_policy_loss_registry_passes_each_loss_its_knobs(make_mask, policy_batch):
    gen = torch.Generator().manual_seed(4)
    mask = make_mask("right_padded", gen)
    old, new, adv = policy_batch(gen, mask)
    knobs = {
        "clip_ratio_low": 0.1,
        "clip_ratio_high": 0.15,
        "clip_ratio_dual": 2.0,
        "loss_agg_mode": "seq-mean-token-mean",
        "clip_cov_fraction": 0.3,
        "clip_cov_low": -1.0,
        "clip_cov_high": 3.0,
        "kl_cov_fraction": 0.2,
        "kl_cov_coef": 0.5,
        "sapo_tau_pos": 1.5,
        "sapo_tau_neg": 2.5,
        "dppo_max_ratio": 1.7,
    }
    clip = {"clip_ratio_low": 0.1, "clip_ratio_high": 0.15, "loss_agg_mode": "seq-mean-token-mean"}
    args = (old, new, adv, mask)
    expected = {
        "vanilla": policy_loss(*args, **clip, clip_ratio_dual=2.0),
        "gspo": gspo_loss(*args, **clip),
        "cispo": cispo_loss(*args, **clip),
        "gmpo": gmpo_loss(*args, **clip),
        "reinforce": reinforce_loss(*args, loss_agg_mode="seq-mean-token-mean"),
        "sapo": sapo_loss(
            *args, sapo_tau_pos=1.5, sapo_tau_neg=2.5, loss_agg_mode="seq-mean-token-mean"
        ),
        "clip_cov": clip_cov_loss(
            *args,
            **clip,
            clip_cov_fraction=0.3,
            clip_cov_low=-1.0,
            clip_cov_high=3.0,
            generator=torch.Generator().manual_seed(9),
        ),
        "kl_cov": kl_cov_loss(
            *args, kl_cov_fraction=0.2, kl_cov_coef=0.5, loss_agg_mode="seq-mean-token-mean"
        ),
        "dppo_tv": dppo_tv_loss(*args, **clip, dppo_max_ratio=1.7),
        "dppo_kl": dppo_kl_loss(*args, **clip, dppo_max_ratio=1.7),
    }
    assert list(expected) == list(POLICY_LOSSES)
    for name, (exp_loss, exp_metrics) in expected.items():
        loss, metrics = get_policy_loss(name)(
            *args, knobs, generator=torch.Generator().manual_seed(9)
        )
        torch.testing.assert_close(loss, exp_loss, msg=name)
        assert metrics.keys() == exp_metrics.keys(), name
    with pytest.raises(
        ValueError, match=r"unknown policy loss 'ppo'; valid choices: vanilla, gspo"
    ):
        get_policy_loss("ppo")


def test_new_policy_loss_errors():
    x = torch.zeros(2, 3)
    ones = torch.ones(2, 3)
    for fn in (gspo_loss, cispo_loss, gmpo_loss, clip_cov_loss):
        with pytest.raises(ValueError, match="clip_ratio_low must be in"):
            fn(x, x, x, ones, clip_ratio_low=1.0)
    for name in POLICY_LOSSES:
        with pytest.raises(ValueError, match="advantages has shape"):
            get_policy_loss(name)(x, x, torch.zeros(2, 4), ones)
    with pytest.raises(ValueError, match="clip_cov_low must be < clip_cov_high"):
        clip_cov_loss(x, x, x, ones, clip_cov_low=5.0, clip_cov_high=1.0)
    with pytest.raises(ValueError, match="kl_cov_coef must be >= 0"):
        kl_cov_loss(x, x, x, ones, kl_cov_coef=-1.0)
    with pytest.raises(ValueError, match=r"cov_fraction must be in \[0, 1\]"):
        kl_cov_loss(x, x, x, ones, kl_cov_fraction=2.0)


def test_registry_uses_each_loss_default_clip_range(make_mask, policy_batch):
    gen = torch.Generator().manual_seed(0)
    mask = make_mask("right_padded", gen)
    old, new, adv = policy_batch(gen, mask)
    for name, entry in POLICY_LOSSES.items():
        if entry.default_clip_ratios is None:
            continue  # a loss without a clip has no range of its own
        low, high = entry.default_clip_ratios
        by_default, _ = get_policy_loss(name)(old, new, adv, mask)
        explicit, _ = get_policy_loss(name)(
            old, new, adv, mask, {"clip_ratio_low": low, "clip_ratio_high": high}
        )
        torch.testing.assert_close(by_default, explicit, msg=name)
    assert resolve_clip_ratios("gspo", None, 0.01) == (3e-4, 0.01)
    assert resolve_clip_ratios("sapo", None, None) == (0.2, 0.2)
