"""RolloutController: the rollout service's logic behind the RPCs, without gRPC or Ray.

It owns what is service-wide rather than per rank:

- **Weights versions.** 0 for the loaded model, +1 per applied update. Generation stamps
  its batch with the version that produced it; a request that names another version
  (expected_weights_version, UpdateActor.weights_version) gets FAILED_PRECONDITION, so
  policies are never silently mixed.
- **Idempotent updates.** An UpdateActor carries its step, checked by
  rlserve.core.steps.StepLedger (the rule every stateful service shares): the next step
  (last applied + 1) trains; a kept applied step (the last `kept_update_results`) sent
  with the batch it applied gets its stored result with replayed=true and trains nothing,
  whatever version it carries (a retry carries the version its update consumed); the
  same step with another batch, and any other step, is FAILED_PRECONDITION.
- **Temperature.** Log-probs are taken under softmax(logits / T). GenerateSequences
  stamps its batch's meta with the sampling temperature (`temperature`; 1 for greedy),
  and ComputeLogProb / UpdateActor use the T their batch's meta carries, else the
  configured default, so scoring matches how the samples were drawn.
- **Data-parallel dispatch.** Generation and log-probs go through `run_split` (split with
  padding, collect in order). An update is planned here, once, by
  rlserve.core.service.plan.MiniBatchPlan (the critic's plan too): each epoch shuffles
  the rows (seeded by config seed + step), cuts mini-batches, and gives every rank an
  equal contiguous share of each, so the same request trains identically with 1 or N
  workers; with loss_normalizer "mini_batch" each row carries its mini-batch's global
  loss units.
- **Failure containment** (rlserve.core.exclusive, shared with the critic). Calls run
  one at a time, so a generation can never see half-updated weights. An update or
  checkpoint load that fails after it reached the workers may have left weights
  changed, so the controller refuses further work (FAILED_PRECONDITION) until a
  LoadCheckpoint or Reset succeeds.
- **Reset** puts the service back where its deployment left it (initial weights in a
  new DeepSpeed engine, fresh optimizer, version 0, empty ledger), in the same worker
  processes: a new run on a deployed service starts in seconds, not a redeployment.
- **Checkpoints** live under the configured `checkpoint_root`; requests name them by a
  relative path (rlserve.core.checkpoint_paths refuses anything that could leave the
  root). A load first has every rank read its state files weights-only, changing
  nothing, so a missing, corrupt or code-carrying checkpoint leaves the service as it
  was (FAILED_PRECONDITION); only a failure inside the load itself marks it broken.
- **Deadlines.** Every call to the workers has a timeout: the caller's deadline (when
  sooner) or `worker_call_timeout_s`. Generation and log-probs also hand the deadline to
  the workers, which stop between tokens and micro-batches once it has passed, so an
  abandoned request does not keep the workers busy (and growing) while later calls
  queue behind it. Updates and checkpoints check the caller's deadline before they start
  but then run to completion, even when the caller goes away, since stopping half-way
  would leave ranks out of step.
- **Request size.** `max_batch_samples` bounds the rows a request carries or makes and
  `max_request_tokens` its token positions (rows × sequence length), before any work.

`workers` is a `rlserve.core.workers.WorkerGroup` of ActorWorkers in the service (in
unit tests, the root conftest's in-process group with the same interface).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import grpc
import torch

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
from rlserve.core.service.methods import (
    CHECK_CHECKPOINT,
    INFO,
    LOAD_CHECKPOINT,
    RESET,
    SAVE_CHECKPOINT,
)
from rlserve.core.service.plan import MiniBatchPlan, count_columns, units_of
from rlserve.core.serving import Deadline, RpcError, failed_precondition, invalid_argument
from rlserve.core.steps import StepLedger, batch_fingerprint
from rlserve.core.training import UnsafeCheckpointError
from rlserve.core.validation import TEMPERATURE_META_KEY, scoring_temperature
from rlserve.rollout.config import RolloutServiceConfig
from rlserve.rollout.generation import SamplingSettings
from rlserve.rollout.methods import (
    COMPUTE_LOG_PROB,
    COMPUTE_REF_LOG_PROB,
    GENERATE,
    UPDATE_ACTOR,
)
from rlserve.rollout.request_checks import (
    check_prompts,
    check_sampling,
    check_sequences,
    check_update_batch,
)

logger = logging.getLogger(__name__)
NO_DEADLINE = Deadline()

SEQUENCE_KEYS = ("input_ids", "attention_mask", "responses", "response_mask")


class Workers(Protocol):
    """What the controller needs from its data-parallel workers (WorkerGroup's methods)."""

    def __len__(self) -> int: ...

    async def run_all(self, method: str, *args: Any, **kwargs: Any) -> list[Any]: ...

    async def run_split(self, method: str, batch: Batch, **kwargs: Any) -> Batch: ...

    async def run_each(self, method: str, per_rank: Sequence[Any], **kwargs: Any) -> list: ...

    def dead_workers(self) -> list[str]: ...


@dataclass(frozen=True)
class UpdateRecord:
    """What an applied UpdateActor answered, kept for retries."""

    step: int
    weights_version: int
    metrics: dict[str, float]
    scores: Batch | None = None


@dataclass(frozen=True)
class UpdateResult:
    metrics: dict[str, float]
    weights_version: int
    replayed: bool
    scores: Batch | None = None
    """log_probs and entropy [N, R] of the update's own forward, in the request's row
    order, when the request left old_log_probs out."""


@dataclass(frozen=True)
class ControllerSettings:
    """Service-wide limits and training plan (plain values, built from the config)."""

    model_path: str
    engine: str
    vocab_size: int
    max_positions: int
    max_batch_samples: int
    max_new_tokens_limit: int
    max_request_tokens: int
    ppo_epochs: int
    ppo_mini_batch_samples: int
    use_kl_loss: bool
    temperature: float
    """Scoring temperature for batches whose meta carries none."""
    seed: int
    kept_update_results: int
    worker_call_timeout_s: float
    loss_normalizer: str = "micro_batch"
    """"mini_batch": each row carries its mini-batch's token and sequence counts, and the
    workers normalise their loss by them (rlserve.core.algos.aggregation.mini_batch_loss_scale)."""
    serve_reference: bool = False
    """Workers hold frozen initial weights and answer ComputeRefLogProb."""
    checkpoint_root: str | None = None
    """Directory checkpoints are confined to (names are relative to it); None = none."""


class RolloutController:
    """Versions, idempotency, validation and dispatch for one rollout service."""

    def __init__(self, workers: Workers, settings: ControllerSettings):
        self.workers = workers
        self.settings = settings
        self.weights_version = 0
        self.steps: StepLedger[UpdateRecord] = StepLedger(settings.kept_update_results)
        self.access = ExclusiveAccess("rollout service", settings.worker_call_timeout_s)
        self._worker_info: list[dict[str, Any]] | None = None

    @property
    def last_applied_step(self) -> int:
        return self.steps.last_applied_step

    def health_problems(self) -> list[str]:
        """Why this service cannot serve: dead workers, weights left inconsistent."""
        return self.workers.dead_workers() + self.access.problems()

    # ---- RPC logic ----------------------------------------------------------------------

    async def generate(
        self,
        prompts: Batch,
        sampling: SamplingSettings,
        expected_weights_version: int | None = None,
        deadline: Deadline = NO_DEADLINE,
    ) -> tuple[Batch, dict[str, float]]:
        """Responses for left-padded prompts; meta.weights_version = the version used.

        Non-tensor columns of the prompts are repeated per response; `uid` is set to the
        index of the source prompt (replacing a `uid` column the caller sent).
        """
        settings = self.settings
        check_sampling(sampling, settings.max_new_tokens_limit)
        prompts = check_prompts(
            prompts,
            settings.vocab_size,
            settings.max_positions,
            sampling.max_new_tokens,
            sampling.responses_per_prompt,
            settings.max_batch_samples,
            settings.max_request_tokens,
        )
        # uid = index of the source prompt, set before the split so it is global.
        work = Batch(
            {key: prompts[key] for key in ("input_ids", "attention_mask")},
            {**prompts.non_tensors, "uid": list(range(len(prompts)))},
        )

        async def generate() -> tuple[Batch, int, float]:
            self.access.check_usable()
            self._check_expected_version(expected_weights_version)
            deadline.check("GenerateSequences")
            start = time.perf_counter()  # once the lock is held: the workers' time only
            result = await self.workers.run_split(
                GENERATE, work, sampling=sampling, deadline=deadline.unix_s
            )
            return result, self.weights_version, time.perf_counter() - start

        result, version, elapsed_s = await self.access.run(
            "GenerateSequences", generate, deadline, atomic=False
        )
        temperature = sampling.temperature if sampling.temperature > 0 else 1.0
        meta = {**prompts.meta, "weights_version": version, TEMPERATURE_META_KEY: temperature}
        batch = Batch(result.tensors, result.non_tensors, meta)
        tokens = float(batch["response_mask"].sum())
        metrics = {
            "generate_s": elapsed_s,
            "generated_tokens": tokens,
            "generated_tokens_per_s": tokens / max(elapsed_s, 1e-9),
        }
        return batch, metrics

    async def compute_log_prob(
        self,
        batch: Batch,
        return_entropy: bool = False,
        expected_weights_version: int | None = None,
        deadline: Deadline = NO_DEADLINE,
        return_sum_pi_squared: bool = False,
    ) -> tuple[Batch, dict[str, float]]:
        """log_probs [N, R] (+ entropy, + sum_pi_squared) under the current weights."""
        settings = self.settings
        batch = check_sequences(
            batch, settings.vocab_size, settings.max_batch_samples, settings.max_request_tokens
        )
        temperature = scoring_temperature(batch, settings.temperature)
        work = batch.select(tensor_keys=SEQUENCE_KEYS, non_tensor_keys=[], meta_keys=[])

        async def score() -> tuple[Batch, int, float]:
            self.access.check_usable()
            self._check_expected_version(expected_weights_version)
            deadline.check("ComputeLogProb")
            start = time.perf_counter()  # once the lock is held: the workers' time only
            result = await self.workers.run_split(
                COMPUTE_LOG_PROB,
                work,
                temperature=temperature,
                return_entropy=return_entropy,
                return_sum_pi_squared=return_sum_pi_squared,
                deadline=deadline.unix_s,
            )
            return result, self.weights_version, time.perf_counter() - start

        result, version, elapsed_s = await self.access.run(
            "ComputeLogProb", score, deadline, atomic=False
        )
        tokens = float(batch["response_mask"].sum())
        metrics = {
            "forward_s": elapsed_s,
            "tokens": tokens,
            "tokens_per_s": tokens / max(elapsed_s, 1e-9),
        }
        return Batch(result.tensors, meta={"weights_version": version}), metrics

    async def compute_ref_log_prob(
        self, batch: Batch, deadline: Deadline = NO_DEADLINE
    ) -> tuple[Batch, dict[str, float]]:
        """ref_log_probs [N, R] under the initial weights (ReferenceService, merged here).

        No lock: the reference weights never change, so updates need not wait for it."""
        if not self.settings.serve_reference:
            raise RpcError(
                grpc.StatusCode.FAILED_PRECONDITION,
                "this rollout service holds no reference weights: deploy it with "
                "serve_reference: true, or call the reference service",
            )
        settings = self.settings
        batch = check_sequences(
            batch, settings.vocab_size, settings.max_batch_samples, settings.max_request_tokens
        )
        temperature = scoring_temperature(batch, settings.temperature)
        work = batch.select(tensor_keys=SEQUENCE_KEYS, non_tensor_keys=[], meta_keys=[])
        deadline.check("ComputeRefLogProb")
        start = time.perf_counter()
        result = await self.access.run_unlocked(
            "ComputeRefLogProb",
            self.workers.run_split(
                COMPUTE_REF_LOG_PROB, work, temperature=temperature, deadline=deadline.unix_s
            ),
            deadline,
        )
        metrics = {
            "forward_s": time.perf_counter() - start,
            "tokens": float(batch["response_mask"].sum()),
            "rows": float(len(batch)),
            "temperature": temperature,
        }
        return Batch(result.tensors, meta={"weights_version": 0}), metrics

    async def update_actor(
        self, step: int, weights_version: int, batch: Batch, deadline: Deadline = NO_DEADLINE
    ) -> UpdateResult:
        """One PPO update (all epochs and mini-batches), applied at most once per step.

        The update runs as its own task: if the caller goes away (cancellation), it still
        finishes and records its result, so the caller's retry is answered by a replay.
        """
        if step < 0:
            raise invalid_argument("step", f"must be >= 0, got {step}")
        fingerprint = batch_fingerprint(batch)
        return await self.access.run(
            f"UpdateActor step {step}",
            lambda: self._update_actor(step, weights_version, batch, fingerprint),
            deadline,
            atomic=True,
        )

    async def _update_actor(
        self, step: int, weights_version: int, batch: Batch, fingerprint: str
    ) -> UpdateResult:
        settings = self.settings
        self.access.check_usable()
        stored = self.steps.replay_or_require_next(step, fingerprint)
        if stored is not None:
            logger.info("UpdateActor step %d replayed (the same batch, applied before)", step)
            return UpdateResult(
                stored.metrics, stored.weights_version, replayed=True, scores=stored.scores
            )
        self._check_version("weights_version", weights_version)
        batch = check_update_batch(
            batch,
            settings.vocab_size,
            settings.max_batch_samples,
            settings.use_kl_loss,
            settings.max_request_tokens,
        )
        plan = self._plan_update(batch, step)
        per_rank = plan.ordered_shares(
            self._update_work(batch), with_counts=settings.loss_normalizer == "mini_batch"
        )
        temperature = scoring_temperature(batch, settings.temperature)
        single_pass = "old_log_probs" not in batch.tensors
        start = time.perf_counter()
        try:
            results = await self.workers.run_each(
                UPDATE_ACTOR, per_rank, temperature=temperature, return_scores=single_pass
            )
        except BaseException as error:
            self.access.mark_broken(f"UpdateActor step {step}", error)
            raise
        scores = None
        if single_pass:
            scores = plan.in_request_order([part for _, part in results], len(batch))
            results = [rank_metrics for rank_metrics, _ in results]
        metrics = _merge_rank_metrics(results)
        metrics["update_s"] = time.perf_counter() - start
        metrics["tokens_per_s"] = metrics["tokens"] / max(metrics["update_s"], 1e-9)
        self.weights_version += 1
        record = UpdateRecord(step, self.weights_version, metrics, scores)
        self.steps.record(step, fingerprint, record)
        return UpdateResult(metrics, self.weights_version, replayed=False, scores=scores)

    async def save_checkpoint(self, path: str, deadline: Deadline = NO_DEADLINE) -> tuple[int, int]:
        """Writes <root>/<path>/model and .../deepspeed; returns (weights_version, last step).

        `path` is relative to the configured checkpoint_root (rlserve.core.checkpoint_paths).
        A directory that cannot be written is FAILED_PRECONDITION; nothing changes.
        """
        directory = checkpoint_path(self.settings.checkpoint_root, path)
        prepare_save_dir(directory)
        return await self.access.run(
            "SaveCheckpoint", lambda: self._save_checkpoint(directory), deadline, atomic=True
        )

    async def _save_checkpoint(self, directory: Path) -> tuple[int, int]:
        self.access.check_usable()
        state = self._client_state()
        try:
            await self.workers.run_all(SAVE_CHECKPOINT, str(directory), state)
        except RpcError:  # a lost worker (UNAVAILABLE): not a write failure
            raise
        except Exception as error:  # disk full, permissions: the weights are untouched
            ranks = len(self.workers)
            if ranks_left_waiting(ranks):
                self.access.mark_broken("SaveCheckpoint", error)
            raise save_failed(directory, error, ranks) from None
        return self.weights_version, self.last_applied_step

    async def load_checkpoint(self, path: str, deadline: Deadline = NO_DEADLINE) -> tuple[int, int]:
        """Restores a SaveCheckpoint directory; returns (weights_version, last step).

        Every rank first reads its state files weights-only (check_checkpoint, nothing
        changes): a missing, corrupt or code-carrying checkpoint is FAILED_PRECONDITION
        and the service keeps serving what it had.
        """
        directory = checkpoint_path(self.settings.checkpoint_root, path)
        require_load_dir(directory, "rollout checkpoint")
        return await self.access.run(
            "LoadCheckpoint", lambda: self._load_checkpoint(directory), deadline, atomic=True
        )

    async def _load_checkpoint(self, directory: Path) -> tuple[int, int]:
        path = str(directory)
        try:
            states = await self.workers.run_all(CHECK_CHECKPOINT, path, list(CLIENT_STATE_KEYS))
            restored = _parse_client_state(states[0])
        except (FileNotFoundError, UnsafeCheckpointError, ValueError) as error:
            raise load_refused(directory, "rollout checkpoint", error) from None
        try:
            await self.workers.run_all(LOAD_CHECKPOINT, str(directory))
            self.steps.restore(restored.last_applied_step, restored.updates)
            self.weights_version = restored.weights_version
        except FileNotFoundError as error:  # nothing was loaded: the state is intact
            raise failed_precondition(
                f"location.path: no rollout checkpoint under {path!r} ({error})"
            ) from None
        except BaseException as error:
            self.access.mark_broken(f"LoadCheckpoint of {path!r}", error)
            raise
        self.access.mark_known()
        return self.weights_version, self.last_applied_step

    async def reset(self, deadline: Deadline = NO_DEADLINE) -> tuple[int, int]:
        """Back to the deployed state (initial weights, fresh optimizer, version 0, no
        applied step); returns (weights_version, last_applied_step). Works on a broken
        state too: it is a way back to a known one."""

        async def work() -> tuple[int, int]:
            try:
                await self.workers.run_all(RESET)
            except BaseException as error:
                self.access.mark_broken("Reset", error)
                raise
            self.steps = StepLedger(self.settings.kept_update_results)
            self.weights_version = 0
            self.access.mark_known()
            return self.weights_version, self.last_applied_step

        return await self.access.run("Reset", work, deadline, atomic=True)

    async def info(self) -> dict[str, Any]:
        """model, engine, weights_version, last_applied_step and workers (by rank)."""
        if self._worker_info is None:
            # Cached: workers never move, and asking them would queue behind a long update.
            self._worker_info = await self.workers.run_all(INFO)
        return {
            "model": self.settings.model_path,
            "engine": self.settings.engine,
            "weights_version": self.weights_version,
            "last_applied_step": self.last_applied_step,
            "workers": self._worker_info,
        }

    # ---- helpers ------------------------------------------------------------------------

    def _check_expected_version(self, expected: int | None) -> None:
        if expected is not None:
            self._check_version("expected_weights_version", expected)

    def _check_version(self, field: str, version: int) -> None:
        current = self.weights_version
        if version < current:
            raise failed_precondition(
                f"{field}: {version} is stale; the service has moved on to weights version "
                f"{current}"
            )
        if version > current:
            raise failed_precondition(
                f"{field}: {version} is unknown; the service's weights version is {current}"
            )

    def _plan_update(self, batch: Batch, step: int) -> MiniBatchPlan:
        """The update's mini-batches and each rank's share of them."""
        settings, workers = self.settings, len(self.workers)
        rows, mini = len(batch), settings.ppo_mini_batch_samples
        if rows % workers:
            raise invalid_argument(
                "batch", f"{rows} rows must be a multiple of the {workers} workers"
            )
        if rows % mini:
            raise invalid_argument(
                "batch",
                f"{rows} rows must be a multiple of ppo_mini_batch_samples {mini} "
                f"(split over {workers} workers)",
            )
        if "old_log_probs" not in batch.tensors and (settings.ppo_epochs > 1 or rows > mini):
            raise invalid_argument(
                "batch.tensors['old_log_probs']",
                f"may be left out only when the update is one optimizer step (ppo_epochs 1, "
                f"rows = ppo_mini_batch_samples {mini}), as then the update's own forward "
                f"is the behaviour policy; this update has {settings.ppo_epochs} epoch(s) "
                f"over {rows} rows: send ComputeLogProb's log_probs",
            )
        return MiniBatchPlan.of(
            batch["response_mask"], mini, workers, settings.ppo_epochs, settings.seed + step
        )

    def _update_work(self, batch: Batch) -> Batch:
        """The tensors of the update the workers read."""
        keys = [*SEQUENCE_KEYS, "advantages"]
        keys += [key for key in ("old_log_probs",) if key in batch.tensors]
        keys += ["ref_log_probs"] if self.settings.use_kl_loss else []
        return batch.select(tensor_keys=keys, non_tensor_keys=[], meta_keys=[])

    def _client_state(self) -> dict[str, Any]:
        return {
            "weights_version": self.weights_version,
            "last_applied_step": self.last_applied_step,
            "updates": [
                [r.step, r.weights_version, dict(r.metrics), fingerprint]
                for _, fingerprint, r in self.steps.entries()
            ],
        }


CLIENT_STATE_KEYS = ("weights_version", "last_applied_step", "updates")
"""What SaveCheckpoint stores beside the weights (DeepSpeed's client_state)."""


@dataclass(frozen=True)
class ClientState:
    weights_version: int
    last_applied_step: int
    updates: list[tuple[int, str, UpdateRecord]]


def _parse_client_state(state: dict[str, Any]) -> ClientState:
    """The versions and update ledger a checkpoint stores, read before anything loads
    (ValueError naming what is wrong: a checkpoint that cannot restore them is refused
    while the service still holds its own weights)."""
    missing = [key for key in CLIENT_STATE_KEYS if key not in state]
    if missing:
        raise ValueError(f"its client state lacks {missing}")
    try:
        return ClientState(
            weights_version=int(state["weights_version"]),
            last_applied_step=int(state["last_applied_step"]),
            updates=[
                (int(step), str(fpr), UpdateRecord(int(step), int(version), dict(metrics)))
                for step, version, metrics, fpr in state["updates"]
            ],
        )
    except (TypeError, ValueError) as error:
        raise ValueError(f"its client state is malformed ({error})") from None


def update_row_plan(
    rows: int, mini_batch_samples: int, workers: int, epochs: int, seed: int
) -> list[torch.Tensor]:
    """Row indices per rank, in training order (MiniBatchPlan.rank_rows of a plan whose
    loss units do not matter)."""
    mask = torch.ones(rows, 1, dtype=torch.bool)
    plan = MiniBatchPlan.of(mask, mini_batch_samples, workers, epochs, seed)
    return [plan.rank_rows(rank) for rank in range(workers)]


def with_mini_batch_counts(shares: list[Batch], share_rows: int) -> list[Batch]:
    """Each rank's rows (rank r's k-th block of `share_rows` rows is its share of
    mini-batch k) plus MiniBatchPlan's count columns of each row's mini-batch."""
    blocks = len(shares[0]) // share_rows
    units = [
        units_of(
            torch.cat([s["response_mask"][k * share_rows : (k + 1) * share_rows] for s in shares])
        )
        for k in range(blocks)
    ]
    columns = count_columns([t for t, _ in units], [q for _, q in units], share_rows)
    return [Batch({**s.tensors, **columns}, s.non_tensors, s.meta) for s in shares]


def _merge_rank_metrics(results: list[dict[str, float]]) -> dict[str, float]:
    """Means over ranks (each ran the same number of micro-batches); tokens are summed."""
    merged = {key: sum(r[key] for r in results) / len(results) for key in results[0]}
    merged["tokens"] = float(sum(r["tokens"] for r in results))
    return merged


def controller_settings(
    config: RolloutServiceConfig, vocab_size: int, max_positions: int
) -> ControllerSettings:
    """The controller's plain settings from the service config and the model's limits."""
    return fields_from(
        ControllerSettings, config, vocab_size=vocab_size, max_positions=max_positions
    )
