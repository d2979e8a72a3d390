"""The trainer's own math for one step: KL-penalised token rewards and advantages.

Input is the step's batch after the concurrent forwards (old log-probs, ref log-probs
when a reference is used, values when a critic is, scores); output is what the updates
need (advantages, returns) plus metrics. Pure: no services, no I/O.
"""

from dataclasses import dataclass

import torch

from rlserve.core.algos.advantage_registry import (
    EstimatorInputs,
    estimator_needs,
    get_advantage_estimator,
)
from rlserve.core.algos.kl import kl_metrics, kl_penalty, token_rewards_with_kl_penalty
from rlserve.core.algos.masked import masked_mean
from rlserve.core.batch import Batch
from rlserve.core.config import fields_from
from rlserve.core.run_config import RunConfig

ESTIMATOR_TENSORS = (
    "values",
    "baseline_scores",
    "reward_components",
    "old_log_probs",
    "sum_pi_squared",
)
"""The step batch's tensors an estimator may need, each under the name EstimatorInputs
gives it."""


@dataclass(frozen=True)
class AdvantageSettings:
    """The algorithm settings the advantages read, named as the run config names them."""

    adv_estimator: str
    """Name in advantage_registry.ADVANTAGE_ESTIMATORS ("gae", "grpo", ...)."""
    gamma: float
    lam: float
    whiten_advantages: bool
    """Whiten "gae" advantages."""
    norm_adv_by_std_in_grpo: bool
    """"grpo" divides by the group std (False: Dr. GRPO)."""
    singleton_groups: str
    """What a group of one sample gets ("zero" or "score"; advantages.SINGLETON_GROUP_CHOICES)."""
    kl_penalty: str
    """KL estimator for the in-reward penalty (a name in algos.kl.KL_KINDS)."""
    kl_in_reward: bool
    """Penalise KL in the token rewards (False when the actor uses a KL loss instead)."""


def advantage_settings(config: RunConfig) -> AdvantageSettings:
    """The run config's advantage and KL-in-reward settings, as plain values."""
    return fields_from(
        AdvantageSettings, config.algorithm, kl_in_reward=not config.actor.use_kl_loss
    )


def reference_drift(
    log_probs: torch.Tensor,
    ref_log_probs: torch.Tensor,
    mask: torch.Tensor,
    settings: AdvantageSettings,
) -> dict[str, torch.Tensor]:
    """kl_mean and kl_token_mean of the policy from the reference (algorithm.kl_penalty's
    estimator): the drift a KL loss controls.

    Shape: log_probs, ref_log_probs, mask (B, R)"""
    return kl_metrics(kl_penalty(log_probs, ref_log_probs, settings.kl_penalty), mask.float())


def compute_advantages(
    batch: Batch,
    settings: AdvantageSettings,
    kl_coef: float,
    component_weights: torch.Tensor | None = None,
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Returns ({"advantages", "returns"} (B, R) float32, metrics of 0-dim tensors).

    Needs tensors response_mask, scores, old_log_probs (unless the update computes
    them: RunConfig.single_pass_update; the KL drift metrics then come from
    `reference_drift` after it); ref_log_probs when
    settings.kl_in_reward; values for "gae"; non-tensor uid for group estimators;
    baseline_scores (B,) for "remax"; reward_components (B, K) and `component_weights`
    (K,) for "gdpo"; sum_pi_squared (and rollout_is_weights when rollout correction is
    on) for "optimal_token_baseline".
    """
    mask = batch["response_mask"].float()
    scores = batch["scores"].float()
    if settings.kl_in_reward and "ref_log_probs" in batch.tensors:
        token_kl = kl_penalty(batch["old_log_probs"], batch["ref_log_probs"], settings.kl_penalty)
        coef = kl_coef
    else:
        token_kl, coef = torch.zeros_like(mask), 0.0
    token_rewards, metrics = token_rewards_with_kl_penalty(scores, token_kl, mask, coef)
    if {"ref_log_probs", "old_log_probs"} <= set(batch.tensors) and not settings.kl_in_reward:
        # Still report the drift from the reference, which a KL loss controls.
        metrics.update(
            reference_drift(batch["old_log_probs"], batch["ref_log_probs"], mask, settings)
        )

    estimator = settings.adv_estimator
    needs = estimator_needs(estimator)
    tensors = {
        key: batch[key].float()
        for key in ESTIMATOR_TENSORS
        if key in needs and key in batch.tensors
    }
    if "group_ids" in needs:
        tensors["group_ids"] = torch.tensor([int(uid) for uid in batch["uid"]], dtype=torch.int64)
    if "sum_pi_squared" in needs and "rollout_is_weights" in batch.tensors:
        # the optimal token baseline weighs each token's variance by its IS weight²
        tensors["token_weights"] = batch["rollout_is_weights"].float()
    inputs = EstimatorInputs(
        **tensors,
        component_weights=component_weights,
        gamma=settings.gamma,
        lam=settings.lam,
        whiten_advantages=settings.whiten_advantages,
        norm_adv_by_std_in_grpo=settings.norm_adv_by_std_in_grpo,
        singleton_groups=settings.singleton_groups,
    )
    advantages, returns = get_advantage_estimator(estimator)(token_rewards, mask, inputs)
    metrics["advantages_mean"] = masked_mean(advantages, mask)
    metrics["returns_mean"] = masked_mean(returns, mask)
    return {"advantages": advantages.float(), "returns": returns.float()}, metrics


def with_weighted_advantages(actor_batch: Batch, weights: torch.Tensor) -> Batch:
    """The actor's batch with its advantages multiplied by `weights`: one per response
    ([rows], e.g. 0 to drop a response's signal) or one per token ([rows, tokens]). The
    rows stay: the actor trains on whole rows, so a zeroed row still counts in a
    token-mean's denominator and a KL loss."""
    advantages = actor_batch["advantages"]
    if weights.dim() == 1:
        weights = weights[:, None]
    tensors = {**actor_batch.tensors, "advantages": advantages * weights.to(advantages.dtype)}
    return Batch(tensors, actor_batch.non_tensors, actor_batch.meta)


def without_failed_tool_signal(
    actor_batch: Batch, tool_errors: torch.Tensor
) -> tuple[Batch, dict[str, float]]:
    """The actor's batch with advantage 0 for every response with a failed tool call
    (rollout.agent.on_tool_error "drop_sample"), and how many were dropped."""
    failed = tool_errors > 0
    metrics = {"agent/dropped_samples": float(failed.sum())}
    return with_weighted_advantages(actor_batch, ~failed), metrics
