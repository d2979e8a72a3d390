"""The critic's controller: values, and UpdateCritic's plan and metrics.

It runs inside the Serve replica (no gRPC here: the deployment translates protobuf) and
drives a group of CriticWorkers through any object with WorkerGroup's async interface
(`rlserve.core.workers.WorkerGroup` in the service, the root conftest's
in_process_group in unit tests); either raises a worker's exception as itself.

What every stateful service shares is rlserve.core.service.controller.StatefulController:
the lock, deadlines and atomic updates, the step ledger (UpdateCritic is idempotent by
step: a retry with the batch it applied answers its stored metrics, replayed=true), the
broken state, the update rule (checks → broken? → replay → apply), checkpoints under
checkpoint_root and Reset. Here:

- ComputeValues stamps the version its values were computed with; its workers get the
  caller's deadline and stop between forward micro-batches once it has passed.
- UpdateCritic's mini-batches are planned over the request's global rows
  (rlserve.core.service.plan.MiniBatchPlan, a fresh permutation per epoch seeded by the
  step), every mini-batch split evenly over the ranks with its global loss units, and
  each rank receives only the rows it uses. So N workers train what one would (see
  worker.py for the loss weighting), and rows must tile the mini-batches.
- Request size: rows (max_batch_samples) and token positions (max_request_tokens, rows
  × input_ids columns) are checked before any work.
"""

import time
from dataclasses import dataclass
from typing import Any

from rlserve.core.batch import Batch
from rlserve.core.config import fields_from
from rlserve.core.rank_worker import RankSetup
from rlserve.core.service.controller import StatefulController, UpdateWork
from rlserve.core.service.plan import MiniBatchPlan, RankUpdate
from rlserve.core.serving import Deadline
from rlserve.core.training import OptimizerSettings
from rlserve.core.worker_controller import RequestBounds
from rlserve.critic.config import CriticServiceConfig
from rlserve.critic.methods import COMPUTE_VALUES, UPDATE_CRITIC
from rlserve.critic.requests import ValueLossSettings, update_batch

# Results of this many most recent applied steps stay replayable (and go into checkpoints).
REPLAY_HISTORY_STEPS = 64
NO_DEADLINE = Deadline()


def worker_kwargs(config: CriticServiceConfig) -> dict[str, Any]:
    """CriticWorker's constructor arguments (besides rank, world_size) from the config."""
    return {
        "setup": RankSetup.of(config),
        "optimizer": fields_from(
            OptimizerSettings,
            config,
            micro_batch_samples=min(config.micro_batch_samples, config.worker_mini_batch_samples),
        ),
        "loss": fields_from(ValueLossSettings, config),
        "forward_micro_batch_samples": config.forward_micro_batch_samples,
        "gradient_checkpointing": config.gradient_checkpointing,
    }


@dataclass(frozen=True)
class TrainingPlan:
    """How an update is cut into mini-batches, and where checkpoints may live."""

    ppo_mini_batch_samples: int
    ppo_epochs: int
    loss_agg_mode: str
    checkpoint_root: str | None


def controller_for(config: CriticServiceConfig, group: Any) -> "CriticController":
    """The controller a service config describes, over `group`."""
    return CriticController(
        group, fields_from(RequestBounds, config), fields_from(TrainingPlan, config)
    )


class CriticController(StatefulController):
    """Values and updates of one critic service (state: StatefulController)."""

    def __init__(self, group: Any, bounds: RequestBounds, plan: TrainingPlan):
        super().__init__(group, "critic", "critic checkpoint", REPLAY_HISTORY_STEPS, bounds=bounds)
        self.plan = plan

    @property
    def checkpoint_root(self) -> str | None:
        return self.plan.checkpoint_root

    async def compute_values(
        self, batch: Batch, deadline: Deadline = NO_DEADLINE
    ) -> tuple[Batch, dict[str, float]]:
        """values [N, R] (meta.weights_version = the version used) and timing metrics."""
        deadline.check("ComputeValues")
        clean = await self.checked_sequences(batch)

        async def work() -> tuple[Batch, dict[str, float]]:
            start = time.perf_counter()
            values = await self.group.run_split(COMPUTE_VALUES, clean, deadline=deadline.unix_s)
            metrics = {
                "forward_s": time.perf_counter() - start,
                "tokens": float(clean.tensors["response_mask"].sum()),
                "rows": float(len(clean)),
            }
            return Batch(values.tensors, meta={"weights_version": self.weights_version}), metrics

        return await self.read("ComputeValues", work, deadline)

    async def update_critic(
        self, step: int, batch: Batch, deadline: Deadline = NO_DEADLINE
    ) -> tuple[dict[str, float], int, bool]:
        """(metrics, weights_version after the step, replayed)."""

        async def check() -> UpdateWork:
            clean = update_batch(
                batch,
                await self.vocab_size(),
                self.bounds.max_batch_samples,
                self.plan.ppo_mini_batch_samples,
                self.bounds.max_request_tokens,
            )
            tokens = float(clean.tensors["response_mask"].sum())
            return UpdateWork(
                UPDATE_CRITIC,
                self._plan(step, clean),
                lambda answers, update_s: (_update_metrics(answers, tokens, update_s), None),
            )

        record, replayed = await self.update("UpdateCritic", step, batch, deadline, check)
        return record.metrics, record.weights_version, replayed

    def _plan(self, step: int, batch: Batch) -> list[RankUpdate]:
        """Each rank's rows and mini-batch slices (see the module docstring)."""
        plan = MiniBatchPlan.of(
            batch.tensors["response_mask"],
            self.plan.ppo_mini_batch_samples,
            len(self.group),
            self.plan.ppo_epochs,
            seed=step,
        )
        return plan.rank_updates(batch, self.plan.loss_agg_mode)


def _update_metrics(per_rank: list[Any], tokens: float, update_s: float) -> dict[str, float]:
    """An update's metrics from each rank's per-mini-batch answers: losses summed over
    ranks, clip fractions over the mini-batch's tokens, each averaged over mini-batches."""
    mini_batches = len(per_rank[0])
    totals = {"vf_loss": 0.0, "vf_clipfrac": 0.0, "grad_norm": 0.0, "lr": 0.0}
    for index in range(mini_batches):
        ranks = [results[index] for results in per_rank]
        mini_batch_tokens = sum(r["tokens"] for r in ranks)
        totals["vf_loss"] += sum(r["vf_loss"] for r in ranks)
        totals["vf_clipfrac"] += sum(r["clipped_tokens"] for r in ranks) / max(
            mini_batch_tokens, 1.0
        )
        totals["grad_norm"] += ranks[0]["grad_norm"]
        totals["lr"] += ranks[0]["lr"]
    metrics = {key: value / mini_batches for key, value in totals.items()}
    metrics.update(update_s=update_s, tokens=tokens, mini_batches=float(mini_batches))
    return metrics
