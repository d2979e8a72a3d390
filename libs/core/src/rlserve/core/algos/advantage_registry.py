"""Advantage estimators by config name (``algorithm.adv_estimator``): one registry,
filled by :func:`register_estimator` on each estimator function, which also records the
estimator's note and the inputs it needs.

An estimator's keyword parameters are the :class:`EstimatorInputs` fields it reads,
named as the fields are (``values``, ``group_ids``, ``gamma``, ``singleton_groups``,
...): the registered entry takes the inputs as one object and hands each estimator the
fields its signature names, so a new input is a field and a parameter of the same name,
and nothing in between. The run config and the trainer ask :func:`estimator_needs`
which services and requests a run needs. The estimators register when
``rlserve.core.algos`` is imported (its ``__init__`` imports
:mod:`rlserve.core.algos.advantages`), in the order ``rlserve config --describe`` lists
them.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, fields

from torch import Tensor

from rlserve.core.algos.notes import AlgorithmNote, Registry, RegistryNotes


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

EstimatorFunction = Callable[..., tuple[Tensor, Tensor]]
"""What :func:`register_estimator` decorates: ``(token_rewards, response_mask, *,
<EstimatorInputs fields>) -> (advantages, returns)``."""


@dataclass(frozen=True)
class RegisteredEstimator:
    """One entry of :data:`ADVANTAGE_ESTIMATORS`."""

    estimator: AdvantageEstimator
    """The estimator, with the uniform :data:`AdvantageEstimator` signature."""
    needs: frozenset[str]
    """The :class:`EstimatorInputs` tensors it requires (see :func:`estimator_needs`)."""
    note: AlgorithmNote
    """What it computes, in one line, and its paper."""
    reads: tuple[str, ...]
    """The :class:`EstimatorInputs` fields it reads (its keyword parameters of those
    names), ``needs`` among them."""


ADVANTAGE_ESTIMATORS: Registry[RegisteredEstimator] = Registry("advantage estimator")
"""Advantage estimators by config name (``algorithm.adv_estimator``)."""

_INPUT_FIELDS = frozenset(field.name for field in fields(EstimatorInputs))


def register_estimator(
    name: str, *, needs: Iterable[str], note: AlgorithmNote
) -> Callable[[EstimatorFunction], EstimatorFunction]:
    """Decorator: register the decorated function as estimator ``name``, behind the
    uniform :data:`AdvantageEstimator` signature; it requires the :class:`EstimatorInputs`
    tensors ``needs`` and is described by ``note``. The function itself is returned as it
    is, to be called with its own keywords.

    Raises:
        ValueError: If a need is not one of its keyword parameters, or a keyword
            parameter without a default is no :class:`EstimatorInputs` field.
    """

    def register(estimator: EstimatorFunction) -> EstimatorFunction:
        reads = estimator_fields(estimator)
        required = frozenset(needs)
        missing = required - set(reads)
        if missing:
            raise ValueError(
                f"advantage estimator {name!r} needs {sorted(missing)} but takes no such "
                "keyword parameter"
            )
        entry = RegisteredEstimator(
            _uniform(name, estimator, required, reads), required, note, reads
        )
        ADVANTAGE_ESTIMATORS.add(name, entry)
        return estimator

    return register


def estimator_fields(estimator: EstimatorFunction) -> tuple[str, ...]:
    """The :class:`EstimatorInputs` fields ``estimator`` reads: its keyword-only
    parameters of those names, in its signature's order (its other keyword parameters,
    such as ``eps``, keep their defaults). ValueError for one without a default that no
    field fills."""
    reads = []
    for parameter in inspect.signature(estimator).parameters.values():
        if parameter.kind is not inspect.Parameter.KEYWORD_ONLY:
            continue
        if parameter.name in _INPUT_FIELDS:
            reads.append(parameter.name)
        elif parameter.default is inspect.Parameter.empty:
            raise ValueError(
                f"{estimator.__name__}'s keyword parameter {parameter.name!r} has no default "
                "and is no EstimatorInputs field"
            )
    return tuple(reads)


def _uniform(
    name: str, estimator: EstimatorFunction, needs: frozenset[str], reads: tuple[str, ...]
) -> AdvantageEstimator:
    """``estimator`` behind the :data:`AdvantageEstimator` signature: the fields ``reads``
    taken from the inputs, a needed tensor that is None a ValueError naming it (the first
    one missing, in the signature's order)."""

    def entry(
        token_rewards: Tensor, response_mask: Tensor, inputs: EstimatorInputs
    ) -> tuple[Tensor, Tensor]:
        given = {
            field: inputs.require(field, name) if field in needs else getattr(inputs, field)
            for field in reads
        }
        return estimator(token_rewards, response_mask, **given)

    entry.__name__ = f"_{name}_estimator"
    return entry


ADVANTAGE_ESTIMATOR_NOTES: Mapping[str, AlgorithmNote] = RegistryNotes(ADVANTAGE_ESTIMATORS)
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
