"""RolloutController: the rollout service's logic behind the RPCs, without gRPC or Ray.

What every stateful service shares is rlserve.core.service.controller.StatefulController:
one call at a time (a generation never sees half-updated weights), deadlines, atomic
updates that outlive their caller, the step ledger (UpdateActor is idempotent by step:
a retry with the batch it applied answers its stored result, replayed=true, whatever
version it carries), the broken state, the update rule (checks → broken? → replay →
apply), checkpoints under `checkpoint_root` and Reset. What is the rollout's own:

- **Weights versions.** Generation stamps its batch with the version that produced it;
  a request that names another version (expected_weights_version, or UpdateActor's
  weights_version for a new step) gets FAILED_PRECONDITION, so policies are never
  silently mixed.
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
- **Deadlines.** Every call to the workers is bounded by the caller's deadline (when
  sooner) or `worker_call_timeout_s`. Generation and log-probs also hand the deadline to
  the workers, which stop between tokens and micro-batches once it has passed, so an
  abandoned request does not keep the workers busy while later calls queue behind it.
- **Request size.** `max_batch_samples` bounds the rows a request carries or makes and
  `max_request_tokens` its token positions (rows × sequence length), before any work.
- **The merged reference** (serve_reference): ComputeRefLogProb on the frozen initial
  weights, beside the lock (they never change).

`group` is a `rlserve.core.workers.WorkerGroup` of ActorWorkers in the service (in unit
tests, the root conftest's in_process_group with the same interface).
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass
from typing import Any

import grpc
import torch

from rlserve.core import api
from rlserve.core.batch import Batch
from rlserve.core.config import fields_from
from rlserve.core.service.controller import StatefulController, UpdateWork
from rlserve.core.service.plan import MiniBatchPlan, count_columns, units_of
from rlserve.core.serving import Deadline, RpcError, failed_precondition
from rlserve.core.validation import TEMPERATURE_META_KEY, scoring_temperature
from rlserve.rollout.agent_rollout import AgentRollout
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
    check_update_rows,
)

NO_DEADLINE = Deadline()

SEQUENCE_KEYS = ("input_ids", "attention_mask", "responses", "response_mask")


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


class RolloutController(StatefulController):
    """Versions, sampling, generation and the actor's updates of one rollout service
    (state: StatefulController)."""

    def __init__(self, group: Any, settings: ControllerSettings):
        super().__init__(
            group,
            "rollout service",
            "rollout checkpoint",
            settings.kept_update_results,
            settings.worker_call_timeout_s,
        )
        self.settings = settings
        self._agent_rollout: AgentRollout | None = None

    @property
    def agent_rollout(self) -> AgentRollout:
        """Multi-turn generation, built at the first request that asks for it (it loads
        the tokenizer, for the chat template and the tool calls' text)."""
        if self._agent_rollout is None:
            from rlserve.core.modeling import load_tokenizer

            self._agent_rollout = AgentRollout(load_tokenizer(self.settings.model_path))
        return self._agent_rollout

    @property
    def checkpoint_root(self) -> str | None:
        return self.settings.checkpoint_root

    # ---- RPC logic ----------------------------------------------------------------------

    async def generate(
        self,
        prompts: Batch,
        sampling: SamplingSettings,
        expected_weights_version: int | None = None,
        deadline: Deadline = NO_DEADLINE,
        agent: api.Agent | None = None,
    ) -> tuple[Batch, dict[str, float]]:
        """Responses for left-padded prompts; meta.weights_version = the version used.
        With `agent`, multi-turn responses that call tools (rlserve.rollout.agent_rollout).

        Non-tensor columns of the prompts are repeated per response; `uid` is set to the
        index of the source prompt (replacing a `uid` column the caller sent).
        """
        settings = self.settings
        check_sampling(sampling, settings.max_new_tokens_limit)
        if agent is not None:
            self.agent_rollout.check(agent)
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

        agent_metrics: dict[str, float] = {}

        async def generate() -> tuple[Batch, int, float]:
            start = time.perf_counter()  # once the lock is held: the workers' time only
            if agent is None:
                result = await self.group.run_split(
                    GENERATE, work, sampling=sampling, deadline=deadline.unix_s
                )
            else:
                result, figures = await self.agent_rollout.run(
                    self.group, work, sampling, agent, deadline
                )
                agent_metrics.update(figures)
            return result, self.weights_version, time.perf_counter() - start

        result, version, elapsed_s = await self.read(
            "GenerateSequences",
            generate,
            deadline,
            lambda: self._check_expected_version(expected_weights_version),
        )
        temperature = sampling.temperature if sampling.temperature > 0 else 1.0
        meta = {**prompts.meta, "weights_version": version, TEMPERATURE_META_KEY: temperature}
        batch = Batch(result.tensors, result.non_tensors, meta)
        tokens = float(batch["response_mask"].sum())
        metrics = {
            "generate_s": elapsed_s,
            "generated_tokens": tokens,
            "generated_tokens_per_s": tokens / max(elapsed_s, 1e-9),
            **agent_metrics,
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
            start = time.perf_counter()  # once the lock is held: the workers' time only
            result = await self.group.run_split(
                COMPUTE_LOG_PROB,
                work,
                temperature=temperature,
                return_entropy=return_entropy,
                return_sum_pi_squared=return_sum_pi_squared,
                deadline=deadline.unix_s,
            )
            return result, self.weights_version, time.perf_counter() - start

        result, version, elapsed_s = await self.read(
            "ComputeLogProb",
            score,
            deadline,
            lambda: self._check_expected_version(expected_weights_version),
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
            self.group.run_split(
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
        settings = self.settings

        async def check() -> UpdateWork:
            clean = check_update_batch(
                batch,
                settings.vocab_size,
                settings.max_batch_samples,
                settings.use_kl_loss,
                settings.max_request_tokens,
            )
            plan = self._plan_update(clean, step)
            per_rank = plan.ordered_shares(
                self._update_work(clean), with_counts=settings.loss_normalizer == "mini_batch"
            )
            # without old log-probs the update's own forward is the behaviour policy
            single_pass = "old_log_probs" not in per_rank[0].tensors
            temperature = scoring_temperature(clean, settings.temperature)
            return UpdateWork(
                UPDATE_ACTOR,
                per_rank,
                functools.partial(_update_result, plan, len(batch), single_pass),
                {"temperature": temperature, "return_scores": single_pass},
            )

        record, replayed = await self.update(
            "UpdateActor",
            step,
            batch,
            deadline,
            check,
            lambda: self._check_version("weights_version", weights_version),
        )
        return UpdateResult(record.metrics, record.weights_version, replayed, record.scores)

    async def info(self) -> dict[str, Any]:
        """model, engine, weights_version, last_applied_step and workers (by rank)."""
        return {
            "model": self.settings.model_path,
            "engine": self.settings.engine,
            "weights_version": self.weights_version,
            "last_applied_step": self.last_applied_step,
            "workers": await self.worker_infos(),
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
        settings, workers = self.settings, len(self.group)
        mini = settings.ppo_mini_batch_samples
        check_update_rows(batch, workers, mini, settings.ppo_epochs)
        return MiniBatchPlan.of(
            batch["response_mask"], mini, workers, settings.ppo_epochs, settings.seed + step
        )

    def _update_work(self, batch: Batch) -> Batch:
        """The tensors of the update the workers read."""
        keys = [*SEQUENCE_KEYS, "advantages"]
        keys += [key for key in ("old_log_probs",) if key in batch.tensors]
        keys += ["ref_log_probs"] if self.settings.use_kl_loss else []
        return batch.select(tensor_keys=keys, non_tensor_keys=[], meta_keys=[])


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


def _update_result(
    plan: MiniBatchPlan, rows: int, single_pass: bool, answers: list[Any], update_s: float
) -> tuple[dict[str, float], Batch | None]:
    """An update's metrics from its ranks' answers, and for a single pass the log-probs
    and entropy of its own forward, in the request's row order."""
    scores = None
    if single_pass:
        scores = plan.in_request_order([part for _, part in answers], rows)
        answers = [rank_metrics for rank_metrics, _ in answers]
    metrics = _merge_rank_metrics(answers)
    metrics["update_s"] = update_s
    metrics["tokens_per_s"] = metrics["tokens"] / max(update_s, 1e-9)
    return metrics, scores


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
