"""The critic's controller: request checks, idempotent updates, versions, DP dispatch.

It runs inside the Serve replica (no gRPC here: the deployment translates protobuf) and
drives a group of CriticWorkers through any object with WorkerGroup's async interface
(run_all / run_split / run_each): `rlserve.core.workers.WorkerGroup` in the service,
in-process workers in unit tests. Either raises a worker's exception as itself (the
WorkerGroup unwraps Ray's task error), so an RpcError keeps its status and an OSError
can be caught here.

Choices:
- Exclusive access, deadlines and the broken state follow rlserve.core.exclusive (the
  rules every stateful service shares): one call at a time, so ComputeValues stamps the
  version its values were computed with and updates never interleave.
- UpdateCritic is idempotent by step (rlserve.core.steps.StepLedger, the rule every
  stateful service shares): the next step (last applied + 1) trains; a kept applied step
  sent with the batch it applied returns its stored metrics and version with
  replayed=true and trains nothing; the same step with another batch, and any other
  step, is FAILED_PRECONDITION.
- Checkpoints live under the configured checkpoint_root, named by relative paths
  (rlserve.core.checkpoint_paths). A load first has every rank read its state files
  weights-only, changing nothing, so a missing, corrupt or code-carrying checkpoint is
  FAILED_PRECONDITION and the critic keeps its weights.
- Mini-batches are planned here, over the request's global rows (a fresh permutation
  per epoch, seeded by the step), and every mini-batch is split evenly over the ranks;
  each rank receives only the rows its slices use. So N workers train what one worker
  would (see worker.py for the loss weighting), and rows must tile the mini-batches.
- Deadlines: the caller's deadline bounds the wait for the lock and for the workers.
  ComputeValues that runs out answers DEADLINE_EXCEEDED, and the workers, handed the
  same deadline, stop between forward micro-batches, so the next call does not queue
  behind work nobody waits for. An update, save or load is never cut in half: when the
  deadline passes, or the caller goes away, it keeps running to completion (the caller
  gets DEADLINE_EXCEEDED saying so); calling UpdateCritic again with the same step
  returns its result.
- Request size: rows (max_batch_samples) and token positions (max_request_tokens, rows
  × input_ids columns) are checked before any work.
"""

import logging
import time
from dataclasses import dataclass
from typing import Any

from rlserve.core.batch import Batch
from rlserve.core.checkpoint_paths import (
    checkpoint_path,
    load_refused,
    prepare_save_dir,
    ranks_left_waiting,
    require_load_dir,
    save_failed,
)
from rlserve.core.config import fields_from
from rlserve.core.exclusive import ExclusiveAccess
from rlserve.core.rank_worker import RankSetup
from rlserve.core.service.methods import CHECK_CHECKPOINT, LOAD_CHECKPOINT, RESET, SAVE_CHECKPOINT
from rlserve.core.service.plan import MiniBatchPlan, RankUpdate
from rlserve.core.serving import (
    Deadline,
    RpcError,
    failed_precondition,
    invalid_argument,
)
from rlserve.core.steps import StepLedger, batch_fingerprint
from rlserve.core.training import (
    DEEPSPEED_SUBDIR,
    DS_CHECKPOINT_TAG,
    OptimizerSettings,
    UnsafeCheckpointError,
)
from rlserve.core.worker_controller import RequestBounds, WorkerController
from rlserve.critic.config import CriticServiceConfig
from rlserve.critic.methods import COMPUTE_VALUES, UPDATE_CRITIC
from rlserve.critic.requests import ValueLossSettings, update_batch

logger = logging.getLogger(__name__)
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


class CriticController(WorkerController):
    """State (version, applied steps) and dispatch of one critic service."""

    def __init__(self, group: Any, bounds: RequestBounds, plan: TrainingPlan):
        super().__init__(group, bounds)
        self.plan = plan
        self.weights_version = 0
        # step -> (metrics, weights_version after it), the latest REPLAY_HISTORY_STEPS
        self.steps: StepLedger[tuple[dict[str, float], int]] = StepLedger(REPLAY_HISTORY_STEPS)
        self.access = ExclusiveAccess("critic")

    @property
    def last_applied_step(self) -> int:
        return self.steps.last_applied_step

    def health_problems(self) -> list[str]:
        """Why this service cannot serve: dead workers, weights left inconsistent."""
        return super().health_problems() + self.access.problems()

    # ---- ComputeValues ------------------------------------------------------------------

    async def compute_values(
        self, batch: Batch, deadline: Deadline = NO_DEADLINE
    ) -> tuple[Batch, dict[str, float]]:
        """values [N, R] (meta.weights_version = the version used) and timing metrics."""
        deadline.check("ComputeValues")
        clean = await self.checked_sequences(batch)

        async def work() -> tuple[Batch, dict[str, float]]:
            self.access.check_usable()
            start = time.perf_counter()
            values = await self.group.run_split(COMPUTE_VALUES, clean, deadline=deadline.unix_s)
            metrics = {
                "forward_s": time.perf_counter() - start,
                "tokens": float(clean.tensors["response_mask"].sum()),
                "rows": float(len(clean)),
            }
            return Batch(values.tensors, meta={"weights_version": self.weights_version}), metrics

        return await self.access.run("ComputeValues", work, deadline, atomic=False)

    # ---- UpdateCritic -------------------------------------------------------------------

    async def update_critic(
        self, step: int, batch: Batch, deadline: Deadline = NO_DEADLINE
    ) -> tuple[dict[str, float], int, bool]:
        """(metrics, weights_version after the step, replayed)."""
        if step < 0:
            raise invalid_argument("step", f"must be >= 0, got {step}")
        deadline.check("UpdateCritic")
        vocab_size = await self.vocab_size()
        fingerprint = batch_fingerprint(batch)

        async def work() -> tuple[dict[str, float], int, bool]:
            stored = self.steps.replay_or_require_next(step, fingerprint)
            if stored is not None:
                logger.info("UpdateCritic step %d replayed (the same batch, applied before)", step)
                metrics, version = stored
                return metrics, version, True
            self.access.check_usable()
            clean = update_batch(
                batch,
                vocab_size,
                self.bounds.max_batch_samples,
                self.plan.ppo_mini_batch_samples,
                self.bounds.max_request_tokens,
            )
            try:
                metrics = await self._train(step, clean)
            except BaseException as error:
                # Some ranks may have stepped their optimizer and others not.
                self.access.mark_broken(f"UpdateCritic step {step}", error)
                raise
            self.weights_version += 1
            self.steps.record(step, fingerprint, (metrics, self.weights_version))
            return metrics, self.weights_version, False

        return await self.access.run(f"UpdateCritic step {step}", work, deadline, atomic=True)

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

    async def _train(self, step: int, batch: Batch) -> dict[str, float]:
        start = time.perf_counter()
        per_rank = await self.group.run_each(UPDATE_CRITIC, self._plan(step, batch))
        mini_batches = len(per_rank[0])
        totals = {"vf_loss": 0.0, "vf_clipfrac": 0.0, "grad_norm": 0.0, "lr": 0.0}
        for index in range(mini_batches):
            ranks = [results[index] for results in per_rank]
            tokens = sum(r["tokens"] for r in ranks)
            totals["vf_loss"] += sum(r["vf_loss"] for r in ranks)
            totals["vf_clipfrac"] += sum(r["clipped_tokens"] for r in ranks) / max(tokens, 1.0)
            totals["grad_norm"] += ranks[0]["grad_norm"]
            totals["lr"] += ranks[0]["lr"]
        metrics = {key: value / mini_batches for key, value in totals.items()}
        metrics.update(
            update_s=time.perf_counter() - start,
            tokens=float(batch.tensors["response_mask"].sum()),
            mini_batches=float(mini_batches),
        )
        return metrics

    # ---- checkpoints ----------------------------------------------------------------------

    async def save_checkpoint(self, path: str, deadline: Deadline = NO_DEADLINE) -> tuple[int, int]:
        """(weights_version, last_applied_step) written to `path`, a name relative to
        checkpoint_root (a directory that cannot be written is FAILED_PRECONDITION)."""
        directory = checkpoint_path(self.plan.checkpoint_root, path)
        prepare_save_dir(directory)
        deadline.check("SaveCheckpoint")

        async def work() -> tuple[int, int]:
            self.access.check_usable()
            client_state = {
                "weights_version": self.weights_version,
                "last_applied_step": self.last_applied_step,
                "applied": [
                    [step, metrics, version, fingerprint]
                    for step, fingerprint, (metrics, version) in self.steps.entries()
                ],
            }
            try:
                await self.group.run_all(SAVE_CHECKPOINT, str(directory), client_state)
            except RpcError:  # a lost worker (UNAVAILABLE): not a write failure
                raise
            except Exception as error:  # disk full, permissions: the weights are untouched
                ranks = len(self.group)
                if ranks_left_waiting(ranks):
                    self.access.mark_broken("SaveCheckpoint", error)
                raise save_failed(directory, error, ranks) from None
            return self.weights_version, self.last_applied_step

        return await self.access.run("SaveCheckpoint", work, deadline, atomic=True)

    async def load_checkpoint(self, path: str, deadline: Deadline = NO_DEADLINE) -> tuple[int, int]:
        """(weights_version, last_applied_step) restored from `path` (relative to
        checkpoint_root). Every rank first reads its state files weights-only, changing
        nothing: a missing, corrupt or code-carrying checkpoint is FAILED_PRECONDITION and
        the critic keeps its weights."""
        directory = checkpoint_path(self.plan.checkpoint_root, path)
        require_load_dir(directory, "critic checkpoint")
        if not (directory / DEEPSPEED_SUBDIR / DS_CHECKPOINT_TAG).is_dir():
            raise failed_precondition(
                f"location.path: no critic checkpoint at {directory} (SaveCheckpoint writes one)"
            )
        deadline.check("LoadCheckpoint")

        async def work() -> tuple[int, int]:
            try:
                states = await self.group.run_all(
                    CHECK_CHECKPOINT, str(directory), list(CLIENT_STATE_KEYS)
                )
                weights_version, last_applied_step, applied = _parse_client_state(states[0])
            except (FileNotFoundError, UnsafeCheckpointError, ValueError) as error:
                raise load_refused(directory, "critic checkpoint", error) from None
            try:
                await self.group.run_all(LOAD_CHECKPOINT, str(directory))
                self.steps.restore(last_applied_step, applied)
            except BaseException as error:
                self.access.mark_broken(f"LoadCheckpoint of {path!r}", error)
                raise
            self.weights_version = weights_version
            self.access.mark_known()
            return self.weights_version, self.last_applied_step

        return await self.access.run("LoadCheckpoint", work, deadline, atomic=True)

    async def reset(self, deadline: Deadline = NO_DEADLINE) -> tuple[int, int]:
        """Back to the deployed state (initial weights, value head zero, fresh optimizer,
        version 0, no applied step); returns (weights_version, last_applied_step)."""

        async def work() -> tuple[int, int]:
            try:
                await self.group.run_all(RESET)
            except BaseException as error:
                self.access.mark_broken("Reset", error)
                raise
            self.steps = StepLedger(REPLAY_HISTORY_STEPS)
            self.weights_version = 0
            self.access.mark_known()
            return self.weights_version, self.last_applied_step

        return await self.access.run("Reset", work, deadline, atomic=True)


CLIENT_STATE_KEYS = ("weights_version", "last_applied_step", "applied")
"""What SaveCheckpoint stores beside the weights (DeepSpeed's client_state)."""


def _parse_client_state(state: dict[str, Any]) -> tuple[int, int, list[tuple[int, str, Any]]]:
    """(weights_version, last_applied_step, applied-step ledger) of a checkpoint, read
    before anything loads: ValueError naming what is wrong, so a checkpoint that cannot
    restore them is refused while the critic still holds its own weights."""
    missing = [key for key in CLIENT_STATE_KEYS if key not in state]
    if missing:
        raise ValueError(f"its client state lacks {missing}")
    try:
        # entries of checkpoints from before fingerprints have three fields: their
        # steps are never replayed (no batch matches "")
        applied = [
            (
                int(entry[0]),
                str(entry[3]) if len(entry) > 3 else "",
                (dict(entry[1]), int(entry[2])),
            )
            for entry in state["applied"]
        ]
        return int(state["weights_version"]), int(state["last_applied_step"]), applied
    except (TypeError, ValueError) as error:
        raise ValueError(f"its client state is malformed ({error})") from None
