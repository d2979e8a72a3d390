import pytest
import torch

from rlserve.core.batch import Batch
from rlserve.core.config import load_config
from rlserve.core.run_config import RunConfig
from rlserve.trainer.advantages import AdvantageSettings, advantage_settings, compute_advantages


def _batch(**extra):
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    tensors = {
        "response_mask": mask,
        "scores": torch.tensor([1.0, 0.0]),
        "old_log_probs": torch.tensor([[-1.0, -2.0, 0.0], [-1.0, -1.0, -1.0]]),
        "ref_log_probs": torch.tensor([[-1.5, -2.0, 0.0], [-1.0, -0.5, -1.0]]),
        **extra,
    }
    return Batch(tensors=tensors, non_tensors={"uid": [0, 0]})


def _settings(estimator="gae", kl_in_reward=True, whiten=False, norm_by_std=True, singleton="zero"):
    return AdvantageSettings(
        estimator,
        gamma=1.0,
        lam=1.0,
        whiten_advantages=whiten,
        norm_adv_by_std_in_grpo=norm_by_std,
        singleton_groups=singleton,
        kl_penalty="k1",
        kl_in_reward=kl_in_reward,
    )


def test_gae_with_kl_penalty_by_hand():
    batch = _batch(values=torch.zeros(2, 3))
    targets, metrics = compute_advantages(batch, _settings(), kl_coef=0.1)
    # k1 KL = old - ref: row 0 [0.5, 0, -], row 1 [0, -0.5, 0]; reward -0.1*KL, score at end.
    # γ=λ=1 and zero values: advantage = sum of remaining rewards.
    expected = torch.tensor([[-0.05 + 1.0, 1.0, 0.0], [0.05, 0.05, 0.0]])
    assert torch.allclose(targets["advantages"], expected, atol=1e-6)
    assert torch.allclose(targets["returns"], expected, atol=1e-6)
    assert metrics["kl_token_mean"] == pytest.approx(0.0)  # (0.5 + 0 - 0.5 + 0 + 0) / 5
    # per sequence: 0.5 / 2 and -0.5 / 3, then their mean
    assert metrics["kl_mean"] == pytest.approx((0.25 - 0.5 / 3) / 2)


def test_grpo_uses_groups_and_reports_reference_drift_with_kl_loss():
    # A drift that does not average out: k1 = old - ref = row 0 [0.5, 0.5], row 1 [0, 0.6, 0]
    drifted = torch.tensor([[-1.5, -2.5, 0.0], [-1.0, -1.6, -1.0]])
    targets, metrics = compute_advantages(
        _batch(ref_log_probs=drifted), _settings("grpo", kl_in_reward=False, whiten=True), 0.1
    )
    adv = targets["advantages"]
    # Scores 1 and 0 in one group: ±1/std (std of [1, 0] = 0.7071), masked.
    assert adv[0, 0] == pytest.approx(0.7071, abs=1e-3) and adv[0, 2] == 0
    assert adv[1, 0] == pytest.approx(-0.7071, abs=1e-3)
    assert float(metrics["kl_coef"]) == 0.0
    # The drift is reported though it is not in the reward: sequence means 0.5 and 0.2.
    assert float(metrics["kl_mean"]) == pytest.approx(0.35, abs=1e-6)
    assert float(metrics["kl_token_mean"]) == pytest.approx(1.6 / 5, abs=1e-6)
    # ... and the advantages do not depend on it (GRPO's KL is the actor's loss).
    plain, _ = compute_advantages(_batch(), _settings("grpo", kl_in_reward=False, whiten=True), 0)
    assert torch.equal(plain["advantages"], adv)


def test_gae_needs_values():
    with pytest.raises(ValueError, match="'gae' needs values"):
        compute_advantages(_batch(), _settings(), kl_coef=0.0)


def test_grpo_std_switch_and_singleton_choice_reach_the_estimator():
    # scores 1 and 0 in group 0, 0.5 alone in group 1
    mask = torch.ones(3, 2, dtype=torch.long)
    batch = Batch(
        tensors={
            "response_mask": mask,
            "scores": torch.tensor([1.0, 0.0, 0.5]),
            "old_log_probs": torch.zeros(3, 2),
        },
        non_tensors={"uid": [0, 0, 1]},
    )
    dr_grpo = _settings("grpo", kl_in_reward=False, norm_by_std=False, singleton="score")
    targets, _ = compute_advantages(batch, dr_grpo, kl_coef=0.0)
    # no std division: ±0.5 around the group mean; the singleton keeps its score 0.5
    expected = torch.tensor([[0.5, 0.5], [-0.5, -0.5], [0.5, 0.5]])
    assert torch.allclose(targets["advantages"], expected)
    targets, _ = compute_advantages(batch, _settings("grpo", kl_in_reward=False), kl_coef=0.0)
    assert targets["advantages"][0, 0] == pytest.approx(0.7071, abs=1e-3)
    assert torch.equal(targets["advantages"][2], torch.zeros(2))


def test_algorithm_settings_reach_the_advantage_settings():
    config = load_config(
        RunConfig,
        None,
        [
            "algorithm.adv_estimator=opo",
            "rollout.responses_per_prompt=4",
            "algorithm.norm_adv_by_std_in_grpo=false",
            "algorithm.singleton_groups=score",
            "algorithm.kl_penalty=low_var_kl+",
            "actor.use_kl_loss=true",
        ],
    )
    settings = advantage_settings(config)
    assert (
        settings.adv_estimator,
        settings.norm_adv_by_std_in_grpo,
        settings.singleton_groups,
    ) == (
        "opo",
        False,
        "score",
    )
    assert (settings.kl_penalty, settings.kl_in_reward) == ("low_var_kl+", False)


def test_remax_subtracts_each_rows_greedy_baseline():
    batch = _batch(baseline_scores=torch.tensor([0.25, 1.0]))
    targets, _ = compute_advantages(batch, _settings("remax", kl_in_reward=False), kl_coef=0.0)
    # no KL: returns-to-go are the score on every token; minus 0.25 and 1.0
    expected = torch.tensor([[0.75, 0.75, 0.0], [-1.0, -1.0, -1.0]])
    assert torch.allclose(targets["advantages"], expected)
    assert torch.allclose(targets["returns"], torch.tensor([[1.0, 1.0, 0.0], [0.0, 0.0, 0.0]]))


def test_gdpo_reads_the_reward_components_and_their_weights():
    components = torch.tensor([[1.0, 0.0], [0.0, 1.0]])
    batch = _batch(reward_components=components)
    settings = _settings("gdpo", kl_in_reward=False)
    equal, _ = compute_advantages(batch, settings, 0.0, torch.tensor([1.0, 1.0]))
    # equal weights: each kind's ±0.707 cancels the other's, nothing to learn
    assert torch.allclose(equal["advantages"], torch.zeros(2, 3))
    tilted, _ = compute_advantages(batch, settings, 0.0, torch.tensor([2.0, 1.0]))
    # the first kind weighs more: row 0 (which has it) up, row 1 down
    assert tilted["advantages"][0, 0] > 0 > tilted["advantages"][1, 0]


def test_optimal_token_baseline_reads_the_forward_and_the_rollout_weights():
    batch = _batch(
        scores=torch.tensor([1.0, 0.0]),
        sum_pi_squared=torch.tensor([[0.5, 0.5, 0.0], [0.5, 0.5, 0.5]]),
        rollout_is_weights=torch.ones(2, 3),
    )
    settings = _settings("optimal_token_baseline", kl_in_reward=False)
    targets, _ = compute_advantages(batch, settings, 0.0)
    # both rows share group 0; the returns differ, so each row gets a nonzero advantage
    adv = targets["advantages"]
    assert adv[0, 0] > 0 > adv[1, 0] and adv[0, 2] == 0
    heavier = Batch(
        {**batch.tensors, "rollout_is_weights": torch.full((2, 3), 2.0)}, batch.non_tensors
    )
    # scaling every weight alike leaves the baseline a weighted mean of the same returns
    same, _ = compute_advantages(heavier, settings, 0.0)
    assert torch.allclose(same["advantages"], adv, atol=1e-5)


def test_advantage_settings_and_estimator_inputs_carry_the_run_configs_names():
    """One name per concept: the trainer's settings, the estimators' inputs and the
    batch keys they read are the run config's and the step batch's names."""
    import dataclasses

    from rlserve.core.algos.advantage_registry import ADVANTAGE_ESTIMATORS, EstimatorInputs
    from rlserve.core.run_config import AlgorithmConfig
    from rlserve.trainer.advantages import ESTIMATOR_TENSORS

    algorithm_fields = set(AlgorithmConfig.model_fields)
    derived = {"kl_in_reward"}  # from actor.use_kl_loss
    settings = {field.name for field in dataclasses.fields(AdvantageSettings)}
    assert settings - derived <= algorithm_fields, sorted(settings - derived - algorithm_fields)
    knobs = {
        field.name
        for field in dataclasses.fields(EstimatorInputs)
        if field.type in ("float", "bool", "str")
    }
    assert knobs and knobs <= settings, sorted(knobs - settings)
    computed = {"group_ids", "component_weights"}  # from uid, from the reward service
    needs = {need for _, entry in ADVANTAGE_ESTIMATORS.items() for need in entry.needs}
    assert needs - computed <= set(ESTIMATOR_TENSORS), sorted(needs - computed)
