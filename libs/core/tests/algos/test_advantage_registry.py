"""Tests for rlserve.core.algos.advantage_registry: the registered names, what each
estimator needs, and that each entry calls its plain function with the knobs it reads."""

from __future__ import annotations

import pytest
import torch

from rlserve.core.algos.advantage_registry import (
    ADVANTAGE_ESTIMATORS,
    EstimatorInputs,
    estimator_needs,
    get_advantage_estimator,
    needs_critic,
    needs_group_ids,
)
from rlserve.core.algos.advantages import (
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
from rlserve.core.algos.masked import masked_sum


def test_registry_names_and_critic_needs():
    assert set(ADVANTAGE_ESTIMATORS) == {
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
    assert [n for n in ADVANTAGE_ESTIMATORS if needs_critic(n)] == ["gae"]
    assert {n for n in ADVANTAGE_ESTIMATORS if needs_group_ids(n)} == {
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
        return [n for n in ADVANTAGE_ESTIMATORS if field in estimator_needs(n)]

    assert needing("baseline_scores") == ["remax"]
    assert needing("sum_pi_squared") == ["optimal_token_baseline"]
    assert needing("reward_components") == ["gdpo"]
    # every need names an EstimatorInputs field
    fields = set(EstimatorInputs.__dataclass_fields__)
    assert all(estimator_needs(n) <= fields for n in ADVANTAGE_ESTIMATORS)


def test_registry_unknown_name():
    for fn in (
        get_advantage_estimator,
        needs_critic,
        needs_group_ids,
        estimator_needs,
    ):
        with pytest.raises(
            ValueError, match=r"unknown advantage estimator 'ppo'; valid choices: gae, grpo"
        ):
            fn("ppo")


def test_registry_missing_inputs():
    x = torch.zeros(2, 3)
    nothing = EstimatorInputs()
    with pytest.raises(ValueError, match="'gae' needs values"):
        get_advantage_estimator("gae")(x, torch.ones(2, 3), nothing)
    with pytest.raises(ValueError, match="'rloo' needs group_ids"):
        get_advantage_estimator("rloo")(x, torch.ones(2, 3), nothing)
    with pytest.raises(ValueError, match="'remax' needs baseline_scores"):
        get_advantage_estimator("remax")(x, torch.ones(2, 3), nothing)
    with_groups = EstimatorInputs(group_ids=torch.tensor([0, 0]))
    with pytest.raises(ValueError, match="'gdpo' needs reward_components"):
        get_advantage_estimator("gdpo")(x, torch.ones(2, 3), with_groups)
    with pytest.raises(ValueError, match="'optimal_token_baseline' needs old_log_probs"):
        get_advantage_estimator("optimal_token_baseline")(x, torch.ones(2, 3), with_groups)


def test_registry_entries_call_the_plain_functions(make_groups, mask_for):
    gen = torch.Generator().manual_seed(3)
    group_ids = make_groups(gen)
    mask = mask_for(group_ids.numel(), gen)
    token_rewards = torch.randn(mask.shape, generator=gen, dtype=torch.float64)
    values = torch.randn(mask.shape, generator=gen, dtype=torch.float64)
    scores = masked_sum(token_rewards, mask, dim=1)
    kwargs = {"values": values, "group_ids": group_ids, "gamma": 0.9, "lam": 0.95}

    def run(name, **overrides):
        inputs = EstimatorInputs(**(kwargs | overrides))
        return get_advantage_estimator(name)(token_rewards, mask, inputs)

    expected = {
        "gae": compute_gae_advantages_returns(token_rewards, values, mask, 0.9, 0.95),
        "grpo": (grpo_advantages(scores, group_ids, mask),) * 2,
        "rloo": (rloo_advantages(scores, group_ids, mask),) * 2,
        "reinforce_plus_plus": reinforce_plus_plus_advantages(token_rewards, mask, 0.9),
        "reinforce_plus_plus_baseline": (
            reinforce_plus_plus_baseline_advantages(scores, group_ids, mask),
        )
        * 2,
        "opo": (opo_advantages(scores, group_ids, mask),) * 2,
        "gpg": (gpg_advantages(scores, group_ids, mask),) * 2,
        "grpo_passk": (grpo_passk_advantages(scores, group_ids, mask),) * 2,
    }
    for name, (exp_adv, exp_ret) in expected.items():
        adv, ret = run(name)
        torch.testing.assert_close(adv, exp_adv, msg=name)
        torch.testing.assert_close(ret, exp_ret, msg=name)
    # whiten_advantages reaches GAE's whitening (only), norm_adv_by_std_in_grpo GRPO's std
    adv, _ = run("gae", whiten_advantages=False)
    torch.testing.assert_close(
        adv, compute_gae_advantages_returns(token_rewards, values, mask, 0.9, 0.95, False)[0]
    )
    adv, _ = run("grpo", whiten_advantages=False)
    torch.testing.assert_close(adv, grpo_advantages(scores, group_ids, mask))
    adv, _ = run("grpo", norm_adv_by_std_in_grpo=False)
    torch.testing.assert_close(
        adv, grpo_advantages(scores, group_ids, mask, norm_adv_by_std_in_grpo=False)
    )
    adv, _ = run("grpo_passk", norm_adv_by_std_in_grpo=False)
    torch.testing.assert_close(
        adv, grpo_passk_advantages(scores, group_ids, mask, norm_adv_by_std_in_grpo=False)
    )
    # the inputs of the estimators that read more than rewards and groups
    baseline = torch.randn(group_ids.numel(), generator=gen, dtype=torch.float64)
    torch.testing.assert_close(
        run("remax", baseline_scores=baseline),
        remax_advantages(token_rewards, baseline, mask),
    )
    components = torch.stack([scores, -scores], dim=1)
    weights = torch.tensor([1.0, 0.5], dtype=torch.float64)
    adv, _ = run("gdpo", reward_components=components, component_weights=weights)
    torch.testing.assert_close(adv, gdpo_advantages(components, weights, group_ids, mask))
    old = -torch.rand(mask.shape, generator=gen, dtype=torch.float64)
    squares = torch.rand(mask.shape, generator=gen, dtype=torch.float64)
    token_weights = torch.rand(mask.shape, generator=gen, dtype=torch.float64)
    torch.testing.assert_close(
        run(
            "optimal_token_baseline",
            old_log_probs=old,
            sum_pi_squared=squares,
            token_weights=token_weights,
        ),
        optimal_token_baseline_advantages(
            token_rewards, mask, group_ids, old, squares, token_weights
        ),
    )
    # singleton_groups reaches every group estimator
    group_fns = {
        "grpo": grpo_advantages,
        "rloo": rloo_advantages,
        "reinforce_plus_plus_baseline": reinforce_plus_plus_baseline_advantages,
        "opo": opo_advantages,
        "gpg": gpg_advantages,
        "grpo_passk": grpo_passk_advantages,
    }
    for name, fn in group_fns.items():
        adv, _ = run(name, singleton_groups="score")
        torch.testing.assert_close(
            adv, fn(scores, group_ids, mask, singleton_groups="score"), msg=name
        )
