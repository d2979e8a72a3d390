"""A PPO step's metrics, as metrics.jsonl, TensorBoard and the progress bar show them."""

from collections import Counter
from typing import Any

import torch

from rlserve.core.algos.masked import masked_mean
from rlserve.core.batch import Batch


def step_metrics(
    batch: Batch,
    adv_metrics: dict[str, Any],
    *,
    kl_mean: float,
    weights_version: int,
    staleness: int,
    replayed_updates: float,
    step_s: float,
    timings: dict[str, float],
    update_results: dict[str, Any],
    generation_metrics: dict[str, float],
    actor_batch_metrics: dict[str, float],
    reward_figures: Counter[str],
    overlong_penalty: torch.Tensor | None,
) -> dict[str, float]:
    """The step's metrics from its trained `batch` (scores, masks, entropy, baseline
    scores) and `adv_metrics` (compute_advantages'), the weights version its update made,
    the step's staleness and replayed updates, its wall time `step_s` and `timings`,
    the updates' answers (name -> api.UpdateAnswer), the generation's metrics
    (generate/*), the actor batch's filters' metrics (overlong/*, rollout_is/*), the
    reward service's figures (reward/*) and the overlong penalty per sample when it is
    on. `kl_mean`: the mean over sequences of each one's mean token KL (VeRL's choice):
    every response counts once, however long."""
    mask = batch["response_mask"].float()
    response_tokens = float(mask.sum())
    scores = batch["scores"]
    actor_update = update_results["update_actor"]
    metrics = {
        "reward_mean": float(scores.mean()),
        "reward_std": float(scores.std()) if len(scores) > 1 else 0.0,
        "kl_mean": kl_mean,
        "kl_token_mean": float(adv_metrics["kl_token_mean"]),
        "kl_coef": float(adv_metrics["kl_coef"]),
        "entropy_mean": float(masked_mean(batch["entropy"], mask)),
        "response_length_mean": response_tokens / len(batch),
        "advantages_mean": float(adv_metrics["advantages_mean"]),
        "returns_mean": float(adv_metrics["returns_mean"]),
        "weights_version": float(weights_version),
        "staleness": float(staleness),
        "replayed_updates": replayed_updates,
        "samples": float(len(batch)),
        "tokens_per_s": (response_tokens + float(batch["attention_mask"].sum())) / step_s,
        "episodes_per_s": len(batch) / step_s,
        "time/step_s": step_s,
        **timings,
        **{f"actor/{k}": v for k, v in actor_update.metrics.items()},
        **{f"generate/{k}": v for k, v in generation_metrics.items()},
        **actor_batch_metrics,
    }
    metrics.update({f"reward/{name}": value for name, value in reward_figures.items()})
    if overlong_penalty is not None:
        metrics["overlong/penalty_mean"] = float(overlong_penalty.mean())
    if "baseline_scores" in batch.tensors:
        metrics["remax/baseline_mean"] = float(batch["baseline_scores"].mean())
    if "update_critic" in update_results:
        critic_update = update_results["update_critic"]
        metrics.update({f"critic/{k}": v for k, v in critic_update.metrics.items()})
    return metrics
