"""Tests for rlserve.core.ppo_math.

Two kinds of test per function: tiny tensors whose expected values are worked out by
hand in the comments, and "fast version equals the obvious version" checks against
plain Python loops over several seeds and mask layouts (right padding, left padding,
gaps, random with an empty row) and prompt groups of size 1..4.
"""

from __future__ import annotations

import functools
import math

import pytest
import torch

from rlserve.core import ppo_math as pm

SEEDS = (0, 1, 2)
MASK_KINDS = ("right_padded", "left_padded", "gaps", "random_with_empty_row")
LN2 = math.log(2.0)


# ------------------------------------------------------------------------ helpers


def make_mask(kind: str, gen: torch.Generator, batch: int = 5, length: int = 7) -> torch.Tensor:
    """A (batch, length) bool response mask of the given layout, >= 2 valid tokens."""
    lengths = torch.randint(1, length + 1, (batch,), generator=gen)
    positions = torch.arange(length)[None, :]
    if kind == "right_padded":
        mask = positions < lengths[:, None]
    elif kind == "left_padded":
        mask = positions >= (length - lengths)[:, None]
    elif kind == "gaps":
        # a run of tokens, then a hole (e.g. tool output), then another run
        mask = torch.zeros(batch, length, dtype=torch.bool)
        for row in range(batch):
            start = int(torch.randint(0, 2, (1,), generator=gen))
            hole = int(torch.randint(start + 1, length - 1, (1,), generator=gen))
            mask[row, start:hole] = True
            mask[row, hole + 1 :] = True
    elif kind == "random_with_empty_row":
        mask = torch.rand(batch, length, generator=gen) < 0.6
        mask[0] = False
        mask[1, :2] = True
    else:
        raise AssertionError(kind)
    mask[-1, :2] = True  # at least two valid tokens in the batch, for whitening
    return mask


def all_masks(batch: int = 5, length: int = 7):
    """(seed, kind, generator, mask) for every seed and mask layout."""
    for seed in SEEDS:
        for kind in MASK_KINDS:
            gen = torch.Generator().manual_seed(seed)
            yield seed, kind, gen, make_mask(kind, gen, batch, length)


def make_groups(gen: torch.Generator, num_groups: int = 4) -> torch.Tensor:
    """Shuffled int64 group ids with group sizes 1..4 and arbitrary (non-dense) ids."""
    sizes = torch.randint(1, 5, (num_groups,), generator=gen).tolist()
    sizes[0] = 1  # always a singleton
    ids = [1000 + 7 * g for g, size in enumerate(sizes) for _ in range(size)]
    perm = torch.randperm(len(ids), generator=gen)
    return torch.tensor(ids, dtype=torch.int64)[perm]


def mask_for(batch: int, gen: torch.Generator, length: int = 6) -> torch.Tensor:
    kinds = MASK_KINDS[:3]
    kind = kinds[int(torch.randint(0, len(kinds), (1,), generator=gen))]
    return make_mask(kind, gen, batch, length)


def ref_whiten(rows: list[list[float]], mask: list[list[bool]]) -> list[list[float]]:
    """Plain-loop whitening over all valid entries (unbiased variance, eps 1e-8)."""
    valid = [
        x for row, mrow in zip(rows, mask, strict=True) for x, m in zip(row, mrow, strict=True) if m
    ]
    mean = sum(valid) / len(valid)
    var = sum((x - mean) ** 2 for x in valid) / (len(valid) - 1)
    return [
        [(x - mean) / math.sqrt(var + 1e-8) if m else 0.0 for x, m in zip(row, mrow, strict=True)]
        for row, mrow in zip(rows, mask, strict=True)
    ]


def close(actual, expected, atol: float = 1e-6) -> None:
    expected = torch.as_tensor(expected, dtype=actual.dtype)
    torch.testing.assert_close(actual, expected, atol=atol, rtol=1e-5)


# ------------------------------------------------------------- masked statistics


def test_masked_sum_and_mean_by_hand():
    values = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    mask = torch.tensor([[1, 1, 0], [0, 1, 0]])
    # valid: 1, 2, 5 -> sum 8, mean 8/3; per row: sums (3, 5), means (1.5, 5)
    close(pm.masked_sum(values, mask), 8.0)
    close(pm.masked_mean(values, mask), 8.0 / 3.0)
    close(pm.masked_sum(values, mask, dim=1), [3.0, 5.0])
    close(pm.masked_mean(values, mask, dim=1), [1.5, 5.0])
    # per column: (1, 2+5, 0) / (1, 2, 0->1)
    close(pm.masked_mean(values, mask, dim=0), [1.0, 3.5, 0.0])


def test_masked_mean_ignores_garbage_outside_mask():
    values = torch.tensor([[1.0, float("inf"), float("nan")], [3.0, -float("inf"), 5.0]])
    mask = torch.tensor([[True, False, False], [True, False, True]])
    # valid: 1, 3, 5 -> mean 3
    close(pm.masked_mean(values, mask), 3.0)


def test_masked_var_by_hand():
    values = torch.tensor([1.0, 2.0, 3.0, 100.0])
    mask = torch.tensor([1.0, 1.0, 1.0, 0.0])
    # valid 1, 2, 3: mean 2, squared deviations 1 + 0 + 1 = 2
    close(pm.masked_var(values, mask), 2.0 / 2)  # unbiased: / (3 - 1)
    close(pm.masked_var(values, mask, unbiased=False), 2.0 / 3)


def test_masked_whiten_by_hand():
    values = torch.tensor([[1.0, 2.0], [3.0, 9.0]])
    mask = torch.tensor([[1, 1], [1, 0]])
    # valid 1, 2, 3: mean 2, unbiased var 1 -> (-1, 0, 1), and 0 outside the mask
    close(pm.masked_whiten(values, mask), [[-1.0, 0.0], [1.0, 0.0]], atol=1e-6)
    # shift_mean=False keeps the mean: (-1, 0, 1) + 2
    close(pm.masked_whiten(values, mask, shift_mean=False), [[1.0, 2.0], [3.0, 0.0]], atol=1e-6)


def test_masked_statistics_match_loop():
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
            pm.masked_sum(values, mask), torch.tensor(sum(valid), dtype=torch.float64), msg=msg
        )
        torch.testing.assert_close(
            pm.masked_mean(values, mask), torch.tensor(mean, dtype=torch.float64), msg=msg
        )
        torch.testing.assert_close(
            pm.masked_mean(values, mask, dim=1),
            torch.tensor(row_means, dtype=torch.float64),
            msg=msg,
        )
        torch.testing.assert_close(
            pm.masked_var(values, mask), torch.tensor(var, dtype=torch.float64), msg=msg
        )
        torch.testing.assert_close(
            pm.masked_whiten(values, mask),
            torch.tensor(ref_whiten(rows, mrows), dtype=torch.float64),
            msg=msg,
        )


def test_masked_statistics_errors():
    values = torch.ones(2, 3)
    with pytest.raises(ValueError, match=r"mask has shape \(2, 2\) but values has shape \(2, 3\)"):
        pm.masked_mean(values, torch.ones(2, 2))
    with pytest.raises(ValueError, match="all zero"):
        pm.masked_mean(values, torch.zeros(2, 3))
    with pytest.raises(ValueError, match="at least 2 valid entries"):
        pm.masked_var(values, torch.tensor([[1, 0, 0], [0, 0, 0]]))
    with pytest.raises(ValueError, match="at least 1 valid entries"):
        pm.masked_var(values, torch.zeros(2, 3), unbiased=False)
    with pytest.raises(ValueError, match="at least 2 valid entries"):
        pm.masked_whiten(values, torch.tensor([[1, 0, 0], [0, 0, 0]]))


# ---------------------------------------------------------------------------- KL


# logprob = ln 0.5, ref = ln 0.25 -> log_ratio = ln 2; and the reverse -> -ln 2.
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
def test_kl_penalty_by_hand(kind, expected):
    logprob = torch.tensor([[math.log(0.5), math.log(0.25)]])
    ref_logprob = torch.tensor([[math.log(0.25), math.log(0.5)]])
    close(pm.kl_penalty(logprob, ref_logprob, kind), [expected])


def test_kl_penalty_k3_is_clamped():
    # ref - logp = 15 -> e^15 - 15 - 1 ≈ 3.3e6 -> clamped to 10;
    # ref - logp = -30 -> log-ratio clamped to -20 -> e^-20 + 20 - 1 ≈ 19 -> 10.
    logprob = torch.tensor([[0.0, 0.0]])
    ref_logprob = torch.tensor([[15.0, -30.0]])
    close(pm.kl_penalty(logprob, ref_logprob, "k3"), [[10.0, 10.0]])


def test_kl_penalty_errors():
    x = torch.zeros(2, 3)
    with pytest.raises(ValueError, match=r"valid kinds: k1, kl, k2, mse, k3, low_var_kl, abs, k1+"):
        pm.kl_penalty(x, x, "k4")
    with pytest.raises(ValueError, match="ref_logprob has shape"):
        pm.kl_penalty(x, torch.zeros(2, 4), "k1")


def test_kl_loss_by_hand():
    logprob = torch.tensor([[math.log(0.5), math.log(0.25), 7.0]], requires_grad=True)
    ref_logprob = torch.tensor([[math.log(0.25), math.log(0.5), 0.0]])
    mask = torch.tensor([[1, 1, 0]])
    loss, metrics = pm.kl_loss(logprob, ref_logprob, mask, kind="k3")
    # token mean of the two k3 values above: (0.193147 + 0.306853) / 2 = 0.25
    close(loss, 0.25)
    close(metrics["kl_loss"], 0.25)
    loss.backward()
    # d k3 / d logp = 1 - exp(ref - logp): (1 - 0.5, 1 - 2) / 2 tokens; masked -> 0
    close(logprob.grad, [[0.25, -0.5, 0.0]])


# ------------------------------------------------------------ KL in the reward


def test_token_rewards_with_kl_penalty_by_hand():
    scores = torch.tensor([1.0, 2.0])
    token_kl = torch.tensor([[0.1, 0.2, 0.3], [0.4, 0.5, 0.6]])
    mask = torch.tensor([[1, 1, 0], [0, 1, 1]])  # right-padded, left-padded
    rewards, metrics = pm.token_rewards_with_kl_penalty(scores, token_kl, mask, kl_coef=0.5)
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


def test_token_rewards_with_kl_penalty_matches_loop():
    for seed, kind, gen, mask in all_masks():
        batch, length = mask.shape
        scores = torch.randn(batch, generator=gen, dtype=torch.float64)
        token_kl = torch.rand(mask.shape, generator=gen, dtype=torch.float64)
        beta = 0.1 * (seed + 1)
        rewards, _ = pm.token_rewards_with_kl_penalty(scores, token_kl, mask, beta)
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
        pm.token_rewards_with_kl_penalty(torch.zeros(3), kl, mask, 0.1)
    with pytest.raises(ValueError, match="kl_coef must be >= 0"):
        pm.token_rewards_with_kl_penalty(torch.zeros(2), kl, mask, -0.1)
    with pytest.raises(ValueError, match="response_mask has shape"):
        pm.token_rewards_with_kl_penalty(torch.zeros(2), kl, torch.ones(2, 4), 0.1)


# ------------------------------------------------------------- KL controllers


def test_fixed_kl_controller():
    ctl = pm.FixedKLController(0.05)
    ctl.update(current_kl=100.0, n_steps=1000)
    assert ctl.value == 0.05
    restored = pm.FixedKLController(1.0)
    restored.load_state_dict(ctl.state_dict())
    assert restored.value == 0.05


def test_adaptive_kl_controller_by_hand():
    ctl = pm.AdaptiveKLController(init_kl_coef=0.1, target_kl=6.0, horizon=10000)
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
    ctl = pm.AdaptiveKLController(0.2, target_kl=1.0, horizon=100)
    ctl.update(2.0, 10)
    state = ctl.state_dict()
    assert state == {"value": pytest.approx(0.2 * 1.02)}
    other = pm.AdaptiveKLController(0.2, target_kl=1.0, horizon=100)
    other.load_state_dict(state)
    assert other.value == ctl.value
    with pytest.raises(ValueError, match="'value' key"):
        other.load_state_dict({"kl_coef": 0.1})


def test_kl_controller_errors():
    with pytest.raises(ValueError, match="kl_coef must be >= 0"):
        pm.FixedKLController(-1.0)
    with pytest.raises(ValueError, match="init_kl_coef must be > 0"):
        pm.AdaptiveKLController(0.0, 1.0, 1.0)
    with pytest.raises(ValueError, match="target_kl must be > 0"):
        pm.AdaptiveKLController(0.1, 0.0, 1.0)
    with pytest.raises(ValueError, match="horizon must be > 0"):
        pm.AdaptiveKLController(0.1, 1.0, 0.0)
    with pytest.raises(ValueError, match="n_steps must be >= 0"):
        pm.AdaptiveKLController(0.1, 1.0, 1.0).update(1.0, -1)


# -------------------------------------------------------------------------- GAE


def ref_gae(rewards, values, mask, gamma, lam):
    """Obvious GAE: drop invalid tokens, run the textbook recursion, scatter back."""
    batch, length = len(rewards), len(rewards[0])
    adv = [[0.0] * length for _ in range(batch)]
    ret = [[0.0] * length for _ in range(batch)]
    for b in range(batch):
        steps = [t for t in range(length) if mask[b][t]]
        next_adv = 0.0
        for k in reversed(range(len(steps))):
            t = steps[k]
            next_value = values[b][steps[k + 1]] if k + 1 < len(steps) else 0.0
            delta = rewards[b][t] + gamma * next_value - values[b][t]
            next_adv = delta + gamma * lam * next_adv
            adv[b][t] = next_adv
            ret[b][t] = next_adv + values[b][t]
    return adv, ret


def test_gae_by_hand():
    rewards = torch.tensor([[0.0, 0.0, 1.0]])
    values = torch.tensor([[0.5, 0.6, 0.7]])
    mask = torch.ones(1, 3)
    adv, ret = pm.compute_gae_advantages_returns(
        rewards, values, mask, gamma=0.9, lam=0.8, whiten_advantages=False
    )
    # t=2: δ = 1 + 0 - 0.7 = 0.3;              A2 = 0.3
    # t=1: δ = 0 + 0.9*0.7 - 0.6 = 0.03;       A1 = 0.03 + 0.72*0.3 = 0.246
    # t=0: δ = 0 + 0.9*0.6 - 0.5 = 0.04;       A0 = 0.04 + 0.72*0.246 = 0.21712
    close(adv, [[0.21712, 0.246, 0.3]])
    # returns = A + V
    close(ret, [[0.71712, 0.846, 1.0]])


def test_gae_skips_gaps_by_hand():
    # the middle token is outside the mask: its reward (99) and value (99) must not count
    rewards = torch.tensor([[0.0, 99.0, 1.0, 5.0]])
    values = torch.tensor([[0.5, 99.0, 0.7, float("nan")]])
    mask = torch.tensor([[1, 0, 1, 0]])
    adv, ret = pm.compute_gae_advantages_returns(
        rewards, values, mask, gamma=0.9, lam=0.8, whiten_advantages=False
    )
    # t=2: A = 1 - 0.7 = 0.3 (next valid token: none)
    # t=0: next valid value is V2 = 0.7: δ = 0.9*0.7 - 0.5 = 0.13; A = 0.13 + 0.72*0.3 = 0.346
    close(adv, [[0.346, 0.0, 0.3, 0.0]])
    close(ret, [[0.846, 0.0, 1.0, 0.0]])


def test_gae_matches_loop():
    for seed, kind, gen, mask in all_masks():
        rewards = torch.randn(mask.shape, generator=gen, dtype=torch.float64)
        values = torch.randn(mask.shape, generator=gen, dtype=torch.float64)
        gamma, lam = [(1.0, 0.95), (0.99, 1.0), (0.9, 0.0)][seed]
        adv, ret = pm.compute_gae_advantages_returns(
            rewards, values, mask, gamma, lam, whiten_advantages=False
        )
        ref_adv, ref_ret = ref_gae(rewards.tolist(), values.tolist(), mask.tolist(), gamma, lam)
        msg = f"seed={seed} kind={kind}"
        torch.testing.assert_close(adv, torch.tensor(ref_adv, dtype=torch.float64), msg=msg)
        torch.testing.assert_close(ret, torch.tensor(ref_ret, dtype=torch.float64), msg=msg)
        white, ret2 = pm.compute_gae_advantages_returns(rewards, values, mask, gamma, lam)
        torch.testing.assert_close(
            white, torch.tensor(ref_whiten(ref_adv, mask.tolist()), dtype=torch.float64), msg=msg
        )
        torch.testing.assert_close(ret2, ret, msg=msg)  # returns are never whitened


def test_gae_carries_no_grad():
    values = torch.randn(2, 3, requires_grad=True)
    adv, ret = pm.compute_gae_advantages_returns(
        torch.randn(2, 3), values, torch.ones(2, 3), 1.0, 1.0
    )
    assert not adv.requires_grad and not ret.requires_grad


def test_gae_errors():
    x = torch.zeros(2, 3)
    with pytest.raises(ValueError, match=r"gamma must be in \[0, 1\], got 1.5"):
        pm.compute_gae_advantages_returns(x, x, x, gamma=1.5, lam=0.9)
    with pytest.raises(ValueError, match=r"lam must be in \[0, 1\], got -0.1"):
        pm.compute_gae_advantages_returns(x, x, x, gamma=1.0, lam=-0.1)
    with pytest.raises(ValueError, match="values has shape"):
        pm.compute_gae_advantages_returns(x, torch.zeros(2, 4), x, gamma=1.0, lam=1.0)
    with pytest.raises(ValueError, match=r"token_rewards must have shape \(B, T\)"):
        pm.compute_gae_advantages_returns(torch.zeros(3), torch.zeros(3), torch.ones(3), 1.0, 1.0)


# ------------------------------------------------------- outcome advantages


def ref_groups(scores, group_ids):
    """Plain dict of group id -> list of sample indices."""
    groups: dict[int, list[int]] = {}
    for i, g in enumerate(group_ids):
        groups.setdefault(g, []).append(i)
    return groups


def ref_grpo(scores, group_ids, normalize_by_std, eps=1e-6):
    out = [0.0] * len(scores)
    for members in ref_groups(scores, group_ids).values():
        if len(members) == 1:
            continue
        vals = [scores[i] for i in members]
        mean = sum(vals) / len(vals)
        std = math.sqrt(sum((v - mean) ** 2 for v in vals) / (len(vals) - 1))
        for i in members:
            out[i] = (scores[i] - mean) / (std + eps) if normalize_by_std else scores[i] - mean
    return out


def ref_rloo(scores, group_ids):
    out = [0.0] * len(scores)
    for members in ref_groups(scores, group_ids).values():
        for i in members:
            others = [scores[j] for j in members if j != i]
            out[i] = scores[i] - sum(others) / len(others) if others else 0.0
    return out


def ref_group_centred(scores, group_ids):
    out = [0.0] * len(scores)
    for members in ref_groups(scores, group_ids).values():
        mean = sum(scores[i] for i in members) / len(members)
        for i in members:
            out[i] = scores[i] - mean
    return out


def spread(per_seq, mask):
    """(B,) list -> (B, T) list, value on valid tokens, 0 elsewhere."""
    return [[per_seq[b] if m else 0.0 for m in mask[b]] for b in range(len(per_seq))]


def random_group_batch(seed):
    gen = torch.Generator().manual_seed(seed)
    group_ids = make_groups(gen)
    batch = group_ids.numel()
    # few distinct values so ties (std 0 groups) happen too
    scores = torch.randint(0, 3, (batch,), generator=gen).to(torch.float64)
    scores += 0.1 * torch.randn(batch, generator=gen, dtype=torch.float64) * (seed % 2)
    return scores, group_ids, mask_for(batch, gen)


def test_grpo_by_hand():
    scores = torch.tensor([1.0, 0.0, 1.0, 0.5])
    group_ids = torch.tensor([7, 7, 7, 3])
    mask = torch.tensor([[1, 1], [1, 0], [0, 1], [1, 1]])
    adv = pm.grpo_advantages(scores, group_ids, mask, eps=0.0)
    # group 7: mean 2/3, deviations (1/3, -2/3, 1/3), unbiased var (1/9+4/9+1/9)/2 = 1/3
    # std = 0.57735 -> (0.57735, -1.1547, 0.57735); group 3 is a singleton -> 0
    s = 1 / math.sqrt(3)
    close(adv, [[s, s], [-2 * s, 0.0], [0.0, s], [0.0, 0.0]], atol=1e-5)
    # without std: (1/3, -2/3, 1/3), singleton 0
    adv = pm.grpo_advantages(scores, group_ids, mask, normalize_by_std=False)
    close(adv, [[1 / 3, 1 / 3], [-2 / 3, 0.0], [0.0, 1 / 3], [0.0, 0.0]])


def test_grpo_equal_scores_give_zero_not_nan():
    adv = pm.grpo_advantages(
        torch.tensor([1.0, 1.0, 1.0]), torch.zeros(3, dtype=torch.long), torch.ones(3, 2)
    )
    close(adv, torch.zeros(3, 2))


def test_grpo_matches_loop():
    for seed in range(6):
        scores, group_ids, mask = random_group_batch(seed)
        for norm in (True, False):
            adv = pm.grpo_advantages(scores, group_ids, mask, normalize_by_std=norm)
            expected = spread(ref_grpo(scores.tolist(), group_ids.tolist(), norm), mask.tolist())
            torch.testing.assert_close(
                adv, torch.tensor(expected, dtype=torch.float64), msg=f"{seed} {norm}"
            )


def test_rloo_by_hand():
    scores = torch.tensor([1.0, 0.0, 1.0, 0.5])
    group_ids = torch.tensor([7, 7, 7, 3])
    mask = torch.ones(4, 2)
    # 1 - mean(0, 1) = 0.5; 0 - mean(1, 1) = -1; 1 - mean(1, 0) = 0.5; singleton -> 0
    close(
        pm.rloo_advantages(scores, group_ids, mask), [[0.5] * 2, [-1.0] * 2, [0.5] * 2, [0.0] * 2]
    )


def test_rloo_matches_loop():
    for seed in range(6):
        scores, group_ids, mask = random_group_batch(seed)
        adv = pm.rloo_advantages(scores, group_ids, mask)
        expected = spread(ref_rloo(scores.tolist(), group_ids.tolist()), mask.tolist())
        torch.testing.assert_close(adv, torch.tensor(expected, dtype=torch.float64), msg=str(seed))


def test_reinforce_plus_plus_baseline_by_hand():
    scores = torch.tensor([1.0, 0.0, 5.0])
    group_ids = torch.tensor([0, 0, 1])
    mask = torch.tensor([[1, 1], [1, 0], [1, 1]])
    # centred: (0.5, -0.5, 0 for the singleton) -> tokens 0.5, 0.5, -0.5, 0, 0
    # mean 0.1; deviations 0.4, 0.4, -0.6, -0.1, -0.1; unbiased var (0.16*2+0.36+0.02)/4 = 0.175
    sd = math.sqrt(0.175)
    expected = [[0.4 / sd, 0.4 / sd], [-0.6 / sd, 0.0], [-0.1 / sd, -0.1 / sd]]
    close(pm.reinforce_plus_plus_baseline_advantages(scores, group_ids, mask), expected, atol=1e-5)


def test_reinforce_plus_plus_baseline_matches_loop():
    for seed in range(6):
        scores, group_ids, mask = random_group_batch(seed)
        if seed % 2 == 0:
            scores += torch.arange(scores.numel(), dtype=torch.float64)  # avoid all-zero
        adv = pm.reinforce_plus_plus_baseline_advantages(scores, group_ids, mask)
        centred = spread(ref_group_centred(scores.tolist(), group_ids.tolist()), mask.tolist())
        expected = ref_whiten(centred, mask.tolist())
        torch.testing.assert_close(adv, torch.tensor(expected, dtype=torch.float64), msg=str(seed))


def test_outcome_advantage_errors():
    mask = torch.ones(3, 2)
    with pytest.raises(ValueError, match="group_ids must be an integer tensor"):
        pm.grpo_advantages(torch.zeros(3), torch.zeros(3), mask)
    with pytest.raises(ValueError, match="group_ids has shape"):
        pm.rloo_advantages(torch.zeros(3), torch.zeros(2, dtype=torch.long), mask)
    with pytest.raises(ValueError, match=r"scores must have shape \(B,\)"):
        pm.grpo_advantages(torch.zeros(3, 1), torch.zeros(3, 1, dtype=torch.long), mask)
    with pytest.raises(ValueError, match="response_mask has 2 rows but scores has 3"):
        pm.reinforce_plus_plus_baseline_advantages(
            torch.zeros(3), torch.zeros(3, dtype=torch.long), torch.ones(2, 2)
        )


# ----------------------------------------------------------------- REINFORCE++


def ref_discounted_returns(rewards, mask, gamma):
    out = [[0.0] * len(rewards[0]) for _ in rewards]
    for b, row in enumerate(rewards):
        running = 0.0
        for t in reversed(range(len(row))):
            if mask[b][t]:
                running = row[t] + gamma * running
                out[b][t] = running
    return out


def test_reinforce_plus_plus_by_hand():
    rewards = torch.tensor([[0.0, 0.0, 1.0, 9.0]])
    mask = torch.tensor([[1, 1, 1, 0]])
    adv, ret = pm.reinforce_plus_plus_advantages(rewards, mask, gamma=0.5)
    # returns-to-go with γ=0.5: (0.25, 0.5, 1); the padded 9 is ignored
    close(ret, [[0.25, 0.5, 1.0, 0.0]])
    # mean 7/12, unbiased std 0.381881 -> (-0.872872, -0.218218, 1.091089)
    close(adv, [[-0.872872, -0.218218, 1.091089, 0.0]], atol=1e-5)


def test_reinforce_plus_plus_skips_gaps_by_hand():
    # token 1 is outside the mask (e.g. tool output): its 99 is ignored and it does not
    # discount; VeRL's loop would zero the return there and give token 0 a return of 0
    rewards = torch.tensor([[0.0, 99.0, 0.0, 1.0]])
    mask = torch.tensor([[1, 0, 1, 1]])
    adv, ret = pm.reinforce_plus_plus_advantages(rewards, mask, gamma=0.5)
    # t=3: 1; t=2: 0 + 0.5*1 = 0.5; t=0: 0 + 0.5*0.5 = 0.25 (the next valid token is t=2)
    close(ret, [[0.25, 0.0, 0.5, 1.0]])
    # the same three returns as above, so the same whitened values
    close(adv, [[-0.872872, 0.0, -0.218218, 1.091089]], atol=1e-5)


def test_reinforce_plus_plus_matches_loop():
    for seed, kind, gen, mask in all_masks():
        rewards = torch.randn(mask.shape, generator=gen, dtype=torch.float64)
        gamma = (1.0, 0.9, 0.5)[seed]
        adv, ret = pm.reinforce_plus_plus_advantages(rewards, mask, gamma)
        expected = ref_discounted_returns(rewards.tolist(), mask.tolist(), gamma)
        msg = f"seed={seed} kind={kind}"
        torch.testing.assert_close(ret, torch.tensor(expected, dtype=torch.float64), msg=msg)
        torch.testing.assert_close(
            adv, torch.tensor(ref_whiten(expected, mask.tolist()), dtype=torch.float64), msg=msg
        )


# -------------------------------------------------------------------- registry


def test_registry_names_and_critic_needs():
    assert set(pm.ADVANTAGE_ESTIMATORS) == {
        "gae",
        "grpo",
        "rloo",
        "reinforce_plus_plus",
        "reinforce_plus_plus_baseline",
        "opo",
        "gpg",
        "grpo_passk",
        "gdpo",
        "remax",
        "optimal_token_baseline",
    }
    assert [n for n in pm.ADVANTAGE_ESTIMATORS if pm.needs_critic(n)] == ["gae"]
    assert {n for n in pm.ADVANTAGE_ESTIMATORS if pm.needs_group_ids(n)} == {
        "grpo",
        "rloo",
        "reinforce_plus_plus_baseline",
        "opo",
        "gpg",
        "grpo_passk",
        "gdpo",
        "optimal_token_baseline",
    }

    def needing(field):
        return [n for n in pm.ADVANTAGE_ESTIMATORS if field in pm.estimator_needs(n)]

    assert needing("baseline_scores") == ["remax"]
    assert needing("sum_pi_squared") == ["optimal_token_baseline"]
    assert needing("component_scores") == ["gdpo"]
    # every need names an EstimatorInputs field
    fields = set(pm.EstimatorInputs.__dataclass_fields__)
    assert all(pm.estimator_needs(n) <= fields for n in pm.ADVANTAGE_ESTIMATORS)


def test_registry_unknown_name():
    for fn in (
        pm.get_advantage_estimator,
        pm.needs_critic,
        pm.needs_group_ids,
        pm.estimator_needs,
    ):
        with pytest.raises(
            ValueError, match=r"unknown advantage estimator 'ppo'; valid choices: gae, grpo"
        ):
            fn("ppo")


def test_registry_missing_inputs():
    x = torch.zeros(2, 3)
    nothing = pm.EstimatorInputs()
    with pytest.raises(ValueError, match="'gae' needs values"):
        pm.get_advantage_estimator("gae")(x, torch.ones(2, 3), nothing)
    with pytest.raises(ValueError, match="'rloo' needs group_ids"):
        pm.get_advantage_estimator("rloo")(x, torch.ones(2, 3), nothing)
    with pytest.raises(ValueError, match="'remax' needs baseline_scores"):
        pm.get_advantage_estimator("remax")(x, torch.ones(2, 3), nothing)
    with_groups = pm.EstimatorInputs(group_ids=torch.tensor([0, 0]))
    with pytest.raises(ValueError, match="'gdpo' needs component_scores"):
        pm.get_advantage_estimator("gdpo")(x, torch.ones(2, 3), with_groups)
    with pytest.raises(ValueError, match="'optimal_token_baseline' needs old_logprob"):
        pm.get_advantage_estimator("optimal_token_baseline")(x, torch.ones(2, 3), with_groups)


def test_registry_entries_call_the_plain_functions():
    gen = torch.Generator().manual_seed(3)
    group_ids = make_groups(gen)
    mask = mask_for(group_ids.numel(), gen)
    token_rewards = torch.randn(mask.shape, generator=gen, dtype=torch.float64)
    values = torch.randn(mask.shape, generator=gen, dtype=torch.float64)
    scores = pm.masked_sum(token_rewards, mask, dim=1)
    kwargs = {"values": values, "group_ids": group_ids, "gamma": 0.9, "lam": 0.95}

    def run(name, **overrides):
        inputs = pm.EstimatorInputs(**(kwargs | overrides))
        return pm.get_advantage_estimator(name)(token_rewards, mask, inputs)

    expected = {
        "gae": pm.compute_gae_advantages_returns(token_rewards, values, mask, 0.9, 0.95),
        "grpo": (pm.grpo_advantages(scores, group_ids, mask),) * 2,
        "rloo": (pm.rloo_advantages(scores, group_ids, mask),) * 2,
        "reinforce_plus_plus": pm.reinforce_plus_plus_advantages(token_rewards, mask, 0.9),
        "reinforce_plus_plus_baseline": (
            pm.reinforce_plus_plus_baseline_advantages(scores, group_ids, mask),
        )
        * 2,
        "opo": (pm.opo_advantages(scores, group_ids, mask),) * 2,
        "gpg": (pm.gpg_advantages(scores, group_ids, mask),) * 2,
        "grpo_passk": (pm.grpo_passk_advantages(scores, group_ids, mask),) * 2,
    }
    for name, (exp_adv, exp_ret) in expected.items():
        adv, ret = run(name)
        torch.testing.assert_close(adv, exp_adv, msg=name)
        torch.testing.assert_close(ret, exp_ret, msg=name)
    # normalize_advantages reaches GAE's whitening (only), norm_adv_by_std GRPO's std
    adv, _ = run("gae", normalize_advantages=False)
    torch.testing.assert_close(
        adv, pm.compute_gae_advantages_returns(token_rewards, values, mask, 0.9, 0.95, False)[0]
    )
    adv, _ = run("grpo", normalize_advantages=False)
    torch.testing.assert_close(adv, pm.grpo_advantages(scores, group_ids, mask))
    adv, _ = run("grpo", norm_adv_by_std=False)
    torch.testing.assert_close(
        adv, pm.grpo_advantages(scores, group_ids, mask, normalize_by_std=False)
    )
    adv, _ = run("grpo_passk", norm_adv_by_std=False)
    torch.testing.assert_close(
        adv, pm.grpo_passk_advantages(scores, group_ids, mask, normalize_by_std=False)
    )
    # the inputs of the estimators that read more than rewards and groups
    baseline = torch.randn(group_ids.numel(), generator=gen, dtype=torch.float64)
    torch.testing.assert_close(
        run("remax", baseline_scores=baseline),
        pm.remax_advantages(token_rewards, baseline, mask),
    )
    components = torch.stack([scores, -scores], dim=1)
    weights = torch.tensor([1.0, 0.5], dtype=torch.float64)
    adv, _ = run("gdpo", component_scores=components, component_weights=weights)
    torch.testing.assert_close(adv, pm.gdpo_advantages(components, weights, group_ids, mask))
    old = -torch.rand(mask.shape, generator=gen, dtype=torch.float64)
    squares = torch.rand(mask.shape, generator=gen, dtype=torch.float64)
    token_weights = torch.rand(mask.shape, generator=gen, dtype=torch.float64)
    torch.testing.assert_close(
        run(
            "optimal_token_baseline",
            old_logprob=old,
            sum_pi_squared=squares,
            token_weights=token_weights,
        ),
        pm.optimal_token_baseline_advantages(
            token_rewards, mask, group_ids, old, squares, token_weights
        ),
    )
    # singleton_groups reaches every group estimator
    group_fns = {
        "grpo": pm.grpo_advantages,
        "rloo": pm.rloo_advantages,
        "reinforce_plus_plus_baseline": pm.reinforce_plus_plus_baseline_advantages,
        "opo": pm.opo_advantages,
        "gpg": pm.gpg_advantages,
        "grpo_passk": pm.grpo_passk_advantages,
    }
    for name, fn in group_fns.items():
        adv, _ = run(name, singleton_groups="score")
        torch.testing.assert_close(
            adv, fn(scores, group_ids, mask, singleton_groups="score"), msg=name
        )


# ---------------------------------------------------------------------- entropy


def test_entropy_by_hand():
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
    close(pm.entropy_from_logits(logits), [[math.log(4.0), 0.0, 0.562335]])


def test_entropy_stable_for_large_logits_and_matches_loop():
    gen = torch.Generator().manual_seed(0)
    logits = 50.0 * torch.randn(3, 4, 6, generator=gen, dtype=torch.float64) + 1e4
    entropy = pm.entropy_from_logits(logits)
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
    pm.entropy_from_logits(logits).sum().backward()
    assert torch.isfinite(logits.grad).all()


# ----------------------------------------------------------------- aggregation


def test_aggregate_loss_by_hand():
    loss = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0], [7.0, 8.0, 9.0]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0], [0, 0, 0]])  # last row: padding only
    # token-mean: (1 + 2 + 4) / 3
    close(pm.aggregate_loss(loss, mask, "token-mean"), 7 / 3)
    # seq sums 3 and 4 -> mean 3.5 (the empty row is not a sequence)
    close(pm.aggregate_loss(loss, mask, "seq-mean-token-sum"), 3.5)
    # seq means 1.5 and 4 -> 2.75
    close(pm.aggregate_loss(loss, mask, "seq-mean-token-mean"), 2.75)
    # token-sum: 1 + 2 + 4
    close(pm.aggregate_loss(loss, mask, "token-sum"), 7.0)
    # Dr. GRPO: seq sums 3 and 4 over T = 3 -> (1 + 4/3) / 2; over a constant 10 -> 0.35
    close(pm.aggregate_loss(loss, mask, "seq-mean-token-sum-norm"), (1 + 4 / 3) / 2)
    close(pm.aggregate_loss(loss, mask, "seq-mean-token-sum-norm", norm_tokens=10), 0.35)


def test_aggregate_loss_matches_loop():
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
        assert set(expected) == set(pm.LOSS_AGG_MODES)
        for mode, value in expected.items():
            torch.testing.assert_close(
                pm.aggregate_loss(loss, mask, mode),
                torch.tensor(value, dtype=torch.float64),
                msg=f"{seed} {kind} {mode}",
            )


def test_aggregate_loss_errors():
    x = torch.ones(2, 3)
    with pytest.raises(
        ValueError, match="valid modes: token-mean, seq-mean-token-sum, seq-mean-token-mean"
    ):
        pm.aggregate_loss(x, x, "seq-sum")
    for mode in pm.LOSS_AGG_MODES:
        if mode == "token-sum":  # a sum over nothing is 0, not undefined
            close(pm.aggregate_loss(x, torch.zeros(2, 3), mode), 0.0)
            continue
        with pytest.raises(ValueError, match="all zero"):
            pm.aggregate_loss(x, torch.zeros(2, 3), mode)
    with pytest.raises(ValueError, match="norm_tokens must be > 0"):
        pm.aggregate_loss(x, x, "seq-mean-token-sum-norm", norm_tokens=0)


# ----------------------------------------------------------------- policy loss


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


def test_policy_loss_dual_clip_by_hand():
    old, new, adv, mask = hand_policy_batch()
    loss, metrics = pm.policy_loss(old, new, adv, mask, clip_ratio_dual=3.0)
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


def test_policy_loss_without_dual_clip_by_hand():
    old, new, adv, mask = hand_policy_batch()
    loss, metrics = pm.policy_loss(old, new, adv, mask, clip_ratio_dual=None)
    # token 2 keeps its loss of 4: (-1.2 + 4 + 0.8) / 3 = 1.2
    close(loss, 1.2)
    close(metrics["pg_clipfrac_lower"], 0.0)


def test_policy_loss_clip_higher_by_hand():
    old = torch.zeros(1, 2)
    new = torch.tensor([[math.log(1.25), math.log(1.25)]])
    adv = torch.tensor([[1.0, 2.0]])
    # ε_high = 0.28: ρ = 1.25 is inside the trust region -> loss = -(1.25 + 2.5) / 2
    loss, metrics = pm.policy_loss(old, new, adv, torch.ones(1, 2), clip_ratio_high=0.28)
    close(loss, -1.875)
    close(metrics["pg_clipfrac"], 0.0)
    # ε_high = 0.2 clips at 1.2 -> -(1.2 + 2.4) / 2
    loss, metrics = pm.policy_loss(old, new, adv, torch.ones(1, 2), clip_ratio_high=0.2)
    close(loss, -1.8)
    close(metrics["pg_clipfrac"], 1.0)


def test_policy_loss_gradient_by_hand():
    # ρ = 1 and A = 2 on the first token: inside the region, d(-A ρ)/d logp = -A ρ = -2;
    # the second token is clipped (A = 1, ρ = 2 > 1.2): no gradient. Token mean over 2.
    old = torch.zeros(1, 2)
    new = torch.tensor([[0.0, math.log(2.0)]], requires_grad=True)
    adv = torch.tensor([[2.0, 1.0]])
    loss, _ = pm.policy_loss(old, new, adv, torch.ones(1, 2))
    loss.backward()
    close(new.grad, [[-1.0, 0.0]])


def test_policy_loss_matches_loop():
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
        for mode in pm.LOSS_AGG_MODES:
            loss, metrics = pm.policy_loss(
                old,
                new,
                adv,
                mask,
                clip_ratio_low=0.2,
                clip_ratio_high=0.28,
                clip_ratio_dual=dual,
                loss_agg_mode=mode,
            )
            expected = pm.aggregate_loss(torch.tensor(losses, dtype=torch.float64), mask, mode)
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
        pm.policy_loss(x, x, x, torch.ones(2, 3), clip_ratio_dual=1.0)
    with pytest.raises(ValueError, match="clip_ratio_low must be in"):
        pm.policy_loss(x, x, x, torch.ones(2, 3), clip_ratio_low=1.0)
    with pytest.raises(ValueError, match="advantages has shape"):
        pm.policy_loss(x, x, torch.zeros(2, 4), torch.ones(2, 3))
    with pytest.raises(ValueError, match="valid modes"):
        pm.policy_loss(x, x, x, torch.ones(2, 3), loss_agg_mode="sum")


# ------------------------------------------------------------------ value loss


def test_value_loss_by_hand():
    values = torch.tensor([[1.0, 2.0, 50.0]], requires_grad=True)
    old_values = torch.tensor([[0.0, 1.9, 0.0]])
    returns = torch.tensor([[1.0, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 0]])
    loss, metrics = pm.value_loss(values, old_values, returns, mask, clip_range=0.2)
    # token 1: clip(1, -0.2, 0.2) = 0.2; errors (1-1)² = 0 and (0.2-1)² = 0.64 -> 0.64
    # token 2: clip(2, 1.7, 2.1) = 2; both errors 4 -> 4 (not counted as clipped)
    # 0.5 * token-mean = 0.5 * (0.64 + 4) / 2 = 1.16
    close(loss, 1.16)
    close(metrics["vf_loss"], 1.16)
    close(metrics["vf_clipfrac"], 0.5)
    loss.backward()
    # token 1 takes the clipped branch (constant in V): 0; token 2: 0.5 * 2 * (2 - 0) / 2 = 1
    close(values.grad, [[0.0, 1.0, 0.0]])


def test_value_loss_matches_loop():
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
        for mode in pm.LOSS_AGG_MODES:
            loss, metrics = pm.value_loss(
                values, old_values, returns, mask, clip_range=eps, loss_agg_mode=mode
            )
            expected = 0.5 * pm.aggregate_loss(
                torch.tensor(losses, dtype=torch.float64), mask, mode
            )
            torch.testing.assert_close(loss, expected, msg=f"{seed} {kind} {mode}")
        frac = pm.masked_mean(torch.tensor(clipped, dtype=torch.float64), mask)
        torch.testing.assert_close(metrics["vf_clipfrac"], frac)


def test_value_loss_errors():
    x = torch.zeros(2, 3)
    with pytest.raises(ValueError, match="clip_range must be >= 0"):
        pm.value_loss(x, x, x, torch.ones(2, 3), clip_range=-0.1)
    with pytest.raises(ValueError, match="returns has shape"):
        pm.value_loss(x, x, torch.zeros(3, 3), torch.ones(2, 3))


def test_kl_metrics_with_uneven_lengths_by_hand():
    token_kl = torch.tensor([[0.1, 0.2, 0.3, 0.4], [1.0, 0.0, 0.0, 0.0], [9.0, 9.0, 9.0, 9.0]])
    mask = torch.tensor([[1, 1, 1, 1], [1, 0, 0, 0], [0, 0, 0, 0]])  # 4, 1 and 0 tokens
    metrics = pm.kl_metrics(token_kl, mask)
    # per-sequence means 0.25 and 1.0 (the empty row is left out): (0.25 + 1.0) / 2
    close(metrics["kl_mean"], 0.625)
    # tokens: (0.1 + 0.2 + 0.3 + 0.4 + 1.0) / 5
    close(metrics["kl_token_mean"], 0.4)
    # sums 1.0, 1.0, 0 over 3 sequences
    close(metrics["kl_seq_sum_mean"], 2.0 / 3)


def test_kl_metrics_match_loop():
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
        metrics = pm.kl_metrics(token_kl, mask)
        close(metrics["kl_mean"], sum(per_sequence) / len(per_sequence))
        close(metrics["kl_token_mean"], sum(tokens) / len(tokens))


# ================================================================ the catalogue
# Estimators, KL variants and policy losses beyond PPO/GRPO (issue 15); the same two
# kinds of test: tiny tensors worked out by hand, and plain loops over seeds and masks.


def test_every_registered_name_has_a_one_line_note_with_a_paper():
    catalogue = {
        "advantage estimators": (pm.ADVANTAGE_ESTIMATORS, pm.ADVANTAGE_ESTIMATOR_NOTES),
        "policy losses": (pm.POLICY_LOSSES, pm.POLICY_LOSS_NOTES),
        "KL estimators": (pm.KL_KINDS, pm.KL_KIND_NOTES),
        "aggregation modes": (pm.LOSS_AGG_MODES, pm.LOSS_AGG_MODE_NOTES),
    }
    for family, (names, notes) in catalogue.items():
        assert list(names) == list(notes), family
        for name, note in notes.items():
            assert note.summary and note.paper, (family, name)
            assert "\n" not in note.line(), (family, name)


# ---------------------------------------------------------- straight-through KL


def test_kl_name_and_straight_through_by_hand():
    # one token with log π/π_ref = ln 2
    logprob = torch.tensor([[LN2]], requires_grad=True)
    ref = torch.zeros(1, 1)
    close(pm.kl_penalty(logprob, ref, "kl"), [[LN2]])  # VeRL's name for k1
    expected_values = {"k1+": LN2, "k3+": 0.5 + LN2 - 1, "low_var_kl+": 0.5 + LN2 - 1}
    for kind, value in expected_values.items():
        logprob.grad = None
        out = pm.kl_penalty(logprob, ref, kind)
        close(out.detach(), [[value]])
        out.sum().backward()
        # gradient of k2 = 0.5·x²: x = ln 2 (k1's would be 1, k3's 1 - 1/2)
        close(logprob.grad, [[LN2]])


def test_straight_through_kl_matches_loop():
    for seed, kind, gen, mask in all_masks():
        ref = -torch.rand(mask.shape, generator=gen, dtype=torch.float64) * 3
        logprob = (
            ref + torch.randn(mask.shape, generator=gen, dtype=torch.float64)
        ).requires_grad_()
        for st_kind in ("k1+", "k3+", "low_var_kl+"):
            logprob.grad = None
            out = pm.kl_penalty(logprob, ref, st_kind)
            values, grads = [], []
            for rl, rr in zip(logprob.tolist(), ref.tolist(), strict=True):
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
                logprob.grad, torch.tensor(grads, dtype=torch.float64), msg=msg
            )


def test_kl_loss_straight_through_gradient_by_hand():
    logprob = torch.tensor([[LN2, 0.5, 9.0]], requires_grad=True)
    ref = torch.zeros(1, 3)
    mask = torch.tensor([[1, 1, 0]])
    loss, _ = pm.kl_loss(logprob, ref, mask, kind="k3+")
    # value: token mean of k3 = ((0.5 + ln 2 - 1) + (e^-0.5 + 0.5 - 1)) / 2
    close(loss.detach(), ((0.5 + LN2 - 1) + (math.exp(-0.5) - 0.5)) / 2)
    loss.backward()
    # gradient: log-ratio / 2 tokens; nothing for the padding
    close(logprob.grad, [[LN2 / 2, 0.25, 0.0]])


# --------------------------------------------------- singleton groups, OPO, GPG


def ref_singleton(value, score, singleton_groups):
    return score if singleton_groups == "score" else value


def test_singleton_groups_score_by_hand():
    scores = torch.tensor([1.0, 0.0, 0.5])
    group_ids = torch.tensor([7, 7, 3])  # group 3 is a singleton
    mask = torch.ones(3, 1)
    # the singleton keeps its raw score 0.5; the pair gets its usual advantages
    s = 1 / math.sqrt(0.5)  # GRPO: deviations ±0.5, unbiased std sqrt(0.5)
    close(
        pm.grpo_advantages(scores, group_ids, mask, eps=0.0, singleton_groups="score"),
        [[0.5 * s], [-0.5 * s], [0.5]],
    )
    close(
        pm.rloo_advantages(scores, group_ids, mask, singleton_groups="score"),
        [[1.0], [-1.0], [0.5]],
    )
    # REINFORCE++-baseline: centred (0.5, -0.5, 0.5): mean 1/6, whitened
    centred = [0.5, -0.5, 0.5]
    expected = ref_whiten([[c] for c in centred], [[True]] * 3)
    close(
        pm.reinforce_plus_plus_baseline_advantages(
            scores, group_ids, mask, singleton_groups="score"
        ),
        expected,
    )
    with pytest.raises(ValueError, match="valid choices: zero, score"):
        pm.grpo_advantages(scores, group_ids, mask, singleton_groups="raw")


def test_singleton_groups_match_loop():
    for seed in range(6):
        scores, group_ids, mask = random_group_batch(seed)
        s, g = scores.tolist(), group_ids.tolist()
        groups = ref_groups(s, g)
        singles = {members[0] for members in groups.values() if len(members) == 1}
        for norm in (True, False):
            expected = ref_grpo(s, g, norm)
            expected = [s[i] if i in singles else a for i, a in enumerate(expected)]
            adv = pm.grpo_advantages(
                scores, group_ids, mask, normalize_by_std=norm, singleton_groups="score"
            )
            torch.testing.assert_close(
                adv, torch.tensor(spread(expected, mask.tolist()), dtype=torch.float64)
            )
        expected = [s[i] if i in singles else a for i, a in enumerate(ref_rloo(s, g))]
        adv = pm.rloo_advantages(scores, group_ids, mask, singleton_groups="score")
        torch.testing.assert_close(
            adv, torch.tensor(spread(expected, mask.tolist()), dtype=torch.float64)
        )
        if seed % 2 == 0:
            continue  # whitening below needs scores that are not all equal
        centred = ref_group_centred(s, g)
        centred = [s[i] if i in singles else c for i, c in enumerate(centred)]
        expected = ref_whiten(spread(centred, mask.tolist()), mask.tolist())
        adv = pm.reinforce_plus_plus_baseline_advantages(
            scores, group_ids, mask, singleton_groups="score"
        )
        torch.testing.assert_close(adv, torch.tensor(expected, dtype=torch.float64), msg=str(seed))


def ref_opo(scores, group_ids, lengths, singleton_groups="zero"):
    out = [0.0] * len(scores)
    for members in ref_groups(scores, group_ids).values():
        if len(members) == 1:
            out[members[0]] = ref_singleton(0.0, scores[members[0]], singleton_groups)
            continue
        total = sum(lengths[i] for i in members)
        baseline = sum(lengths[i] * scores[i] for i in members) / total if total else 0.0
        for i in members:
            out[i] = scores[i] - baseline
    return out


def test_opo_by_hand():
    scores = torch.tensor([1.0, 0.0, 1.0, 0.5])
    group_ids = torch.tensor([7, 7, 7, 3])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0], [0, 0, 1], [1, 1, 1]])  # lengths 2, 1, 1, 3
    # group 7: b = (2·1 + 1·0 + 1·1) / (2 + 1 + 1) = 0.75 -> A = (0.25, -0.75, 0.25)
    # group 3 is a singleton: 0, or its score 0.5 under "score"
    close(
        pm.opo_advantages(scores, group_ids, mask),
        [[0.25, 0.25, 0.0], [-0.75, 0.0, 0.0], [0.0, 0.0, 0.25], [0.0, 0.0, 0.0]],
    )
    adv = pm.opo_advantages(scores, group_ids, mask, singleton_groups="score")
    close(adv[3], [0.5, 0.5, 0.5])


def test_opo_matches_loop():
    for seed in range(6):
        scores, group_ids, mask = random_group_batch(seed)
        lengths = [sum(row) for row in mask.tolist()]
        for singleton in pm.SINGLETON_GROUP_CHOICES:
            adv = pm.opo_advantages(scores, group_ids, mask, singleton_groups=singleton)
            expected = ref_opo(scores.tolist(), group_ids.tolist(), lengths, singleton)
            torch.testing.assert_close(
                adv,
                torch.tensor(spread(expected, mask.tolist()), dtype=torch.float64),
                msg=f"{seed} {singleton}",
            )


def ref_gpg(scores, group_ids, singleton_groups="zero"):
    out = [0.0] * len(scores)
    invalid = 0
    for members in ref_groups(scores, group_ids).values():
        if len(members) == 1:
            i = members[0]
            out[i] = ref_singleton(0.0, scores[i], singleton_groups)
            invalid += singleton_groups == "zero"
            continue
        values = [scores[i] for i in members]
        if max(values) == min(values):
            invalid += len(members)
            continue
        mean = sum(values) / len(values)
        for i in members:
            out[i] = scores[i] - mean
    alpha = len(scores) / max(len(scores) - invalid, 1)
    return [alpha * a for a in out]


def test_gpg_by_hand():
    scores = torch.tensor([1.0, 0.0, 1.0, 1.0, 0.3])
    group_ids = torch.tensor([1, 1, 2, 2, 3])
    mask = torch.ones(5, 1)
    # group 1: (0.5, -0.5); group 2 all equal -> 0; group 3 singleton -> 0
    # B = 5, M = 2 + 1 = 3 -> α = 5 / 2
    close(pm.gpg_advantages(scores, group_ids, mask), [[1.25], [-1.25], [0.0], [0.0], [0.0]])
    # "score": the singleton keeps 0.3 and is valid: M = 2, α = 5 / 3
    close(
        pm.gpg_advantages(scores, group_ids, mask, singleton_groups="score"),
        [[0.5 * 5 / 3], [-0.5 * 5 / 3], [0.0], [0.0], [0.3 * 5 / 3]],
    )
    # every group degenerate: all advantages 0 (α's divisor clamped, no division by 0)
    close(
        pm.gpg_advantages(torch.ones(4), torch.tensor([0, 0, 1, 1]), torch.ones(4, 1)),
        torch.zeros(4, 1),
    )


def test_gpg_matches_loop():
    for seed in range(6):
        scores, group_ids, mask = random_group_batch(seed)
        for singleton in pm.SINGLETON_GROUP_CHOICES:
            adv = pm.gpg_advantages(scores, group_ids, mask, singleton_groups=singleton)
            expected = ref_gpg(scores.tolist(), group_ids.tolist(), singleton)
            torch.testing.assert_close(
                adv,
                torch.tensor(spread(expected, mask.tolist()), dtype=torch.float64),
                msg=f"{seed} {singleton}",
            )


# ------------------------------------------------------------ new policy losses


def policy_batch(gen, mask, spread_=0.5):
    """(old, new, adv) float64 with nan garbage outside the mask."""
    old = -torch.rand(mask.shape, generator=gen, dtype=torch.float64) * 3
    new = old + spread_ * torch.randn(mask.shape, generator=gen, dtype=torch.float64)
    adv = torch.randn(mask.shape, generator=gen, dtype=torch.float64)
    for t in (old, new, adv):
        t[~mask] = float("nan")
    return old, new.requires_grad_(), adv


def ref_weights(mask, mode):
    """Per-token weight of the aggregate, for token-mean / seq-mean-token-mean."""
    rows = [sum(r) for r in mask]
    if mode == "token-mean":
        n = sum(rows)
        return [[1 / n if m else 0.0 for m in r] for r in mask]
    seqs = sum(1 for n in rows if n)
    return [[1 / (seqs * n) if m else 0.0 for m in r] for r, n in zip(mask, rows, strict=True)]


def ref_loss_and_grad(losses, grads, mask, mode):
    """The aggregate of per-token losses and its gradient w.r.t. logprob.

    ``grads[b][t]`` is d(Σ_t' losses[b][t']) / d logprob[b][t], the row's summed loss
    differentiated by one token; weighting it by the token's weight is exact because
    both modes tested weigh all tokens of a row the same."""
    weights = ref_weights(mask, mode)
    value = sum(
        w * x
        for wr, lr, mr in zip(weights, losses, mask, strict=True)
        for w, x, m in zip(wr, lr, mr, strict=True)
        if m
    )
    grad = [
        [w * g if m else 0.0 for w, g, m in zip(wr, gr, mr, strict=True)]
        for wr, gr, mr in zip(weights, grads, mask, strict=True)
    ]
    return value, grad


def check_policy_loss(fn, kwargs, ref_tokens, msg, probabilities=False):
    """Runs fn over every seed and mask layout against a per-row loop reference.

    ``ref_tokens(old_row, new_row, adv_row, mask_row)`` returns the row's per-token
    losses and grads as :func:`ref_loss_and_grad` takes them. ``probabilities``: keep
    the new log-probs <= 0 (losses that read the probabilities themselves)."""
    for seed, kind, gen, mask in all_masks():
        old, new, adv = policy_batch(gen, mask)
        if probabilities:
            new = new.detach().clamp(max=-1e-3).requires_grad_()
        for mode in ("token-mean", "seq-mean-token-mean"):
            new.grad = None
            loss, metrics = fn(old, new, adv, mask, loss_agg_mode=mode, **kwargs)
            loss.backward()
            losses, grads = [], []
            for ro, rn, ra, rm in zip(
                old.tolist(), new.detach().tolist(), adv.tolist(), mask.tolist(), strict=True
            ):
                row_losses, row_grads = ref_tokens(ro, rn, ra, rm)
                losses.append(row_losses)
                grads.append(row_grads)
            value, grad = ref_loss_and_grad(losses, grads, mask.tolist(), mode)
            where = f"{msg} seed={seed} {kind} {mode}"
            torch.testing.assert_close(
                loss.detach(), torch.tensor(value, dtype=torch.float64), msg=where
            )
            torch.testing.assert_close(new.grad, torch.tensor(grad, dtype=torch.float64), msg=where)
            assert set(metrics) >= {"pg_loss", "pg_clipfrac", "ppo_kl", "pg_clipfrac_lower"}


def test_gspo_by_hand():
    # sequence 1: log ratios (ln 2, 0) -> s = √2 > 1.2, A = 1: clipped at 1.2, no gradient
    # sequence 2: log ratios (0.1, -0.1) -> s = 1, A = -1: loss 1 per token
    old = torch.zeros(2, 3)
    new = torch.tensor([[LN2, 0.0, 7.0], [0.1, -0.1, 7.0]], requires_grad=True)
    adv = torch.tensor([[1.0, 1.0, 0.0], [-1.0, -1.0, 0.0]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 0]])
    loss, metrics = pm.gspo_loss(old, new, adv, mask, clip_ratio_low=0.2, clip_ratio_high=0.2)
    # seq-mean-token-mean: (-1.2 + 1) / 2
    close(loss, -0.1)
    close(metrics["pg_clipfrac"], 0.5)
    loss.backward()
    # sequence 2: d(-A·s_{i,t})/d log π_t = s_i = 1, weight 1 / (2 sequences × 2 tokens)
    close(new.grad, [[0.0, 0.0, 0.0], [0.25, 0.25, 0.0]])


def test_gspo_matches_loop():
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
        pm.gspo_loss, {"clip_ratio_low": eps_low, "clip_ratio_high": eps_high}, ref, "gspo"
    )


def test_cispo_by_hand():
    old = torch.zeros(1, 4)
    new = torch.tensor(
        [[math.log(1.5), math.log(0.5), math.log(1.1), float("nan")]], requires_grad=True
    )
    adv = torch.tensor([[1.0, -1.0, 2.0, float("inf")]])
    mask = torch.tensor([[1, 1, 1, 0]])
    loss, metrics = pm.cispo_loss(old, new, adv, mask)
    # weights clip(ρ, 0.8, 1.2) = (1.2, 0.8, 1.1); values -ŵ·A = (-1.2, 0.8, -2.2)
    close(loss, -2.6 / 3)
    close(metrics["pg_clipfrac"], 2 / 3)
    loss.backward()
    # every token keeps a gradient, -ŵ·A / 3, even the clipped ones
    close(new.grad, [[-0.4, 0.8 / 3, -2.2 / 3, 0.0]])


def test_cispo_matches_loop():
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

    check_policy_loss(pm.cispo_loss, {"clip_ratio_low": 0.2, "clip_ratio_high": 0.25}, ref, "cispo")


def test_gmpo_by_hand():
    # both sequences: token log ratios (ln 2, -ln 2); ε = 0.2 -> log bounds ln 0.8, ln 1.2
    old = torch.zeros(2, 2)
    new = torch.tensor([[LN2, -LN2], [LN2, -LN2]], requires_grad=True)
    adv = torch.tensor([[1.0, 1.0], [-1.0, -1.0]])
    mask = torch.ones(2, 2)
    loss, metrics = pm.gmpo_loss(old, new, adv, mask, clip_ratio_low=0.2, clip_ratio_high=0.2)
    # A > 0: min(x, clip x) = (ln 1.2, -ln 2) -> r = √(1.2 · 0.5) = √0.6
    # A < 0: max(x, clip x) = (ln 2, ln 0.8) -> r = √(2 · 0.8) = √1.6
    # seq-mean-token-mean: (-√0.6 + √1.6) / 2
    close(loss, (-math.sqrt(0.6) + math.sqrt(1.6)) / 2)
    # clip active: sequence 1 token 1 (above), sequence 2 token 2 (below)
    close(metrics["pg_clipfrac"], 0.5)
    loss.backward()
    # d/d log π_t of -A·r (weight 1/4 per token, 2 tokens): -A·r/2 · 2 · 1/4 where unclipped
    close(new.grad, [[0.0, -math.sqrt(0.6) / 4], [math.sqrt(1.6) / 4, 0.0]])


def test_gmpo_matches_loop():
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
        pm.gmpo_loss, {"clip_ratio_low": eps_low, "clip_ratio_high": eps_high}, ref, "gmpo"
    )


def test_reinforce_by_hand():
    old = torch.zeros(1, 3)
    new = torch.tensor([[LN2, -LN2, float("nan")]], requires_grad=True)
    adv = torch.tensor([[1.0, -1.0, float("nan")]])
    mask = torch.tensor([[1, 1, 0]])
    loss, metrics = pm.reinforce_loss(old, new, adv, mask)
    # -A·ρ = (-2, 0.5), no clip -> -0.75; gradient -A·ρ / 2 = (-1, 0.25)
    close(loss, -0.75)
    close(metrics["pg_clipfrac"], 0.0)
    loss.backward()
    close(new.grad, [[-1.0, 0.25, 0.0]])


def test_reinforce_matches_loop():
    def ref(old, new, adv, mask):
        values = [
            -a * math.exp(n - o) if m else 0.0
            for o, n, a, m in zip(old, new, adv, mask, strict=True)
        ]
        return values, values  # d(-A·e^{x})/dx = -A·e^{x}

    check_policy_loss(pm.reinforce_loss, {}, ref, "reinforce")


def cov_batch():
    # A = (1, 1, -1, -1), log π = (-1, -3, -1, -3.5): mean A = 0, mean log π = -2.125
    # Cov = A·(log π + 2.125) = (1.125, -0.875, -1.125, 1.375)
    logprob = torch.tensor([[-1.0, -3.0, -1.0, -3.5, 0.0]], requires_grad=True)
    adv = torch.tensor([[1.0, 1.0, -1.0, -1.0, float("nan")]])
    mask = torch.tensor([[1, 1, 1, 1, 0]])
    return logprob, adv, mask


def test_clip_cov_by_hand():
    logprob, adv, mask = cov_batch()
    old = logprob.detach().clone()  # ρ = 1: the ε clip is inactive
    # eligible: Cov in (1, 5) -> tokens 0 and 3; fraction 0.5 of 4 tokens -> both picked
    loss, metrics = pm.clip_cov_loss(old, logprob, adv, mask, cov_fraction=0.5, cov_low=1.0)
    # -A·ρ = (-1, -1, 1, 1) with tokens 0 and 3 zeroed -> token mean 0
    close(loss, 0.0)
    close(metrics["pg_cov_frac"], 0.5)
    loss.backward()
    close(logprob.grad, [[0.0, -0.25, 0.25, 0.0, 0.0]])
    # fraction 0.25 -> one token, at random among the eligible 0 and 3
    loss, metrics = pm.clip_cov_loss(old, logprob, adv, mask, cov_fraction=0.25)
    close(metrics["pg_cov_frac"], 0.25)
    assert float(loss.detach()) in (
        0.25,
        -0.25,
    )  # token 0 (-1) or token 3 (+1) left out of (-1-1+1+1)


def test_kl_cov_by_hand():
    logprob, adv, mask = cov_batch()
    old = logprob.detach() - torch.tensor([[0.1, 0.2, 0.3, 0.4, 0.0]])
    loss, metrics = pm.kl_cov_loss(old, logprob, adv, mask, cov_fraction=0.25, kl_cov_coef=2.0)
    # top-1 Cov is token 3 (1.375): it pays 2·|0.4|; all pay -A·e^{log ρ}
    values = [-math.exp(0.1), -math.exp(0.2), math.exp(0.3), math.exp(0.4) + 0.8]
    close(loss, sum(values) / 4)
    close(metrics["pg_cov_frac"], 0.25)
    loss.backward()
    close(
        logprob.grad,
        [[-math.exp(0.1) / 4, -math.exp(0.2) / 4, math.exp(0.3) / 4, (math.exp(0.4) + 2) / 4, 0]],
    )


def ref_covariance(adv, logprob, mask):
    valid = [
        (a, lp)
        for ra, rl, rm in zip(adv, logprob, mask, strict=True)
        for a, lp, m in zip(ra, rl, rm, strict=True)
        if m
    ]
    mean_a = sum(a for a, _ in valid) / len(valid)
    mean_l = sum(lp for _, lp in valid) / len(valid)
    return [
        [(a - mean_a) * (lp - mean_l) if m else 0.0 for a, lp, m in zip(ra, rl, rm, strict=True)]
        for ra, rl, rm in zip(adv, logprob, mask, strict=True)
    ]


def test_clip_cov_matches_loop():
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
        loss, metrics = pm.clip_cov_loss(
            old,
            new,
            adv,
            mask,
            cov_fraction=fraction,
            cov_low=cov_low,
            cov_high=cov_high,
            generator=torch.Generator().manual_seed(seed),
        )
        expected = pm.aggregate_loss(torch.tensor(losses, dtype=torch.float64), mask, "token-mean")
        torch.testing.assert_close(loss, expected, msg=f"{seed} {kind}")
        picked = min(k, len(eligible)) / sum(map(sum, m))
        close(metrics["pg_cov_frac"], picked)


def test_kl_cov_matches_loop():
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
            loss, _ = pm.kl_cov_loss(
                old, new, adv, mask, cov_fraction=fraction, kl_cov_coef=coef, loss_agg_mode=mode
            )
            loss.backward()
            value, grad = ref_loss_and_grad(losses, grads, m, mode)
            where = f"{seed} {kind} {mode}"
            torch.testing.assert_close(
                loss.detach(), torch.tensor(value, dtype=torch.float64), msg=where
            )
            torch.testing.assert_close(new.grad, torch.tensor(grad, dtype=torch.float64), msg=where)


def test_new_losses_keep_padding_out_of_gradients():
    old, new, adv = policy_batch(
        torch.Generator().manual_seed(0), make_mask("gaps", torch.Generator())
    )
    mask = ~torch.isnan(adv)
    new_garbage = new.detach().clone()
    new_garbage[~mask] = float("inf")
    new_garbage.requires_grad_()
    for name in pm.POLICY_LOSSES:
        new_garbage.grad = None
        loss, metrics = pm.get_policy_loss(name)(old, new_garbage, adv, mask)
        loss.backward()
        assert torch.isfinite(loss), name
        assert torch.isfinite(new_garbage.grad).all(), name
        assert (new_garbage.grad[~mask] == 0).all(), name
        assert all(torch.isfinite(v) for v in metrics.values()), name


def test_policy_loss_registry_passes_each_loss_its_knobs():
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
        "vanilla": pm.policy_loss(*args, **clip, clip_ratio_dual=2.0),
        "gspo": pm.gspo_loss(*args, **clip),
        "cispo": pm.cispo_loss(*args, **clip),
        "gmpo": pm.gmpo_loss(*args, **clip),
        "clip_cov": pm.clip_cov_loss(
            *args,
            **clip,
            cov_fraction=0.3,
            cov_low=-1.0,
            cov_high=3.0,
            generator=torch.Generator().manual_seed(9),
        ),
        "kl_cov": pm.kl_cov_loss(
            *args, cov_fraction=0.2, kl_cov_coef=0.5, loss_agg_mode="seq-mean-token-mean"
        ),
        "reinforce": pm.reinforce_loss(*args, loss_agg_mode="seq-mean-token-mean"),
        "sapo": pm.sapo_loss(*args, tau_pos=1.5, tau_neg=2.5, loss_agg_mode="seq-mean-token-mean"),
        "dppo_tv": pm.dppo_tv_loss(*args, **clip, max_ratio=1.7),
        "dppo_kl": pm.dppo_kl_loss(*args, **clip, max_ratio=1.7),
    }
    assert list(expected) == list(pm.POLICY_LOSSES)
    for name, (exp_loss, exp_metrics) in expected.items():
        loss, metrics = pm.get_policy_loss(name)(
            *args, **knobs, generator=torch.Generator().manual_seed(9)
        )
        torch.testing.assert_close(loss, exp_loss, msg=name)
        assert metrics.keys() == exp_metrics.keys(), name
    with pytest.raises(
        ValueError, match=r"unknown policy loss 'ppo'; valid choices: vanilla, gspo"
    ):
        pm.get_policy_loss("ppo")


def test_new_policy_loss_errors():
    x = torch.zeros(2, 3)
    ones = torch.ones(2, 3)
    for fn in (pm.gspo_loss, pm.cispo_loss, pm.gmpo_loss, pm.clip_cov_loss):
        with pytest.raises(ValueError, match="clip_ratio_low must be in"):
            fn(x, x, x, ones, clip_ratio_low=1.0)
    for fn in pm.POLICY_LOSSES.values():
        with pytest.raises(ValueError, match="advantages has shape"):
            fn(x, x, torch.zeros(2, 4), ones)
    with pytest.raises(ValueError, match="cov_low must be < cov_high"):
        pm.clip_cov_loss(x, x, x, ones, cov_low=5.0, cov_high=1.0)
    with pytest.raises(ValueError, match="kl_cov_coef must be >= 0"):
        pm.kl_cov_loss(x, x, x, ones, kl_cov_coef=-1.0)
    with pytest.raises(ValueError, match=r"cov_fraction must be in \[0, 1\]"):
        pm.kl_cov_loss(x, x, x, ones, cov_fraction=2.0)


# ----------------------------------------- pass@k, GDPO, ReMax, rollout correction


def ref_passk(scores, group_ids, normalize_by_std, singleton_groups="zero", eps=1e-6):
    out = [0.0] * len(scores)
    for members in ref_groups(scores, group_ids).values():
        if len(members) == 1:
            out[members[0]] = ref_singleton(0.0, scores[members[0]], singleton_groups)
            continue
        values = [scores[i] for i in members]
        best = members[values.index(max(values))]  # first row holding the maximum
        second = max(scores[i] for i in members if i != best)
        gap = scores[best] - second
        if normalize_by_std:
            mean = sum(values) / len(values)
            std = math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1))
            gap = gap / (std + eps)
        out[best] = gap
    return out


def test_grpo_passk_by_hand():
    scores = torch.tensor([1.0, 0.0, 0.5, 1.0, 1.0, 0.3])
    group_ids = torch.tensor([4, 4, 4, 9, 9, 2])
    mask = torch.ones(6, 1)
    # group 4: best row 0 (1.0), runner-up 0.5 -> gap 0.5; std of (1, 0, 0.5) = 0.5 -> 1
    # group 9: tie at 1.0 -> row 3 is the best, gap 0; group 2 is a singleton -> 0
    # (a tied best group has std 0 too when all its scores are equal: eps keeps it 0)
    close(
        pm.grpo_passk_advantages(scores, group_ids, mask),
        [[1.0], [0.0], [0.0], [0.0], [0.0], [0.0]],
    )
    close(
        pm.grpo_passk_advantages(scores, group_ids, mask, normalize_by_std=False),
        [[0.5], [0.0], [0.0], [0.0], [0.0], [0.0]],
    )
    adv = pm.grpo_passk_advantages(scores, group_ids, mask, singleton_groups="score")
    close(adv[5], [0.3])


def test_grpo_passk_matches_loop():
    for seed in range(6):
        scores, group_ids, mask = random_group_batch(seed)
        for norm in (True, False):
            for singleton in pm.SINGLETON_GROUP_CHOICES:
                adv = pm.grpo_passk_advantages(
                    scores, group_ids, mask, normalize_by_std=norm, singleton_groups=singleton
                )
                expected = ref_passk(scores.tolist(), group_ids.tolist(), norm, singleton)
                torch.testing.assert_close(
                    adv,
                    torch.tensor(spread(expected, mask.tolist()), dtype=torch.float64),
                    msg=f"{seed} {norm} {singleton}",
                )


def test_gdpo_by_hand():
    # one group of 4 and two kinds, weighted 2:1: (1,0) (0,1) (1,1) (0,0)
    components = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0], [0.0, 0.0]])
    weights = torch.tensor([2.0, 1.0])
    group_ids = torch.zeros(4, dtype=torch.int64)
    mask = torch.ones(4, 1)
    # each kind: mean 0.5, unbiased std √(1/3) -> ±0.5·√3 = ±√3/2 (eps 0 for exactness)
    h = math.sqrt(3) / 2
    combined = [2 * h - h, -2 * h + h, 2 * h + h, -2 * h - h]  # (h, -h, 3h, -3h)
    mean = sum(combined) / 4
    std = math.sqrt(sum((c - mean) ** 2 for c in combined) / 3)
    expected = [[(c - mean) / math.sqrt(std**2 + 1e-8)] for c in combined]
    close(pm.gdpo_advantages(components, weights, group_ids, mask, eps=0.0), expected)
    with pytest.raises(ValueError, match="component_weights"):
        pm.gdpo_advantages(components, torch.ones(3), group_ids, mask)


def test_gdpo_matches_loop():
    for seed in range(6):
        scores, group_ids, mask = random_group_batch(seed)
        gen = torch.Generator().manual_seed(100 + seed)
        components = torch.stack(
            [scores, torch.randint(0, 2, scores.shape, generator=gen).to(torch.float64)], dim=1
        )
        weights = torch.tensor([1.0, 0.5], dtype=torch.float64)
        for singleton in pm.SINGLETON_GROUP_CHOICES:
            combined = [0.0] * len(scores)
            for k in range(2):
                column = components[:, k].tolist()
                per_kind = ref_grpo(column, group_ids.tolist(), True)
                for members in ref_groups(column, group_ids.tolist()).values():
                    if len(members) == 1:
                        i = members[0]
                        per_kind[i] = ref_singleton(0.0, column[i], singleton)
                combined = [
                    c + float(weights[k]) * a for c, a in zip(combined, per_kind, strict=True)
                ]
            expected = ref_whiten(spread(combined, mask.tolist()), mask.tolist())
            adv = pm.gdpo_advantages(
                components, weights, group_ids, mask, singleton_groups=singleton
            )
            torch.testing.assert_close(
                adv, torch.tensor(expected, dtype=torch.float64), msg=f"{seed} {singleton}"
            )


def test_remax_by_hand():
    rewards = torch.tensor([[0.1, 0.0, 1.0], [0.0, 0.5, 0.0]])
    mask = torch.tensor([[1, 0, 1], [1, 1, 0]])  # a gap in row 0, right padding in row 1
    baseline = torch.tensor([0.25, 1.0])
    adv, returns = pm.remax_advantages(rewards, baseline, mask)
    # row 0 returns-to-go: 0.1 + 1.0 = 1.1 at t0, 1.0 at t2; row 1: 0.5, 0.5
    close(returns, [[1.1, 0.0, 1.0], [0.5, 0.5, 0.0]])
    close(adv, [[0.85, 0.0, 0.75], [-0.5, -0.5, 0.0]])
    with pytest.raises(ValueError, match="baseline_scores"):
        pm.remax_advantages(rewards, torch.ones(3), mask)


def test_remax_matches_loop():
    for seed, kind, gen, mask in all_masks():
        rewards = torch.randn(mask.shape, generator=gen, dtype=torch.float64)
        rewards[~mask] = float("nan")
        baseline = torch.randn(mask.shape[0], generator=gen, dtype=torch.float64)
        adv, returns = pm.remax_advantages(rewards, baseline, mask)
        exp_adv, exp_ret = [], []
        for row, mrow, b in zip(rewards.tolist(), mask.tolist(), baseline.tolist(), strict=True):
            running, ret_row = 0.0, [0.0] * len(row)
            for t in reversed(range(len(row))):
                if mrow[t]:
                    running += row[t]
                    ret_row[t] = running
            exp_ret.append(ret_row)
            exp_adv.append([r - b if m else 0.0 for r, m in zip(ret_row, mrow, strict=True)])
        where = f"seed={seed} {kind}"
        torch.testing.assert_close(returns, torch.tensor(exp_ret, dtype=torch.float64), msg=where)
        torch.testing.assert_close(adv, torch.tensor(exp_adv, dtype=torch.float64), msg=where)


def test_truncated_is_weights_by_hand():
    old = torch.tensor([[math.log(0.5), math.log(0.9), 0.0]])
    rollout = torch.tensor([[math.log(0.25), math.log(0.9), float("nan")]])
    mask = torch.tensor([[1, 1, 0]])
    weights, metrics = pm.truncated_is_weights(old, rollout, mask, cap=1.5)
    # ratios 2 (capped at 1.5) and 1; padding 0
    close(weights, [[1.5, 1.0, 0.0]])
    close(metrics["is_weight_mean"], 1.5)
    close(metrics["capped_fraction"], 0.5)
    close(metrics["mismatch_kl"], -LN2 / 2)
    with pytest.raises(ValueError, match="cap"):
        pm.truncated_is_weights(old, rollout, mask, cap=0.0)


def test_truncated_is_weights_match_loop():
    for seed, kind, gen, mask in all_masks():
        old, rollout, _ = policy_batch(gen, mask)
        weights, _ = pm.truncated_is_weights(old, rollout, mask, cap=1.3)
        expected = [
            [min(math.exp(o - r), 1.3) if m else 0.0 for o, r, m in zip(ro, rr, rm, strict=True)]
            for ro, rr, rm in zip(
                old.tolist(), rollout.detach().tolist(), mask.tolist(), strict=True
            )
        ]
        torch.testing.assert_close(
            weights, torch.tensor(expected, dtype=torch.float64), msg=f"seed={seed} {kind}"
        )


# ----------------------------------------------------------- SAPO and DPPO losses


def test_sapo_by_hand():
    old = torch.zeros(1, 3)
    new = torch.tensor([[0.0, LN2, float("nan")]], requires_grad=True)
    adv = torch.tensor([[1.0, -1.0, float("nan")]])
    mask = torch.tensor([[1, 1, 0]])
    loss, metrics = pm.sapo_loss(old, new, adv, mask, tau_pos=1.0, tau_neg=2.0)
    # token 0: ρ = 1 -> gate (4/1)·σ(0) = 2, loss -2; token 1: ρ = 2, τ 2 -> 2·σ(2), loss +2σ(2)
    sig2 = 1 / (1 + math.exp(-2))
    close(loss, (-2 + 2 * sig2) / 2)
    close(metrics["pg_clipfrac"], 0.0)
    loss.backward()
    # d/d log π = -A·4σ(1-σ)·ρ, weight 1/2: token 0 -> -1·1·1/2; token 1 -> 4σ(2)(1-σ(2))·2/2
    close(new.grad, [[-0.5, 4 * sig2 * (1 - sig2), 0.0]])
    with pytest.raises(ValueError, match="tau"):
        pm.sapo_loss(old, new, adv, mask, tau_pos=0.0)


def test_sapo_matches_loop():
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

    check_policy_loss(pm.sapo_loss, {"tau_pos": tau_pos, "tau_neg": tau_neg}, ref, "sapo")


def test_dppo_tv_by_hand():
    old = torch.log(torch.tensor([[0.5, 0.5, 0.5, 0.1]]))
    new = torch.log(torch.tensor([[0.6, 0.8, 0.2, 0.45]])).requires_grad_()
    adv = torch.tensor([[1.0, 1.0, -1.0, 1.0]])
    mask = torch.ones(1, 4)
    loss, metrics = pm.dppo_tv_loss(
        old, new, adv, mask, clip_ratio_low=0.2, clip_ratio_high=0.2, max_ratio=4.0
    )
    # changes +0.1 (inside), +0.3 (outside, A > 0), -0.3 (outside, A < 0), +0.35 (outside)
    # only token 0 trains: weight ρ = 1.2 -> loss -1.2 / 4
    close(loss, -0.3)
    close(metrics["pg_clipfrac"], 0.75)
    loss.backward()
    close(new.grad, [[-0.3, 0.0, 0.0, 0.0]])
    # a wider region lets token 3 in; its ratio 4.5 is capped at 4
    loss, metrics = pm.dppo_tv_loss(
        old, new, adv, mask, clip_ratio_low=0.2, clip_ratio_high=0.4, max_ratio=4.0
    )
    close(loss, (-1.2 - 1.6 - 4.0) / 4)
    close(metrics["pg_clipfrac_lower"], 0.25)


def test_dppo_tv_matches_loop():
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

    kwargs = {"clip_ratio_low": low, "clip_ratio_high": high, "max_ratio": cap}
    check_policy_loss(pm.dppo_tv_loss, kwargs, ref, "dppo_tv", probabilities=True)


def ref_binary_kl(p_old, p):
    return p_old * math.log(p_old / p) + (1 - p_old) * math.log((1 - p_old + 1e-8) / (1 - p + 1e-8))


def test_dppo_kl_by_hand():
    old = torch.log(torch.tensor([[0.5, 0.5, 0.5]]))
    new = torch.log(torch.tensor([[0.6, 0.9, 0.1]])).requires_grad_()
    adv = torch.tensor([[1.0, 1.0, 1.0]])
    mask = torch.ones(1, 3)
    loss, metrics = pm.dppo_kl_loss(old, new, adv, mask, clip_ratio_low=0.1, clip_ratio_high=0.1)
    # D(0.5‖0.6) ≈ 0.0204 inside; D(0.5‖0.9) ≈ 0.511 outside; p 0.1 < p_old: against
    # the push, inside whatever D (ratio 0.2)
    assert ref_binary_kl(0.5, 0.6) < 0.1 < ref_binary_kl(0.5, 0.9)
    close(loss, (-1.2 - 0.2) / 3)
    close(metrics["pg_clipfrac"], 1 / 3)
    loss.backward()
    close(new.grad, [[-0.4, 0.0, -0.2 / 3]])


def test_dppo_kl_matches_loop():
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

    kwargs = {"clip_ratio_low": low, "clip_ratio_high": high, "max_ratio": cap}
    check_policy_loss(pm.dppo_kl_loss, kwargs, ref, "dppo_kl", probabilities=True)


def test_registry_uses_each_loss_default_clip_range():
    gen = torch.Generator().manual_seed(0)
    mask = make_mask("right_padded", gen)
    old, new, adv = policy_batch(gen, mask)
    for name, (low, high) in pm.DEFAULT_CLIP_RATIOS.items():
        by_default, _ = pm.get_policy_loss(name)(old, new, adv, mask)
        explicit, _ = pm.get_policy_loss(name)(
            old, new, adv, mask, clip_ratio_low=low, clip_ratio_high=high
        )
        torch.testing.assert_close(by_default, explicit, msg=name)
    assert pm.resolve_clip_ratios("gspo", None, 0.01) == (3e-4, 0.01)
    assert pm.resolve_clip_ratios("sapo", None, None) == (0.2, 0.2)


# ------------------------------------------------------ mini-batch normalisation


def test_mini_batch_loss_scale_by_hand():
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])  # 3 tokens, 2 sequences
    scale = functools.partial(
        pm.mini_batch_loss_scale, mini_batch_tokens=12, mini_batch_sequences=8
    )
    # 2 ranks × 2 micro-batches average 4 losses: 3/12 of the tokens -> 3/12 · 4 = 1
    close(scale(mask, "token-mean", ranks=2, accumulation_steps=2), 1.0)
    # 2 of 8 sequences, averaged over 4 -> 1
    close(scale(mask, "seq-mean-token-mean", ranks=2, accumulation_steps=2), 1.0)
    close(scale(mask, "seq-mean-token-sum-norm", ranks=1, accumulation_steps=2), 0.5)
    close(scale(mask, "token-sum", ranks=2, accumulation_steps=3), 6.0)
    with pytest.raises(ValueError, match="mini_batch_tokens"):
        pm.mini_batch_loss_scale(
            mask,
            "token-mean",
            mini_batch_tokens=0,
            mini_batch_sequences=1,
            ranks=1,
            accumulation_steps=1,
        )


def test_mini_batch_loss_scale_makes_the_loss_independent_of_the_split():
    """Σ over ranks and micro-batches of scale · loss / (ranks · steps), what the engine
    backpropagates, equals the loss of the whole mini-batch, value and gradient."""
    for seed in SEEDS:
        for kind in MASK_KINDS[:3]:  # every row holds a token
            gen = torch.Generator().manual_seed(seed)
            mask = make_mask(kind, gen, batch=8, length=6)
            for mode in pm.LOSS_AGG_MODES:
                for ranks, steps in ((1, 1), (1, 4), (2, 2), (4, 2)):
                    values = torch.randn(8, 6, generator=gen, dtype=torch.float64)
                    values.requires_grad_()
                    whole = pm.aggregate_loss(values, mask, mode)
                    (expected_grad,) = torch.autograd.grad(whole, values)
                    tokens, sequences = float(mask.sum()), float(mask.any(dim=1).sum())
                    rows = 8 // (ranks * steps)
                    total = torch.zeros((), dtype=torch.float64)
                    for piece in range(ranks * steps):
                        part = slice(piece * rows, (piece + 1) * rows)
                        scale = pm.mini_batch_loss_scale(
                            mask[part],
                            mode,
                            mini_batch_tokens=tokens,
                            mini_batch_sequences=sequences,
                            ranks=ranks,
                            accumulation_steps=steps,
                        )
                        loss = pm.aggregate_loss(values[part], mask[part], mode, norm_tokens=6)
                        total = total + scale * loss / (ranks * steps)
                    (grad,) = torch.autograd.grad(total, values)
                    where = f"seed={seed} {kind} {mode} ranks={ranks} steps={steps}"
                    torch.testing.assert_close(total, whole.detach(), msg=where)
                    torch.testing.assert_close(grad, expected_grad, msg=where)


# -------------------------------------------------------- optimal token baseline


def ref_otb(rewards, mask, group_ids, old, squares, weights, singleton_groups, eps=1e-8):
    """Per group and position: B_t = Σ G·W / Σ W over the group's rows holding token t."""
    rows, width = len(rewards), len(rewards[0])
    returns = [[0.0] * width for _ in range(rows)]
    path = [[0.0] * width for _ in range(rows)]
    for b in range(rows):
        running = 0.0
        for t in reversed(range(width)):
            if mask[b][t]:
                running += rewards[b][t]
                returns[b][t] = running
        accumulated = 0.0
        for t in range(width):
            if mask[b][t]:
                w = weights[b][t] ** 2 if weights is not None else 1.0
                accumulated += (1 - 2 * math.exp(old[b][t]) + squares[b][t]) * w
                path[b][t] = accumulated
    advantages = [[0.0] * width for _ in range(rows)]
    for members in ref_groups(list(range(rows)), group_ids).values():
        for t in range(width):
            holding = [i for i in members if mask[i][t]]
            numerator = sum(returns[i][t] * path[i][t] for i in holding)
            denominator = sum(path[i][t] for i in holding) + eps
            for i in holding:
                if len(members) == 1:
                    advantages[i][t] = returns[i][t] if singleton_groups == "score" else 0.0
                else:
                    advantages[i][t] = returns[i][t] - numerator / denominator
    return advantages, returns


def test_optimal_token_baseline_by_hand():
    # one group of two one-token responses: π = 0.5 and 0.25, Σπ² = 0.5 and 0.25
    # W = 1 - 2π + Σπ² = 0.5 and 0.75; returns 1 and 0
    rewards = torch.tensor([[1.0], [0.0]])
    mask = torch.ones(2, 1)
    old = torch.log(torch.tensor([[0.5], [0.25]]))
    squares = torch.tensor([[0.5], [0.25]])
    adv, returns = pm.optimal_token_baseline_advantages(
        rewards, mask, torch.tensor([3, 3]), old, squares, eps=0.0
    )
    # B = (1·0.5 + 0·0.75) / 1.25 = 0.4
    close(adv, [[0.6], [-0.4]])
    close(returns, [[1.0], [0.0]])
    # importance weights 2 and 1 scale W by w²: W = 2 and 0.75 -> B = 2 / 2.75
    adv, _ = pm.optimal_token_baseline_advantages(
        rewards, mask, torch.tensor([3, 3]), old, squares, torch.tensor([[2.0], [1.0]]), eps=0.0
    )
    close(adv, [[1 - 2 / 2.75], [-2 / 2.75]])


def test_optimal_token_baseline_matches_loop():
    for seed in range(6):
        _, group_ids, mask = random_group_batch(seed)
        gen = torch.Generator().manual_seed(50 + seed)
        rewards = torch.randn(mask.shape, generator=gen, dtype=torch.float64)
        old = -torch.rand(mask.shape, generator=gen, dtype=torch.float64) * 2
        squares = torch.rand(mask.shape, generator=gen, dtype=torch.float64)
        weights = torch.rand(mask.shape, generator=gen, dtype=torch.float64) * 2
        for t in (rewards, old, squares, weights):
            t[~mask.bool()] = float("nan")
        for token_weights in (None, weights):
            for singleton in pm.SINGLETON_GROUP_CHOICES:
                adv, returns = pm.optimal_token_baseline_advantages(
                    rewards, mask, group_ids, old, squares, token_weights, singleton
                )
                exp_adv, exp_ret = ref_otb(
                    rewards.tolist(),
                    mask.tolist(),
                    group_ids.tolist(),
                    old.tolist(),
                    squares.tolist(),
                    None if token_weights is None else weights.tolist(),
                    singleton,
                )
                where = f"seed={seed} weights={token_weights is not None} {singleton}"
                torch.testing.assert_close(
                    returns, torch.tensor(exp_ret, dtype=torch.float64), msg=where
                )
                torch.testing.assert_close(
                    adv, torch.tensor(exp_adv, dtype=torch.float64), msg=where
                )
