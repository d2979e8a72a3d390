"""Tests for rlserve.core.algos.advantage_registry: the registered names, what each
estimator needs and reads, and that each entry hands its function the inputs its
signature names."""

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
    register_estimator,
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
from rlserve.core.algos.notes import AlgorithmNote


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


def test_registry_entries_hand_each_function_the_inputs_it_names(make_groups, mask_for):
    gen = torch.Generator().manual_seed(3)
    group_ids = make_groups(gen)
    mask = mask_for(group_ids.numel(), gen)
    token_rewards = torch.randn(mask.shape, generator=gen, dtype=torch.float64)
    values = torch.randn(mask.shape, generator=gen, dtype=torch.float64)
    kwargs = {"values": values, "group_ids": group_ids, "gamma": 0.9, "lam": 0.95}

    def run(name, **overrides):
        inputs = EstimatorInputs(**(kwargs | overrides))
        return get_advantage_estimator(name)(token_rewards, mask, inputs)

    groups = {"group_ids": group_ids}
    expected = {
        "gae": compute_gae_advantages_returns(
            token_rewards, mask, values=values, gamma=0.9, lam=0.95
        ),
        "grpo": grpo_advantages(token_rewards, mask, **groups),
        "rloo": rloo_advantages(token_rewards, mask, **groups),
        "reinforce_plus_plus": reinforce_plus_plus_advantages(token_rewards, mask, gamma=0.9),
        "reinforce_plus_plus_baseline": reinforce_plus_plus_baseline_advantages(
            token_rewards, mask, **groups
        ),
        "opo": opo_advantages(token_rewards, mask, **groups),
        "gpg": gpg_advantages(token_rewards, mask, **groups),
        "grpo_passk": grpo_passk_advantages(token_rewards, mask, **groups),
    }
    for name, (exp_adv, exp_ret) in expected.items():
        adv, ret = run(name)
        torch.testing.assert_close(adv, exp_adv, msg=name)
        torch.testing.assert_close(ret, exp_ret, msg=name)
    # the outcome estimators' advantages are their returns too
    for name in ("grpo", "rloo", "reinforce_plus_plus_baseline", "opo", "gpg", "grpo_passk"):
        adv, ret = run(name)
        assert torch.equal(adv, ret), name
    # whiten_advantages reaches GAE's whitening (only), norm_adv_by_std_in_grpo GRPO's std
    adv, _ = run("gae", whiten_advantages=False)
    torch.testing.assert_close(
        adv,
        compute_gae_advantages_returns(
            token_rewards, mask, values=values, gamma=0.9, lam=0.95, whiten_advantages=False
        )[0],
    )
    adv, _ = run("grpo", whiten_advantages=False)
    torch.testing.assert_close(adv, grpo_advantages(token_rewards, mask, **groups)[0])
    adv, _ = run("grpo", norm_adv_by_std_in_grpo=False)
    torch.testing.assert_close(
        adv, grpo_advantages(token_rewards, mask, **groups, norm_adv_by_std_in_grpo=False)[0]
    )
    adv, _ = run("grpo_passk", norm_adv_by_std_in_grpo=False)
    torch.testing.assert_close(
        adv,
        grpo_passk_advantages(token_rewards, mask, **groups, norm_adv_by_std_in_grpo=False)[0],
    )
    # the inputs of the estimators that read more than rewards and groups
    baseline = torch.randn(group_ids.numel(), generator=gen, dtype=torch.float64)
    torch.testing.assert_close(
        run("remax", baseline_scores=baseline),
        remax_advantages(token_rewards, mask, baseline_scores=baseline),
    )
    scores = torch.randn(group_ids.numel(), generator=gen, dtype=torch.float64)
    components = torch.stack([scores, -scores], dim=1)
    weights = torch.tensor([1.0, 0.5], dtype=torch.float64)
    adv, _ = run("gdpo", reward_components=components, component_weights=weights)
    torch.testing.assert_close(
        adv,
        gdpo_advantages(
            token_rewards,
            mask,
            reward_components=components,
            component_weights=weights,
            **groups,
        )[0],
    )
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
            token_rewards,
            mask,
            **groups,
            old_log_probs=old,
            sum_pi_squared=squares,
            token_weights=token_weights,
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
            adv, fn(token_rewards, mask, **groups, singleton_groups="score")[0], msg=name
        )


def test_each_estimator_reads_the_fields_its_signature_names():
    reads = {name: entry.reads for name, entry in ADVANTAGE_ESTIMATORS.items()}
    assert reads["gae"] == ("values", "gamma", "lam", "whiten_advantages")
    assert reads["grpo"] == ("group_ids", "norm_adv_by_std_in_grpo", "singleton_groups")
    assert reads["reinforce_plus_plus"] == ("gamma",)
    assert reads["optimal_token_baseline"] == (
        "group_ids",
        "old_log_probs",
        "sum_pi_squared",
        "token_weights",
        "singleton_groups",
    )
    # a knob that is no input (eps) keeps the function's default; every need is read
    assert all("eps" not in fields for fields in reads.values())
    assert all(estimator_needs(name) <= set(fields) for name, fields in reads.items())


def test_register_estimator_refuses_a_signature_that_does_not_match_its_needs():
    note = AlgorithmNote("toy", "nobody")

    def needs_values_but_takes_none(token_rewards, response_mask, *, gamma):
        return token_rewards, token_rewards

    with pytest.raises(ValueError, match=r"'toy' needs \['values'\] but takes no such"):
        register_estimator("toy", needs={"values"}, note=note)(needs_values_but_takes_none)

    def unknown_required_keyword(token_rewards, response_mask, *, temperature):
        return token_rewards, token_rewards

    with pytest.raises(ValueError, match="'temperature' has no default and is no EstimatorInputs"):
        register_estimator("toy", needs=(), note=note)(unknown_required_keyword)
    assert "toy" not in set(ADVANTAGE_ESTIMATORS)
    # a name is registered once (the first registration stays)
    with pytest.raises(ValueError, match="advantage estimator 'grpo' is registered twice"):
        register_estimator("grpo", needs=(), note=note)(needs_values_but_takes_none)
    assert get_advantage_estimator("grpo").__name__ == "_grpo_estimator"
