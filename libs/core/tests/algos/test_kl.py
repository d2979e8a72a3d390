"""Tests for rlserve.core.algos.kl: KL estimators, the KL-in-reward
penalty and its metrics, KL controllers, the KL loss.

Tiny tensors whose expected values are worked out by hand in the comments, and
"fast version equals the obvious version" checks against plain Python loops
(the shared mask layouts, prompt groups and references are conftest.py's fixtures).
"""

from __future__ import annotations

import math

import pytest
import torch

from rlserve.core.algos.kl import (
    AdaptiveKLController,
    FixedKLController,
    kl_loss,
    kl_metrics,
    kl_penalty,
    token_rewards_with_kl_penalty,
)

LN2 = math.log(2.0)


# log_probs = ln 0.5, ref = ln 0.25 -> log_ratio = ln 2; and the reverse -> -ln 2.
# k1 = ±ln 2; k2 = 0.5 ln²2 = 0.240227; abs = ln 2;
# k3 = exp(-lr) + lr - 1: lr = ln2 -> 0.5 + 0.693147 - 1 = 0.193147,
#                         lr = -ln2 -> 2 - 0.693147 - 1 = 0.306853.
@pytest.mark.parametrize(
    ("kind", "expected"),
    [
        ("k1", [LN2, -LN2]),
        ("k2", [0.5 * LN2**2, 0.5 * LN2**2]),
        ("mse", [0.5 * LN2**2, 0.5 * LN2**2]),
        ("k3", [0.5 + LN2 - 1, 2 - LN2 - 1]),
        ("low_var_kl", [0.5 + LN2 - 1, 2 - LN2 - 1]),
        ("abs", [LN2, LN2]),
    ],
)
def test_kl_penalty_by_hand(kind, expected, close):
    log_probs = torch.tensor([[math.log(0.5), math.log(0.25)]])
    ref_log_probs = torch.tensor([[math.log(0.25), math.log(0.5)]])
    close(kl_penalty(log_probs, ref_log_probs, kind), [expected])


def test_kl_penalty_k3_is_clamped(close):
    # ref - logp = 15 -> e^15 - 15 - 1 ≈ 3.3e6 -> clamped to 10;
    # ref - logp = -30 -> log-ratio clamped to -20 -> e^-20 + 20 - 1 ≈ 19 -> 10.
    log_probs = torch.tensor([[0.0, 0.0]])
    ref_log_probs = torch.tensor([[15.0, -30.0]])
    close(kl_penalty(log_probs, ref_log_probs, "k3"), [[10.0, 10.0]])


def test_kl_penalty_errors():
    x = torch.zeros(2, 3)
    with pytest.raises(ValueError, match=r"valid kinds: k1, kl, k2, mse, k3, low_var_kl, abs, k1+"):
        kl_penalty(x, x, "k4")
    with pytest.raises(ValueError, match="ref_log_probs has shape"):
        kl_penalty(x, torch.zeros(2, 4), "k1")


def test_kl_name_and_straight_through_by_hand(close):
    # one token with log π/π_ref = ln 2
    log_probs = torch.tensor([[LN2]], requires_grad=True)
    ref = torch.zeros(1, 1)
    close(kl_penalty(log_probs, ref, "kl"), [[LN2]])  # VeRL's name for k1
    expected_values = {"k1+": LN2, "k3+": 0.5 + LN2 - 1, "low_var_kl+": 0.5 + LN2 - 1}
    for kind, value in expected_values.items():
        log_probs.grad = None
        out = kl_penalty(log_probs, ref, kind)
        close(out.detach(), [[value]])
        out.sum().backward()
        # gradient of k2 = 0.5·x²: x = ln 2 (k1's would be 1, k3's 1 - 1/2)
        close(log_probs.grad, [[LN2]])


def test_straight_through_kl_matches_loop(all_masks):
    for seed, kind, gen, mask in all_masks():
        ref = -torch.rand(mask.shape, generator=gen, dtype=torch.float64) * 3
        log_probs = (
            ref + torch.randn(mask.shape, generator=gen, dtype=torch.float64)
        ).requires_grad_()
        for st_kind in ("k1+", "k3+", "low_var_kl+"):
            log_probs.grad = None
            out = kl_penalty(log_probs, ref, st_kind)
            values, grads = [], []
            for rl, rr in zip(log_probs.tolist(), ref.tolist(), strict=True):
                x = [a - b for a, b in zip(rl, rr, strict=True)]
                if st_kind == "k1+":
                    values.append(x)
                else:
                    values.append([min(max(math.exp(-v) + v - 1, -10), 10) for v in x])
                grads.append(x)  # d(0.5·x²)/dx
            msg = f"{seed} {kind} {st_kind}"
            torch.testing.assert_close(
                out.detach(), torch.tensor(values, dtype=torch.float64), msg=msg
            )
            out.sum().backward()
            torch.testing.assert_close(
                log_probs.grad, torch.tensor(grads, dtype=torch.float64), msg=msg
            )


def test_token_rewards_with_kl_penalty_by_hand(close):
    scores = torch.tensor([1.0, 2.0])
    token_kl = torch.tensor([[0.1, 0.2, 0.3], [0.4, 0.5, 0.6]])
    mask = torch.tensor([[1, 1, 0], [0, 1, 1]])  # right-padded, left-padded
    rewards, metrics = token_rewards_with_kl_penalty(scores, token_kl, mask, kl_coef=0.5)
    # row 0: -0.5*0.1, -0.5*0.2 + 1 (last token), 0 (padding)
    # row 1: 0 (padding), -0.5*0.5, -0.5*0.6 + 2 (last token)
    close(rewards, [[-0.05, 0.9, 0.0], [0.0, -0.25, 1.7]])
    # token mean (0.1 + 0.2 + 0.5 + 0.6) / 4; per-sequence sums 0.3 and 1.1 -> mean 0.7;
    # equal lengths, so the sequence mean of token means is the token mean
    close(metrics["kl_token_mean"], 0.35)
    close(metrics["kl_mean"], 0.35)
    close(metrics["kl_seq_sum_mean"], 0.7)
    close(metrics["kl_coef"], 0.5)
    assert all(v.dim() == 0 for v in metrics.values())


def test_token_rewards_with_kl_penalty_matches_loop(all_masks):
    for seed, kind, gen, mask in all_masks():
        batch, length = mask.shape
        scores = torch.randn(batch, generator=gen, dtype=torch.float64)
        token_kl = torch.rand(mask.shape, generator=gen, dtype=torch.float64)
        beta = 0.1 * (seed + 1)
        rewards, _ = token_rewards_with_kl_penalty(scores, token_kl, mask, beta)
        expected = [[0.0] * length for _ in range(batch)]
        for b in range(batch):
            valid = [t for t in range(length) if mask[b, t]]
            for t in valid:
                expected[b][t] = -beta * float(token_kl[b, t])
            if valid:
                expected[b][valid[-1]] += float(scores[b])
        torch.testing.assert_close(
            rewards, torch.tensor(expected, dtype=torch.float64), msg=f"{seed} {kind}"
        )


def test_token_rewards_with_kl_penalty_errors():
    kl, mask = torch.zeros(2, 3), torch.ones(2, 3)
    with pytest.raises(ValueError, match=r"scores must have shape \(B,\) = \(2,\)"):
        token_rewards_with_kl_penalty(torch.zeros(3), kl, mask, 0.1)
    with pytest.raises(ValueError, match="kl_coef must be >= 0"):
        token_rewards_with_kl_penalty(torch.zeros(2), kl, mask, -0.1)
    with pytest.raises(ValueError, match="response_mask has shape"):
        token_rewards_with_kl_penalty(torch.zeros(2), kl, torch.ones(2, 4), 0.1)


def test_kl_metrics_with_uneven_lengths_by_hand(close):
    token_kl = torch.tensor([[0.1, 0.2, 0.3, 0.4], [1.0, 0.0, 0.0, 0.0], [9.0, 9.0, 9.0, 9.0]])
    mask = torch.tensor([[1, 1, 1, 1], [1, 0, 0, 0], [0, 0, 0, 0]])  # 4, 1 and 0 tokens
    metrics = kl_metrics(token_kl, mask)
    # per-sequence means 0.25 and 1.0 (the empty row is left out): (0.25 + 1.0) / 2
    close(metrics["kl_mean"], 0.625)
    # tokens: (0.1 + 0.2 + 0.3 + 0.4 + 1.0) / 5
    close(metrics["kl_token_mean"], 0.4)
    # sums 1.0, 1.0, 0 over 3 sequences
    close(metrics["kl_seq_sum_mean"], 2.0 / 3)


def test_kl_metrics_match_loop(close, all_masks):
    for _seed, _kind, gen, mask in all_masks():
        token_kl = torch.rand(mask.shape, generator=gen, dtype=torch.float64)
        if not bool(mask.any()):
            continue
        per_sequence, tokens = [], []
        for row_kl, row_mask in zip(token_kl.tolist(), mask.tolist(), strict=True):
            kept = [k for k, m in zip(row_kl, row_mask, strict=True) if m]
            tokens += kept
            if kept:
                per_sequence.append(sum(kept) / len(kept))
        metrics = kl_metrics(token_kl, mask)
        close(metrics["kl_mean"], sum(per_sequence) / len(per_sequence))
        close(metrics["kl_token_mean"], sum(tokens) / len(tokens))


def test_fixed_kl_controller():
    ctl = FixedKLController(0.05)
    ctl.update(current_kl=100.0, n_steps=1000)
    assert ctl.value == 0.05
    restored = FixedKLController(1.0)
    restored.load_state_dict(ctl.state_dict())
    assert restored.value == 0.05


def test_adaptive_kl_controller_by_hand():
    ctl = AdaptiveKLController(init_kl_coef=0.1, target_kl=6.0, horizon=10000)
    # KL 9 vs target 6: error 0.5 clipped to 0.2 -> β = 0.1 * (1 + 0.2 * 256 / 10000)
    ctl.update(current_kl=9.0, n_steps=256)
    assert ctl.value == pytest.approx(0.1 * 1.00512)
    # KL 5.4: error -0.1 -> β *= 1 - 0.1 * 100 / 10000 = 0.999
    ctl.update(current_kl=5.4, n_steps=100)
    assert ctl.value == pytest.approx(0.1 * 1.00512 * 0.999)
    # KL 0: error -1 clipped to -0.2 -> β *= 1 - 0.2 * 10000 / 10000 = 0.8
    before = ctl.value
    ctl.update(current_kl=0.0, n_steps=10000)
    assert ctl.value == pytest.approx(before * 0.8)


def test_adaptive_kl_controller_state_round_trip():
    ctl = AdaptiveKLController(0.2, target_kl=1.0, horizon=100)
    ctl.update(2.0, 10)
    state = ctl.state_dict()
    assert state == {"value": pytest.approx(0.2 * 1.02)}
    other = AdaptiveKLController(0.2, target_kl=1.0, horizon=100)
    other.load_state_dict(state)
    assert other.value == ctl.value
    with pytest.raises(ValueError, match="'value' key"):
        other.load_state_dict({"kl_coef": 0.1})


def test_kl_controller_errors():
    with pytest.raises(ValueError, match="kl_coef must be >= 0"):
        FixedKLController(-1.0)
    with pytest.raises(ValueError, match="init_kl_coef must be > 0"):
        AdaptiveKLController(0.0, 1.0, 1.0)
    with pytest.raises(ValueError, match="target_kl must be > 0"):
        AdaptiveKLController(0.1, 0.0, 1.0)
    with pytest.raises(ValueError, match="horizon must be > 0"):
        AdaptiveKLController(0.1, 1.0, 0.0)
    with pytest.raises(ValueError, match="n_steps must be >= 0"):
        AdaptiveKLController(0.1, 1.0, 1.0).update(1.0, -1)


def test_kl_loss_by_hand(close):
    log_probs = torch.tensor([[math.log(0.5), math.log(0.25), 7.0]], requires_grad=True)
    ref_log_probs = torch.tensor([[math.log(0.25), math.log(0.5), 0.0]])
    mask = torch.tensor([[1, 1, 0]])
    loss, metrics = kl_loss(log_probs, ref_log_probs, mask, kind="k3")
    # token mean of the two k3 values above: (0.193147 + 0.306853) / 2 = 0.25
    close(loss, 0.25)
    close(metrics["kl_loss"], 0.25)
    loss.backward()
    # d k3 / d logp = 1 - exp(ref - logp): (1 - 0.5, 1 - 2) / 2 tokens; masked -> 0
    close(log_probs.grad, [[0.25, -0.5, 0.0]])


def test_kl_loss_straight_through_gradient_by_hand(close):
    log_probs = torch.tensor([[LN2, 0.5, 9.0]], requires_grad=True)
    ref = torch.zeros(1, 3)
    mask = torch.tensor([[1, 1, 0]])
    loss, _ = kl_loss(log_probs, ref, mask, kind="k3+")
    # value: token mean of k3 = ((0.5 + ln 2 - 1) + (e^-0.5 + 0.5 - 1)) / 2
    close(loss.detach(), ((0.5 + LN2 - 1) + (math.exp(-0.5) - 0.5)) / 2)
    loss.backward()
    # gradient: log-ratio / 2 tokens; nothing for the padding
    close(log_probs.grad, [[LN2 / 2, 0.25, 0.0]])
