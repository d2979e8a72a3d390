"""Tests for rlserve.core.algos.advantages: the advantage estimators.

Tiny tensors whose expected values are worked out by hand in the comments, and
"fast version equals the obvious version" checks against plain Python loops
(the shared mask layouts, prompt groups and references are conftest.py's fixtures).
"""

from __future__ import annotations

import math

import pytest
import torch

from rlserve.core.algos.advantages import (
    SINGLETON_GROUP_CHOICES,
    compute_gae_advantages_returns,
    gdpo_advantages,
    gpg_advantages,
    grpo_advantages,
    grpo_passk_advantages,
    opo_advantages,
    optimal_token_baseline_advantages,
    reinforce_plus_plus_advantages,
    reinforce_plus_plus_baseline_advantages,
    remax_advantages,
    rloo_advantages,
)


def by_score(estimator, scores, group_ids, mask, **knobs):
    """An outcome estimator's advantages for one score per row, as the cases below are
    stated: each score stands on its row's first response token (the estimator scores a
    row by the masked sum of its token rewards)."""
    if not mask.bool().any(dim=1).all():
        raise ValueError("each row needs a response token to carry its score")
    rewards = torch.zeros(mask.shape, dtype=scores.dtype)
    rewards[torch.arange(len(scores)), mask.bool().int().argmax(dim=1)] = scores
    advantages, _ = estimator(rewards, mask, group_ids=group_ids, **knobs)
    return advantages


def gdpo(components, weights, group_ids, mask, **knobs):
    """GDPO's advantages for the reward kinds ``components`` (it reads no token reward)."""
    unread = torch.zeros(mask.shape, dtype=components.dtype)
    advantages, _ = gdpo_advantages(
        unread,
        mask,
        reward_components=components,
        component_weights=weights,
        group_ids=group_ids,
        **knobs,
    )
    return advantages


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


def test_gae_by_hand(close):
    rewards = torch.tensor([[0.0, 0.0, 1.0]])
    values = torch.tensor([[0.5, 0.6, 0.7]])
    mask = torch.ones(1, 3)
    adv, ret = compute_gae_advantages_returns(
        rewards, mask, values=values, gamma=0.9, lam=0.8, whiten_advantages=False
    )
    # t=2: δ = 1 + 0 - 0.7 = 0.3;              A2 = 0.3
    # t=1: δ = 0 + 0.9*0.7 - 0.6 = 0.03;       A1 = 0.03 + 0.72*0.3 = 0.246
    # t=0: δ = 0 + 0.9*0.6 - 0.5 = 0.04;       A0 = 0.04 + 0.72*0.246 = 0.21712
    close(adv, [[0.21712, 0.246, 0.3]])
    # returns = A + V
    close(ret, [[0.71712, 0.846, 1.0]])


def test_gae_skips_gaps_by_hand(close):
    # the middle token is outside the mask: its reward (99) and value (99) must not count
    rewards = torch.tensor([[0.0, 99.0, 1.0, 5.0]])
    values = torch.tensor([[0.5, 99.0, 0.7, float("nan")]])
    mask = torch.tensor([[1, 0, 1, 0]])
    adv, ret = compute_gae_advantages_returns(
        rewards, mask, values=values, gamma=0.9, lam=0.8, whiten_advantages=False
    )
    # t=2: A = 1 - 0.7 = 0.3 (next valid token: none)
    # t=0: next valid value is V2 = 0.7: δ = 0.9*0.7 - 0.5 = 0.13; A = 0.13 + 0.72*0.3 = 0.346
    close(adv, [[0.346, 0.0, 0.3, 0.0]])
    close(ret, [[0.846, 0.0, 1.0, 0.0]])


def test_gae_matches_loop(all_masks, ref_whiten):
    for seed, kind, gen, mask in all_masks():
        rewards = torch.randn(mask.shape, generator=gen, dtype=torch.float64)
        values = torch.randn(mask.shape, generator=gen, dtype=torch.float64)
        gamma, lam = [(1.0, 0.95), (0.99, 1.0), (0.9, 0.0)][seed]
        adv, ret = compute_gae_advantages_returns(
            rewards, mask, values=values, gamma=gamma, lam=lam, whiten_advantages=False
        )
        ref_adv, ref_ret = ref_gae(rewards.tolist(), values.tolist(), mask.tolist(), gamma, lam)
        msg = f"seed={seed} kind={kind}"
        torch.testing.assert_close(adv, torch.tensor(ref_adv, dtype=torch.float64), msg=msg)
        torch.testing.assert_close(ret, torch.tensor(ref_ret, dtype=torch.float64), msg=msg)
        white, ret2 = compute_gae_advantages_returns(
            rewards, mask, values=values, gamma=gamma, lam=lam
        )
        torch.testing.assert_close(
            white, torch.tensor(ref_whiten(ref_adv, mask.tolist()), dtype=torch.float64), msg=msg
        )
        torch.testing.assert_close(ret2, ret, msg=msg)  # returns are never whitened


def test_gae_carries_no_grad():
    values = torch.randn(2, 3, requires_grad=True)
    adv, ret = compute_gae_advantages_returns(
        torch.randn(2, 3), torch.ones(2, 3), values=values, gamma=1.0, lam=1.0
    )
    assert not adv.requires_grad and not ret.requires_grad


def test_gae_errors():
    x = torch.zeros(2, 3)
    with pytest.raises(ValueError, match=r"gamma must be in \[0, 1\], got 1.5"):
        compute_gae_advantages_returns(x, x, values=x, gamma=1.5, lam=0.9)
    with pytest.raises(ValueError, match=r"lam must be in \[0, 1\], got -0.1"):
        compute_gae_advantages_returns(x, x, values=x, gamma=1.0, lam=-0.1)
    with pytest.raises(ValueError, match="values has shape"):
        compute_gae_advantages_returns(x, x, values=torch.zeros(2, 4), gamma=1.0, lam=1.0)
    with pytest.raises(ValueError, match=r"token_rewards must have shape \(B, T\)"):
        compute_gae_advantages_returns(
            torch.zeros(3), torch.ones(3), values=torch.zeros(3), gamma=1.0, lam=1.0
        )


def ref_groups(scores, group_ids):
    """Plain dict of group id -> list of sample indices."""
    groups: dict[int, list[int]] = {}
    for i, g in enumerate(group_ids):
        groups.setdefault(g, []).append(i)
    return groups


def ref_grpo(scores, group_ids, norm_adv_by_std_in_grpo, eps=1e-6):
    out = [0.0] * len(scores)
    for members in ref_groups(scores, group_ids).values():
        if len(members) == 1:
            continue
        vals = [scores[i] for i in members]
        mean = sum(vals) / len(vals)
        std = math.sqrt(sum((v - mean) ** 2 for v in vals) / (len(vals) - 1))
        for i in members:
            out[i] = (
                (scores[i] - mean) / (std + eps) if norm_adv_by_std_in_grpo else scores[i] - mean
            )
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


def ref_singleton(value, score, singleton_groups):
    return score if singleton_groups == "score" else value


def spread(per_seq, mask):
    """(B,) list -> (B, T) list, value on valid tokens, 0 elsewhere."""
    return [[per_seq[b] if m else 0.0 for m in mask[b]] for b in range(len(per_seq))]


def test_grpo_by_hand(close):
    scores = torch.tensor([1.0, 0.0, 1.0, 0.5])
    group_ids = torch.tensor([7, 7, 7, 3])
    mask = torch.tensor([[1, 1], [1, 0], [0, 1], [1, 1]])
    adv = by_score(grpo_advantages, scores, group_ids, mask, eps=0.0)
    # group 7: mean 2/3, deviations (1/3, -2/3, 1/3), unbiased var (1/9+4/9+1/9)/2 = 1/3
    # std = 0.57735 -> (0.57735, -1.1547, 0.57735); group 3 is a singleton -> 0
    s = 1 / math.sqrt(3)
    close(adv, [[s, s], [-2 * s, 0.0], [0.0, s], [0.0, 0.0]], atol=1e-5)
    # without std: (1/3, -2/3, 1/3), singleton 0
    adv = by_score(grpo_advantages, scores, group_ids, mask, norm_adv_by_std_in_grpo=False)
    close(adv, [[1 / 3, 1 / 3], [-2 / 3, 0.0], [0.0, 1 / 3], [0.0, 0.0]])


def test_grpo_equal_scores_give_zero_not_nan(close):
    adv = by_score(
        grpo_advantages,
        torch.tensor([1.0, 1.0, 1.0]),
        torch.zeros(3, dtype=torch.long),
        torch.ones(3, 2),
    )
    close(adv, torch.zeros(3, 2))


def test_grpo_matches_loop(random_group_batch):
    for seed in range(6):
        scores, group_ids, mask = random_group_batch(seed)
        for norm in (True, False):
            adv = by_score(grpo_advantages, scores, group_ids, mask, norm_adv_by_std_in_grpo=norm)
            expected = spread(ref_grpo(scores.tolist(), group_ids.tolist(), norm), mask.tolist())
            torch.testing.assert_close(
                adv, torch.tensor(expected, dtype=torch.float64), msg=f"{seed} {norm}"
            )


def test_rloo_by_hand(close):
    scores = torch.tensor([1.0, 0.0, 1.0, 0.5])
    group_ids = torch.tensor([7, 7, 7, 3])
    mask = torch.ones(4, 2)
    # 1 - mean(0, 1) = 0.5; 0 - mean(1, 1) = -1; 1 - mean(1, 0) = 0.5; singleton -> 0
    close(
        by_score(rloo_advantages, scores, group_ids, mask),
        [[0.5] * 2, [-1.0] * 2, [0.5] * 2, [0.0] * 2],
    )


def test_rloo_matches_loop(random_group_batch):
    for seed in range(6):
        scores, group_ids, mask = random_group_batch(seed)
        adv = by_score(rloo_advantages, scores, group_ids, mask)
        expected = spread(ref_rloo(scores.tolist(), group_ids.tolist()), mask.tolist())
        torch.testing.assert_close(adv, torch.tensor(expected, dtype=torch.float64), msg=str(seed))


def test_reinforce_plus_plus_baseline_by_hand(close):
    scores = torch.tensor([1.0, 0.0, 5.0])
    group_ids = torch.tensor([0, 0, 1])
    mask = torch.tensor([[1, 1], [1, 0], [1, 1]])
    # centred: (0.5, -0.5, 0 for the singleton) -> tokens 0.5, 0.5, -0.5, 0, 0
    # mean 0.1; deviations 0.4, 0.4, -0.6, -0.1, -0.1; unbiased var (0.16*2+0.36+0.02)/4 = 0.175
    sd = math.sqrt(0.175)
    expected = [[0.4 / sd, 0.4 / sd], [-0.6 / sd, 0.0], [-0.1 / sd, -0.1 / sd]]
    close(
        by_score(reinforce_plus_plus_baseline_advantages, scores, group_ids, mask),
        expected,
        atol=1e-5,
    )


def test_reinforce_plus_plus_baseline_matches_loop(ref_whiten, random_group_batch):
    for seed in range(6):
        scores, group_ids, mask = random_group_batch(seed)
        if seed % 2 == 0:
            scores += torch.arange(scores.numel(), dtype=torch.float64)  # avoid all-zero
        adv = by_score(reinforce_plus_plus_baseline_advantages, scores, group_ids, mask)
        centred = spread(ref_group_centred(scores.tolist(), group_ids.tolist()), mask.tolist())
        expected = ref_whiten(centred, mask.tolist())
        torch.testing.assert_close(adv, torch.tensor(expected, dtype=torch.float64), msg=str(seed))


def test_outcome_advantage_errors():
    rewards, mask = torch.zeros(3, 2), torch.ones(3, 2)
    with pytest.raises(ValueError, match="group_ids must be an integer tensor"):
        grpo_advantages(rewards, mask, group_ids=torch.zeros(3))
    with pytest.raises(ValueError, match="group_ids has shape"):
        rloo_advantages(rewards, mask, group_ids=torch.zeros(2, dtype=torch.long))
    with pytest.raises(ValueError, match=r"token_rewards must have shape \(B, T\)"):
        grpo_advantages(torch.zeros(3), mask, group_ids=torch.zeros(3, dtype=torch.long))
    with pytest.raises(
        ValueError, match=r"response_mask has shape \(2, 2\) but token_rewards has shape \(3, 2\)"
    ):
        reinforce_plus_plus_baseline_advantages(
            rewards, torch.ones(2, 2), group_ids=torch.zeros(3, dtype=torch.long)
        )


def test_singleton_groups_score_by_hand(close, ref_whiten):
    scores = torch.tensor([1.0, 0.0, 0.5])
    group_ids = torch.tensor([7, 7, 3])  # group 3 is a singleton
    mask = torch.ones(3, 1)
    # the singleton keeps its raw score 0.5; the pair gets its usual advantages
    s = 1 / math.sqrt(0.5)  # GRPO: deviations ±0.5, unbiased std sqrt(0.5)
    close(
        by_score(grpo_advantages, scores, group_ids, mask, eps=0.0, singleton_groups="score"),
        [[0.5 * s], [-0.5 * s], [0.5]],
    )
    close(
        by_score(rloo_advantages, scores, group_ids, mask, singleton_groups="score"),
        [[1.0], [-1.0], [0.5]],
    )
    # REINFORCE++-baseline: centred (0.5, -0.5, 0.5): mean 1/6, whitened
    centred = [0.5, -0.5, 0.5]
    expected = ref_whiten([[c] for c in centred], [[True]] * 3)
    close(
        by_score(
            reinforce_plus_plus_baseline_advantages,
            scores,
            group_ids,
            mask,
            singleton_groups="score",
        ),
        expected,
    )
    with pytest.raises(ValueError, match="valid choices: zero, score"):
        by_score(grpo_advantages, scores, group_ids, mask, singleton_groups="raw")


def test_singleton_groups_match_loop(ref_whiten, random_group_batch):
    for seed in range(6):
        scores, group_ids, mask = random_group_batch(seed)
        s, g = scores.tolist(), group_ids.tolist()
        groups = ref_groups(s, g)
        singles = {members[0] for members in groups.values() if len(members) == 1}
        for norm in (True, False):
            expected = ref_grpo(s, g, norm)
            expected = [s[i] if i in singles else a for i, a in enumerate(expected)]
            adv = by_score(
                grpo_advantages,
                scores,
                group_ids,
                mask,
                norm_adv_by_std_in_grpo=norm,
                singleton_groups="score",
            )
            torch.testing.assert_close(
                adv, torch.tensor(spread(expected, mask.tolist()), dtype=torch.float64)
            )
        expected = [s[i] if i in singles else a for i, a in enumerate(ref_rloo(s, g))]
        adv = by_score(rloo_advantages, scores, group_ids, mask, singleton_groups="score")
        torch.testing.assert_close(
            adv, torch.tensor(spread(expected, mask.tolist()), dtype=torch.float64)
        )
        if seed % 2 == 0:
            continue  # whitening below needs scores that are not all equal
        centred = ref_group_centred(s, g)
        centred = [s[i] if i in singles else c for i, c in enumerate(centred)]
        expected = ref_whiten(spread(centred, mask.tolist()), mask.tolist())
        adv = by_score(
            reinforce_plus_plus_baseline_advantages,
            scores,
            group_ids,
            mask,
            singleton_groups="score",
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


def test_opo_by_hand(close):
    scores = torch.tensor([1.0, 0.0, 1.0, 0.5])
    group_ids = torch.tensor([7, 7, 7, 3])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0], [0, 0, 1], [1, 1, 1]])  # lengths 2, 1, 1, 3
    # group 7: b = (2·1 + 1·0 + 1·1) / (2 + 1 + 1) = 0.75 -> A = (0.25, -0.75, 0.25)
    # group 3 is a singleton: 0, or its score 0.5 under "score"
    close(
        by_score(opo_advantages, scores, group_ids, mask),
        [[0.25, 0.25, 0.0], [-0.75, 0.0, 0.0], [0.0, 0.0, 0.25], [0.0, 0.0, 0.0]],
    )
    adv = by_score(opo_advantages, scores, group_ids, mask, singleton_groups="score")
    close(adv[3], [0.5, 0.5, 0.5])


def test_opo_matches_loop(random_group_batch):
    for seed in range(6):
        scores, group_ids, mask = random_group_batch(seed)
        lengths = [sum(row) for row in mask.tolist()]
        for singleton in SINGLETON_GROUP_CHOICES:
            adv = by_score(opo_advantages, scores, group_ids, mask, singleton_groups=singleton)
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


def test_gpg_by_hand(close):
    scores = torch.tensor([1.0, 0.0, 1.0, 1.0, 0.3])
    group_ids = torch.tensor([1, 1, 2, 2, 3])
    mask = torch.ones(5, 1)
    # group 1: (0.5, -0.5); group 2 all equal -> 0; group 3 singleton -> 0
    # B = 5, M = 2 + 1 = 3 -> α = 5 / 2
    close(by_score(gpg_advantages, scores, group_ids, mask), [[1.25], [-1.25], [0.0], [0.0], [0.0]])
    # "score": the singleton keeps 0.3 and is valid: M = 2, α = 5 / 3
    close(
        by_score(gpg_advantages, scores, group_ids, mask, singleton_groups="score"),
        [[0.5 * 5 / 3], [-0.5 * 5 / 3], [0.0], [0.0], [0.3 * 5 / 3]],
    )
    # every group degenerate: all advantages 0 (α's divisor clamped, no division by 0)
    close(
        by_score(gpg_advantages, torch.ones(4), torch.tensor([0, 0, 1, 1]), torch.ones(4, 1)),
        torch.zeros(4, 1),
    )


def test_gpg_matches_loop(random_group_batch):
    for seed in range(6):
        scores, group_ids, mask = random_group_batch(seed)
        for singleton in SINGLETON_GROUP_CHOICES:
            adv = by_score(gpg_advantages, scores, group_ids, mask, singleton_groups=singleton)
            expected = ref_gpg(scores.tolist(), group_ids.tolist(), singleton)
            torch.testing.assert_close(
                adv,
                torch.tensor(spread(expected, mask.tolist()), dtype=torch.float64),
                msg=f"{seed} {singleton}",
            )


def ref_discounted_returns(rewards, mask, gamma):
    out = [[0.0] * len(rewards[0]) for _ in rewards]
    for b, row in enumerate(rewards):
        running = 0.0
        for t in reversed(range(len(row))):
            if mask[b][t]:
                running = row[t] + gamma * running
                out[b][t] = running
    return out


def test_reinforce_plus_plus_by_hand(close):
    rewards = torch.tensor([[0.0, 0.0, 1.0, 9.0]])
    mask = torch.tensor([[1, 1, 1, 0]])
    adv, ret = reinforce_plus_plus_advantages(rewards, mask, gamma=0.5)
    # returns-to-go with γ=0.5: (0.25, 0.5, 1); the padded 9 is ignored
    close(ret, [[0.25, 0.5, 1.0, 0.0]])
    # mean 7/12, unbiased std 0.381881 -> (-0.872872, -0.218218, 1.091089)
    close(adv, [[-0.872872, -0.218218, 1.091089, 0.0]], atol=1e-5)


def test_reinforce_plus_plus_skips_gaps_by_hand(close):
    # token 1 is outside the mask (e.g. tool output): its 99 is ignored and it does not
    # discount; VeRL's loop would zero the return there and give token 0 a return of 0
    rewards = torch.tensor([[0.0, 99.0, 0.0, 1.0]])
    mask = torch.tensor([[1, 0, 1, 1]])
    adv, ret = reinforce_plus_plus_advantages(rewards, mask, gamma=0.5)
    # t=3: 1; t=2: 0 + 0.5*1 = 0.5; t=0: 0 + 0.5*0.5 = 0.25 (the next valid token is t=2)
    close(ret, [[0.25, 0.0, 0.5, 1.0]])
    # the same three returns as above, so the same whitened values
    close(adv, [[-0.872872, 0.0, -0.218218, 1.091089]], atol=1e-5)


def test_reinforce_plus_plus_matches_loop(all_masks, ref_whiten):
    for seed, kind, gen, mask in all_masks():
        rewards = torch.randn(mask.shape, generator=gen, dtype=torch.float64)
        gamma = (1.0, 0.9, 0.5)[seed]
        adv, ret = reinforce_plus_plus_advantages(rewards, mask, gamma=gamma)
        expected = ref_discounted_returns(rewards.tolist(), mask.tolist(), gamma)
        msg = f"seed={seed} kind={kind}"
        torch.testing.assert_close(ret, torch.tensor(expected, dtype=torch.float64), msg=msg)
        torch.testing.assert_close(
            adv, torch.tensor(ref_whiten(expected, mask.tolist()), dtype=torch.float64), msg=msg
        )


def ref_passk(scores, group_ids, norm_adv_by_std_in_grpo, singleton_groups="zero", eps=1e-6):
    out = [0.0] * len(scores)
    for members in ref_groups(scores, group_ids).values():
        if len(members) == 1:
            out[members[0]] = ref_singleton(0.0, scores[members[0]], singleton_groups)
            continue
        values = [scores[i] for i in members]
        best = members[values.index(max(values))]  # first row holding the maximum
        second = max(scores[i] for i in members if i != best)
        gap = scores[best] - second
        if norm_adv_by_std_in_grpo:
            mean = sum(values) / len(values)
            std = math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1))
            gap = gap / (std + eps)
        out[best] = gap
    return out


def test_grpo_passk_by_hand(close):
    scores = torch.tensor([1.0, 0.0, 0.5, 1.0, 1.0, 0.3])
    group_ids = torch.tensor([4, 4, 4, 9, 9, 2])
    mask = torch.ones(6, 1)
    # group 4: best row 0 (1.0), runner-up 0.5 -> gap 0.5; std of (1, 0, 0.5) = 0.5 -> 1
    # group 9: tie at 1.0 -> row 3 is the best, gap 0; group 2 is a singleton -> 0
    # (a tied best group has std 0 too when all its scores are equal: eps keeps it 0)
    close(
        by_score(grpo_passk_advantages, scores, group_ids, mask),
        [[1.0], [0.0], [0.0], [0.0], [0.0], [0.0]],
    )
    close(
        by_score(grpo_passk_advantages, scores, group_ids, mask, norm_adv_by_std_in_grpo=False),
        [[0.5], [0.0], [0.0], [0.0], [0.0], [0.0]],
    )
    adv = by_score(grpo_passk_advantages, scores, group_ids, mask, singleton_groups="score")
    close(adv[5], [0.3])


def test_grpo_passk_matches_loop(random_group_batch):
    for seed in range(6):
        scores, group_ids, mask = random_group_batch(seed)
        for norm in (True, False):
            for singleton in SINGLETON_GROUP_CHOICES:
                adv = by_score(
                    grpo_passk_advantages,
                    scores,
                    group_ids,
                    mask,
                    norm_adv_by_std_in_grpo=norm,
                    singleton_groups=singleton,
                )
                expected = ref_passk(scores.tolist(), group_ids.tolist(), norm, singleton)
                torch.testing.assert_close(
                    adv,
                    torch.tensor(spread(expected, mask.tolist()), dtype=torch.float64),
                    msg=f"{seed} {norm} {singleton}",
                )


def test_gdpo_by_hand(close):
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
    close(gdpo(components, weights, group_ids, mask, eps=0.0), expected)
    with pytest.raises(ValueError, match="component_weights"):
        gdpo(components, torch.ones(3), group_ids, mask)


def test_gdpo_matches_loop(ref_whiten, random_group_batch):
    for seed in range(6):
        scores, group_ids, mask = random_group_batch(seed)
        gen = torch.Generator().manual_seed(100 + seed)
        components = torch.stack(
            [scores, torch.randint(0, 2, scores.shape, generator=gen).to(torch.float64)], dim=1
        )
        weights = torch.tensor([1.0, 0.5], dtype=torch.float64)
        for singleton in SINGLETON_GROUP_CHOICES:
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
            adv = gdpo(components, weights, group_ids, mask, singleton_groups=singleton)
            torch.testing.assert_close(
                adv, torch.tensor(expected, dtype=torch.float64), msg=f"{seed} {singleton}"
            )


def test_remax_by_hand(close):
    rewards = torch.tensor([[0.1, 0.0, 1.0], [0.0, 0.5, 0.0]])
    mask = torch.tensor([[1, 0, 1], [1, 1, 0]])  # a gap in row 0, right padding in row 1
    baseline = torch.tensor([0.25, 1.0])
    adv, returns = remax_advantages(rewards, mask, baseline_scores=baseline)
    # row 0 returns-to-go: 0.1 + 1.0 = 1.1 at t0, 1.0 at t2; row 1: 0.5, 0.5
    close(returns, [[1.1, 0.0, 1.0], [0.5, 0.5, 0.0]])
    close(adv, [[0.85, 0.0, 0.75], [-0.5, -0.5, 0.0]])
    with pytest.raises(ValueError, match="baseline_scores"):
        remax_advantages(rewards, mask, baseline_scores=torch.ones(3))


def test_remax_matches_loop(all_masks):
    for seed, kind, gen, mask in all_masks():
        rewards = torch.randn(mask.shape, generator=gen, dtype=torch.float64)
        rewards[~mask] = float("nan")
        baseline = torch.randn(mask.shape[0], generator=gen, dtype=torch.float64)
        adv, returns = remax_advantages(rewards, mask, baseline_scores=baseline)
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


def test_optimal_token_baseline_by_hand(close):
    # one group of two one-token responses: π = 0.5 and 0.25, Σπ² = 0.5 and 0.25
    # W = 1 - 2π + Σπ² = 0.5 and 0.75; returns 1 and 0
    rewards = torch.tensor([[1.0], [0.0]])
    mask = torch.ones(2, 1)
    old = torch.log(torch.tensor([[0.5], [0.25]]))
    squares = torch.tensor([[0.5], [0.25]])
    adv, returns = optimal_token_baseline_advantages(
        rewards,
        mask,
        group_ids=torch.tensor([3, 3]),
        old_log_probs=old,
        sum_pi_squared=squares,
        eps=0.0,
    )
    # B = (1·0.5 + 0·0.75) / 1.25 = 0.4
    close(adv, [[0.6], [-0.4]])
    close(returns, [[1.0], [0.0]])
    # importance weights 2 and 1 scale W by w²: W = 2 and 0.75 -> B = 2 / 2.75
    adv, _ = optimal_token_baseline_advantages(
        rewards,
        mask,
        group_ids=torch.tensor([3, 3]),
        old_log_probs=old,
        sum_pi_squared=squares,
        token_weights=torch.tensor([[2.0], [1.0]]),
        eps=0.0,
    )
    close(adv, [[1 - 2 / 2.75], [-2 / 2.75]])


def test_optimal_token_baseline_matches_loop(random_group_batch):
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
            for singleton in SINGLETON_GROUP_CHOICES:
                adv, returns = optimal_token_baseline_advantages(
                    rewards,
                    mask,
                    group_ids=group_ids,
                    old_log_probs=old,
                    sum_pi_squared=squares,
                    token_weights=token_weights,
                    singleton_groups=singleton,
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
