"""Advantage estimators by config name (``algorithm.adv_estimator``): one registry,
filled by :func:`register_estimator` on each entry, which also records the entry's note
and the inputs it needs.

Each entry adapts one function of :mod:`rlserve.core.algos.advantages` to the uniform
:data:`AdvantageEstimator` signature. The run config and the trainer ask
:func:`estimator_needs` which services and requests a run needs. The entries are
registered in the order ``rlserve config --describe`` lists them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

from torch import Tensor

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
from rlserve.core.algos.notes import AlgorithmNote, Registry


@dataclass(frozen=True)
class EstimatorInputs:
    """What an advantage estimator may read besides the token rewards and the response
    mask, and its knobs. Each estimator takes what it needs (ValueError naming a missing
    tensor) and ignores the rest; :func:`estimator_needs` says which a name needs."""

    values: Tensor | None = None
    """Critic values ("gae"). Shape: (B, T)."""
    group_ids: Tensor | None = None
    """Prompt group of each row (the group estimators). Shape: (B,)."""
    baseline_scores: Tensor | None = None
    """Score of the greedy response to each row's prompt ("remax"). Shape: (B,)."""
    reward_components: Tensor | None = None
    """Each reward kind's score ("gdpo"). Shape: (B, K)."""
    component_weights: Tensor | None = None
    """Weight of each reward kind ("gdpo"). Shape: (K,)."""
    old_log_probs: Tensor | None = None
    """log π_old of the sampled tokens ("optimal_token_baseline"). Shape: (B, T)."""
    sum_pi_squared: Tensor | None = None
    """Σ_v π_old(v)² at each position ("optimal_token_baseline"). Shape: (B, T)."""
    token_weights: Tensor | None = None
    """Rollout-correction importance weights, or None ("optimal_token_baseline").
    Shape: (B, T)."""
    gamma: float = 1.0
    """Discount per token ("gae", "reinforce_plus_plus")."""
    lam: float = 1.0
    """GAE λ."""
    whiten_advantages: bool = True
    """"gae" whitens its advantages."""
    norm_adv_by_std_in_grpo: bool = True
    """"grpo" and "grpo_passk" divide by the group std (False: Dr. GRPO)."""
    singleton_groups: str = "zero"
    """What a group of one sample gets in the group estimators
    (:data:`SINGLETON_GROUP_CHOICES`)."""

    def require(self, name: str, estimator: str) -> Tensor:
        """The tensor field ``name``; ValueError if it is None."""
        tensor = getattr(self, name)
        if tensor is None:
            raise ValueError(f"advantage estimator {estimator!r} needs {name}")
        return tensor


AdvantageEstimator = Callable[[Tensor, Tensor, EstimatorInputs], tuple[Tensor, Tensor]]
"""What each entry of :data:`ADVANTAGE_ESTIMATORS` computes: ``(token_rewards (B, T),
response_mask (B, T), inputs) -> (advantages, returns)``, each Shape: (B, T). Outcome
estimators use the masked sum of the token rewards per sequence as its score and return
the advantages as returns."""


@dataclass(frozen=True)
class RegisteredEstimator:
    """One entry of :data:`ADVANTAGE_ESTIMATORS`."""

    estimator: AdvantageEstimator
    """The estimator, with the uniform :data:`AdvantageEstimator` signature."""
    needs: frozenset[str]
    """The :class:`EstimatorInputs` tensors it requires (see :func:`estimator_needs`)."""
    note: AlgorithmNote
    """What it computes, in one line, and its paper."""


ADVANTAGE_ESTIMATORS: Registry[RegisteredEstimator] = Registry("advantage estimator")
"""Advantage estimators by config name (``algorithm.adv_estimator``)."""


def register_estimator(
    name: str, *, needs: Iterable[str], note: AlgorithmNote
) -> Callable[[AdvantageEstimator], AdvantageEstimator]:
    """Decorator: register the decorated function as estimator ``name``, which requires
    the :class:`EstimatorInputs` tensors ``needs`` and is described by ``note``."""

    def register(estimator: AdvantageEstimator) -> AdvantageEstimator:
        ADVANTAGE_ESTIMATORS.add(name, RegisteredEstimator(estimator, frozenset(needs), note))
        return estimator

    return register


def _sequence_scores(token_rewards: Tensor, response_mask: Tensor) -> Tensor:
    """Outcome score per sequence = sum of its token rewards. (B, T) -> (B,)."""
    return masked_sum(token_rewards, response_mask, dim=1)


def _outcome_estimate(
    name: str,
    advantage_fn: Callable[..., Tensor],
    token_rewards: Tensor,
    response_mask: Tensor,
    inputs: EstimatorInputs,
    **knobs: bool,
) -> tuple[Tensor, Tensor]:
    """An outcome estimator of scores, groups and the singleton rule (and ``knobs``, the
    std switch of those that divide by it); its advantages serve as returns too."""
    advantages = advantage_fn(
        _sequence_scores(token_rewards, response_mask),
        inputs.require("group_ids", name),
        response_mask,
        singleton_groups=inputs.singleton_groups,
        **knobs,
    )
    return advantages, advantages


_GROUP = frozenset({"group_ids"})


@register_estimator(
    "gae",
    needs={"values"},
    note=AlgorithmNote(
        "GAE(γ, λ) over critic values per token; needs the critic",
        'Schulman et al. 2016, "High-Dimensional Continuous Control Using GAE", arXiv:1506.02438',
    ),
)
def _gae_estimator(
    token_rewards: Tensor, response_mask: Tensor, inputs: EstimatorInputs
) -> tuple[Tensor, Tensor]:
    return compute_gae_advantages_returns(
        token_rewards,
        inputs.require("values", "gae"),
        response_mask,
        inputs.gamma,
        inputs.lam,
        whiten_advantages=inputs.whiten_advantages,
    )


@register_estimator(
    "grpo",
    needs=_GROUP,
    note=AlgorithmNote(
        "score minus its prompt group's mean, over the group's std "
        "(norm_adv_by_std_in_grpo=false: Dr. GRPO, Liu et al. 2025, arXiv:2503.20783)",
        'Shao et al. 2024, "DeepSeekMath", arXiv:2402.03300',
    ),
)
def _grpo_estimator(
    token_rewards: Tensor, response_mask: Tensor, inputs: EstimatorInputs
) -> tuple[Tensor, Tensor]:
    return _outcome_estimate(
        "grpo",
        grpo_advantages,
        token_rewards,
        response_mask,
        inputs,
        norm_adv_by_std_in_grpo=inputs.norm_adv_by_std_in_grpo,
    )


@register_estimator(
    "rloo",
    needs=_GROUP,
    note=AlgorithmNote(
        "score minus the mean score of the other responses to the same prompt",
        'Ahmadian et al. 2024, "Back to Basics: Revisiting REINFORCE", arXiv:2402.14740',
    ),
)
def _rloo_estimator(
    token_rewards: Tensor, response_mask: Tensor, inputs: EstimatorInputs
) -> tuple[Tensor, Tensor]:
    return _outcome_estimate("rloo", rloo_advantages, token_rewards, response_mask, inputs)


@register_estimator(
    "reinforce_plus_plus",
    needs=(),
    note=AlgorithmNote(
        "discounted returns-to-go of the token rewards, whitened over the batch; no critic",
        'Hu 2025, "REINFORCE++", arXiv:2501.03262',
    ),
)
def _reinforce_plus_plus_estimator(
    token_rewards: Tensor, response_mask: Tensor, inputs: EstimatorInputs
) -> tuple[Tensor, Tensor]:
    return reinforce_plus_plus_advantages(token_rewards, response_mask, inputs.gamma)


@register_estimator(
    "reinforce_plus_plus_baseline",
    needs=_GROUP,
    note=AlgorithmNote(
        "score minus its group's mean, whitened over the batch's response tokens",
        'Hu 2025, "REINFORCE++", arXiv:2501.03262',
    ),
)
def _reinforce_plus_plus_baseline_estimator(
    token_rewards: Tensor, response_mask: Tensor, inputs: EstimatorInputs
) -> tuple[Tensor, Tensor]:
    return _outcome_estimate(
        "reinforce_plus_plus_baseline",
        reinforce_plus_plus_baseline_advantages,
        token_rewards,
        response_mask,
        inputs,
    )


@register_estimator(
    "opo",
    needs=_GROUP,
    note=AlgorithmNote(
        "score minus the response-length-weighted mean score of its group (optimal baseline)",
        'Hao et al. 2025, "On-Policy RL with Optimal Reward Baseline", arXiv:2505.23585',
    ),
)
def _opo_estimator(
    token_rewards: Tensor, response_mask: Tensor, inputs: EstimatorInputs
) -> tuple[Tensor, Tensor]:
    return _outcome_estimate("opo", opo_advantages, token_rewards, response_mask, inputs)


@register_estimator(
    "gpg",
    needs=_GROUP,
    note=AlgorithmNote(
        "score minus its group's mean, scaled by B/(B-M) (M: samples of all-equal groups); "
        "pair with actor.policy_loss=reinforce",
        'Chu et al. 2025, "GPG: A Simple and Strong RL Baseline for Model Reasoning", '
        "arXiv:2504.02546",
    ),
)
def _gpg_estimator(
    token_rewards: Tensor, response_mask: Tensor, inputs: EstimatorInputs
) -> tuple[Tensor, Tensor]:
    return _outcome_estimate("gpg", gpg_advantages, token_rewards, response_mask, inputs)


@register_estimator(
    "grpo_passk",
    needs=_GROUP,
    note=AlgorithmNote(
        "pass@k: only each group's best response gets a signal, its score minus the "
        "runner-up's, over the group's std",
        'Tang et al. 2025, "Optimizing Language Models for Inference Time Objectives using '
        'RL", arXiv:2503.19595',
    ),
)
def _grpo_passk_estimator(
    token_rewards: Tensor, response_mask: Tensor, inputs: EstimatorInputs
) -> tuple[Tensor, Tensor]:
    return _outcome_estimate(
        "grpo_passk",
        grpo_passk_advantages,
        token_rewards,
        response_mask,
        inputs,
        norm_adv_by_std_in_grpo=inputs.norm_adv_by_std_in_grpo,
    )


@register_estimator(
    "gdpo",
    needs=_GROUP | {"reward_components", "component_weights"},
    note=AlgorithmNote(
        "each reward kind (the reward service's scores_<kind>) normalised within its "
        "group, weighted sum, whitened over the batch",
        'Liu et al. 2026, "GDPO: Group reward-Decoupled Normalization Policy '
        'Optimization", arXiv:2601.05242',
    ),
)
def _gdpo_estimator(
    token_rewards: Tensor, response_mask: Tensor, inputs: EstimatorInputs
) -> tuple[Tensor, Tensor]:
    # the token rewards' KL penalty is not a reward kind: GDPO reads the kinds' scores
    del token_rewards
    advantages = gdpo_advantages(
        inputs.require("reward_components", "gdpo"),
        inputs.require("component_weights", "gdpo"),
        inputs.require("group_ids", "gdpo"),
        response_mask,
        singleton_groups=inputs.singleton_groups,
    )
    return advantages, advantages


@register_estimator(
    "remax",
    needs={"baseline_scores"},
    note=AlgorithmNote(
        "return-to-go minus the score of the greedy response to the same prompt (one "
        "extra greedy generation and reward call per prompt)",
        'Li et al. 2024, "ReMax: A Simple, Effective, and Efficient RL Method", arXiv:2310.10505',
    ),
)
def _remax_estimator(
    token_rewards: Tensor, response_mask: Tensor, inputs: EstimatorInputs
) -> tuple[Tensor, Tensor]:
    return remax_advantages(
        token_rewards, inputs.require("baseline_scores", "remax"), response_mask
    )


@register_estimator(
    "optimal_token_baseline",
    needs=_GROUP | {"old_log_probs", "sum_pi_squared"},
    note=AlgorithmNote(
        "return-to-go minus a per-group, per-position baseline weighted by each path's "
        "accumulated gradient variance (1 - 2π + Σπ²; asks the rollout for Σπ²)",
        'Greensmith et al. 2004, "Variance Reduction Techniques for Gradient Estimates '
        'in RL", JMLR 5; VeRL\'s "optimal_token_baseline"',
    ),
)
def _optimal_token_baseline_estimator(
    token_rewards: Tensor, response_mask: Tensor, inputs: EstimatorInputs
) -> tuple[Tensor, Tensor]:
    name = "optimal_token_baseline"
    return optimal_token_baseline_advantages(
        token_rewards,
        response_mask,
        inputs.require("group_ids", name),
        inputs.require("old_log_probs", name),
        inputs.require("sum_pi_squared", name),
        token_weights=inputs.token_weights,
        singleton_groups=inputs.singleton_groups,
    )


ADVANTAGE_ESTIMATOR_NOTES: dict[str, AlgorithmNote] = {
    name: entry.note for name, entry in ADVANTAGE_ESTIMATORS.items()
}
"""One line per advantage estimator, with its paper (the run config's choices)."""


def get_advantage_estimator(name: str) -> AdvantageEstimator:
    """The estimator registered as ``name``; ValueError naming the valid choices if none."""
    return ADVANTAGE_ESTIMATORS.lookup(name).estimator


def estimator_needs(name: str) -> frozenset[str]:
    """The :class:`EstimatorInputs` tensors estimator ``name`` requires (it may also read
    an optional one: the optimal token baseline, ``token_weights``). The run config and
    the trainer ask it which services and requests a run needs: "values" a critic,
    "group_ids" several responses per prompt, "baseline_scores" a greedy generation,
    "reward_components" each reward kind's score, "sum_pi_squared" Σπ² from the rollout."""
    return ADVANTAGE_ESTIMATORS.lookup(name).needs


def needs_critic(name: str) -> bool:
    """Whether estimator ``name`` needs critic values (so a critic service must run)."""
    return "values" in estimator_needs(name)


def needs_group_ids(name: str) -> bool:
    """Whether estimator ``name`` compares samples of the same prompt (n > 1 per prompt)."""
    return "group_ids" in estimator_needs(name)
