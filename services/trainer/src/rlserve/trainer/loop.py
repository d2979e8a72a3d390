"""The PPO loop: one step = generate, four concurrent forwards, advantages, two updates.

The trainer owns no model. Every model call is a gRPC call to a service (through the
shared Serve proxy) with a deadline and the retry policy of rlserve.core.rpc; updates
carry their step number so a retried update is never applied twice. Each generation
request names the weights version it expects, and the version the actor reports after
an update becomes the next expectation, so policies are never mixed unknowingly; a
step records its batch's staleness (weights versions between generation and training).

`PPOTrainer._run_step` is the step, phase by phase: its generation, the forwards (old
log-probs, reward, ReMax's greedy baseline, reference log-probs, values), the batch
with their results (and rollout correction's weights), advantages, the actor's batch,
the two updates, the KL controller and the step's metrics (rlserve.trainer.step_metrics).
rollout.mode's schedule (rlserve.trainer.schedule: 'sync' or 'one_step_off') decides
when a step's batch is generated; the step calls it for its generation, once its old
log-probs are in (one_step_off starts the next step's generation then) and before the
actor's update (which one_step_off holds until that generation is done). Rewards are
rlserve.trainer.rewards', dynamic sampling's rounds rlserve.trainer.dynamic_sampling's,
and a checkpoint's round trip through the services rlserve.trainer.checkpoint's.

Tracing: each step is one trace. `run_step` opens the root span `ppo.step` (attribute
`rlserve.step`: the step's number as metrics.jsonl, TensorBoard, the progress bar and
checkpoints count it, from 1; requests number it from 0), current while the step's
calls run — asyncio tasks copy the context, so every client span (rlserve.core.rpc) of
the concurrent forwards and updates is its child — plus `trainer.advantages` for the
trainer's own math. `evaluate` and `save_checkpoint` are traces of their own
(`trainer.evaluate`, `trainer.checkpoint`, with the step they follow), so a step's trace
and `time/step_s` cover the same work.
"""

import asyncio
import logging
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import torch

from rlserve.core import api, tracing
from rlserve.core.algos.advantage_registry import estimator_needs
from rlserve.core.algos.dapo import truncated_responses
from rlserve.core.algos.kl import AdaptiveKLController, FixedKLController
from rlserve.core.algos.rollout_correction import truncated_is_weights
from rlserve.core.batch import Batch
from rlserve.core.environment_settings import AgentConfig
from rlserve.core.run_config import RunConfig
from rlserve.trainer.advantages import (
    advantage_settings,
    compute_advantages,
    reference_drift,
    with_weighted_advantages,
    without_failed_tool_signal,
)
from rlserve.trainer.checkpoint import (
    load_service_checkpoints,
    restore_rng,
    rng_state,
    save_checkpoint,
)
from rlserve.trainer.clients import Clients
from rlserve.trainer.data import PromptRow, PromptStream, prompt_batch
from rlserve.trainer.dynamic_sampling import informative_batch
from rlserve.trainer.rewards import Rewards, warn_reward_failures
from rlserve.trainer.schedule import Generation, schedule_for
from rlserve.trainer.step_metrics import step_metrics
from rlserve.v1 import critic_pb2, rollout_pb2

SEQUENCE_KEYS = ["input_ids", "attention_mask", "responses", "response_mask"]


logger = logging.getLogger(__name__)

T = TypeVar("T")


async def _timed(name: str, timings: dict[str, float], call: Awaitable[Any]) -> Any:
    started = time.perf_counter()
    try:
        return await call
    finally:
        timings[f"time/{name}_s"] = time.perf_counter() - started


async def _then(call: Awaitable[T], after: Callable[[], None]) -> T:
    """`call`'s result, after calling `after()` once it is in (not when `call` fails)."""
    result = await call
    after()
    return result


def _kl_controller(config: RunConfig) -> FixedKLController | AdaptiveKLController:
    kl = config.algorithm.kl_ctrl
    if kl.kind == "adaptive":
        return AdaptiveKLController(kl.kl_coef, kl.target_kl, kl.horizon)
    return FixedKLController(kl.kl_coef)


@dataclass
class TrainerState:
    """Everything besides the services' checkpoints that a resumed run needs."""

    step: int = 0
    """Steps completed."""
    weights_version: int = 0
    """Actor weights version the next generation must use."""
    last_metrics: dict[str, float] = field(default_factory=dict)


@dataclass
class _StepInProgress:
    """A step that started and has not completed: what the trainer held at its start,
    and the results of its calls so far. A failure that cost no service its state runs
    the step again from here (`rewind`), reusing what was already computed, so it
    sends the same batch: an update the service applied before the failure is answered
    as a replay."""

    step: int
    weights_version: int
    kl_controller: dict[str, Any]
    stream: dict[str, Any]
    rng: dict[str, Any]
    took_early_generation: bool
    """one_step_off: the step's batch was asked for during the step before, from the
    weights before that step's update, which the rollout no longer holds."""
    generation: Generation | None = None
    after_generation: tuple[dict[str, Any], dict[str, Any]] | None = None
    """The prompt stream's and RNGs' states once the generation drew its prompts."""
    forwards: dict[str, Any] | None = None
    reward_figures: Counter[str] | None = None


class PPOTrainer:
    """Runs PPO steps against deployed services; see the module docstring."""

    def __init__(
        self,
        config: RunConfig,
        clients: Clients,
        tokenizer: Any,
        train_rows: list[PromptRow],
        eval_rows: list[PromptRow],
        run_dir: Path,
    ):
        self.config = config
        self.clients = clients
        self.tokenizer = tokenizer
        self.stream = PromptStream(train_rows, seed=config.trainer.seed)
        self.eval_rows = eval_rows[: config.rollout.eval_prompts]
        self.run_dir = run_dir
        self.kl_controller = _kl_controller(config)
        self.state = TrainerState()
        self.advantage_settings = advantage_settings(config)
        self.rewards = Rewards(clients.reward, config)
        self.agent = agent_params(config.rollout.agent)
        self.schedule = schedule_for(
            config.rollout.mode, self._generation_for, config.trainer.total_steps
        )
        self._in_progress: _StepInProgress | None = None

    # --- generation -------------------------------------------------------------------

    def _sampling(self, step: int, round_index: int = 0, greedy: bool = False) -> api.Sampling:
        rollout = self.config.rollout
        return api.Sampling(
            temperature=0.0 if greedy else rollout.temperature,
            top_p=rollout.top_p,
            top_k=rollout.top_k,
            max_new_tokens=rollout.max_new_tokens,
            responses_per_prompt=1 if greedy else rollout.responses_per_prompt,
            # Evaluation always stops at EOS: an answer is what comes before it.
            ignore_eos=rollout.ignore_eos and not greedy,
            # A seed per step (and dynamic-sampling round) makes a resumed run sample
            # exactly what the original did.
            seed=self.config.trainer.seed * 1_000_003 + step + round_index * 100_000_007,
        )

    async def _generate(
        self,
        rows: list[PromptRow],
        sampling: api.Sampling,
        return_log_probs: bool = False,
        weights_version: int | None = None,
    ):
        """Responses to `rows` from weights `weights_version` (default: the current)."""
        if weights_version is None:
            weights_version = self.state.weights_version
        request = api.GenerateSequencesRequest(
            prompt_batch(rows, self.tokenizer),
            sampling,
            weights_version,
            return_log_probs,
            self.agent,
        )
        answer = await self.clients.rollout.call_api(request)
        asked = len(rows) * sampling.responses_per_prompt
        if len(answer.batch) != asked:
            # a short batch would train on fewer samples than the step reports
            raise RuntimeError(
                f"GenerateSequences answered {len(answer.batch)} samples for {len(rows)} "
                f"prompts x {sampling.responses_per_prompt} responses = {asked}"
            )
        return answer.batch, answer.metrics

    async def _generate_step(
        self, rows: list[PromptRow], sampling: api.Sampling, weights_version: int
    ):
        """A training generation: with the engine's log-probs when rollout correction
        (RunConfig.rollout_is_cap) needs them."""
        wants_log_probs = self.config.rollout_is_cap is not None
        return await self._generate(rows, sampling, wants_log_probs, weights_version)

    async def _generation_for(self, step: int, weights_version: int) -> Generation:
        """Step `step`'s training batch, generated by weights `weights_version` (the
        schedule asks for it)."""
        config = self.config
        wanted = config.trainer.prompts_per_step
        if not config.algorithm.dynamic_sampling:
            rows = self.stream.next_rows(wanted)
            batch, metrics = await self._generate_step(rows, self._sampling(step), weights_version)
            return Generation(rows, batch, metrics)

        async def generate_round(round_index: int) -> tuple[int, Batch, dict[str, float]]:
            rows = self.stream.next_rows(wanted)
            sampling = self._sampling(step, round_index)
            batch, metrics = await self._generate_step(rows, sampling, weights_version)
            return len(rows), batch, metrics

        # scored while choosing the groups: the reward is not among the forwards
        batch, metrics = await informative_batch(
            step,
            generate_round,
            self.rewards.rewards,
            wanted,
            config.algorithm.dynamic_sampling_max_rounds,
            config.actor.ppo_mini_batch_prompts,
            self.tokenizer.pad_token_id,
        )
        return Generation(None, batch, metrics)

    async def _greedy_baseline(self, rows: list[PromptRow], step: int) -> torch.Tensor:
        """ReMax's baseline: the score of the greedy response to each prompt, one
        generation (temperature 0, one response) and one reward call. Shape: (prompts,)."""
        greedy, _ = await self._generate(rows, self._sampling(step, greedy=True))
        return (await self.rewards.rewards(greedy))["scores"]

    def discard_next_generation(self) -> None:
        """Cancels a generation asked for a step early (before a restore, at the end)."""
        self.schedule.discard()

    # --- one step ---------------------------------------------------------------------

    async def run_step(self) -> dict[str, float]:
        """Runs step `state.step` (0-based in requests; metrics and the trace's
        `rlserve.step` count it from 1) and returns its metrics; one trace."""
        with tracing.span("ppo.step", step=self.state.step + 1) as root:
            metrics = await self._run_step()
            if root.is_recording():
                root.set_attributes(
                    {
                        "rlserve.batch_size": int(metrics["samples"]),
                        "rlserve.weights_version": self.state.weights_version,
                        "rlserve.reward_mean": metrics["reward_mean"],
                    }
                )
        return metrics

    async def _run_step(self) -> dict[str, float]:
        step = self.state.step
        config = self.config
        timings: dict[str, float] = {}
        started = time.perf_counter()
        self.rewards.figures.clear()
        progress = self._start_step(step)

        generation = await self._step_generation(progress, timings)
        batch = generation.batch
        staleness = self.state.weights_version - int(batch.meta["weights_version"])
        # One on-policy optimizer step: the update's own forward gives the old log-probs.
        single_pass = config.single_pass_update and len(batch) == config.actor_mini_batch_samples
        results = await self._forwards(progress, generation, single_pass, timings)
        batch, correction_metrics = self._with_forward_results(batch, results)
        batch, adv_metrics = self._with_advantages(batch, timings)
        actor_batch, actor_batch_metrics = self._actor_batch(batch, single_pass, correction_metrics)

        update_results = await self._updates(step, batch, actor_batch, timings)
        actor_update = update_results["update_actor"]
        replayed_updates = self._check_updates(step, update_results)
        self.state.weights_version = actor_update.weights_version
        if single_pass:
            batch, drift = self._with_update_scores(batch, actor_update.scores)
            adv_metrics = {**adv_metrics, **drift}
        kl_mean = float(adv_metrics["kl_mean"])
        self.kl_controller.update(kl_mean, n_steps=len(batch))

        metrics = step_metrics(
            batch,
            adv_metrics,
            kl_mean=kl_mean,
            weights_version=self.state.weights_version,
            staleness=staleness,
            replayed_updates=replayed_updates,
            step_s=time.perf_counter() - started,
            timings=timings,
            update_results=update_results,
            generation_metrics=generation.metrics,
            actor_batch_metrics=actor_batch_metrics,
            reward_figures=self.rewards.figures,
            overlong_penalty=(
                self.rewards.overlong_penalty(batch)
                if config.algorithm.overlong_buffer_tokens
                else None
            ),
        )
        warn_reward_failures(step, self.rewards.figures)
        self.state.step = step + 1
        self.state.last_metrics = metrics
        self._in_progress = None
        return metrics

    def _start_step(self, step: int) -> _StepInProgress:
        progress = self._in_progress
        if progress is not None and progress.step == step:
            return progress  # run again after a rewind
        self._in_progress = _StepInProgress(
            step=step,
            weights_version=self.state.weights_version,
            kl_controller=self.kl_controller.state_dict(),
            stream=self.stream.state_dict(),
            rng=rng_state(),
            took_early_generation=self.schedule.holds_generation_for(step),
        )
        return self._in_progress

    async def _step_generation(
        self, progress: _StepInProgress, timings: dict[str, float]
    ) -> Generation:
        """The step's batch, from its schedule; a step run again after a rewind gets its
        first attempt's, with the prompt stream and RNGs as that one left them."""
        if progress.generation is not None:
            stream, rng = progress.after_generation
            self.stream.load_state_dict(stream)
            restore_rng(rng)
            return progress.generation
        generation = self.schedule.generation(progress.step, self.state.weights_version)
        progress.generation = await _timed("generate", timings, generation)
        progress.after_generation = (self.stream.state_dict(), rng_state())
        return progress.generation

    async def _forwards(
        self,
        progress: _StepInProgress,
        generation: Generation,
        single_pass: bool,
        timings: dict[str, float],
    ) -> dict[str, Any]:
        """The step's forwards (`_forward_calls`), concurrently, each timed
        (time/<name>_s) and together (time/forward_wall_s). The schedule hears when the
        old log-probs are in, while the other forwards run on. A step run again after a
        rewind gets its first attempt's results and reward figures, so it sends the same
        update batches."""
        step = progress.step
        forward_started = time.perf_counter()
        if progress.forwards is None:
            calls = {
                name: _timed(name, timings, call)
                for name, call in self._forward_calls(step, generation, single_pass).items()
            }
            if "log_prob" in calls:
                calls["log_prob"] = _then(
                    calls["log_prob"],
                    lambda: self.schedule.old_log_probs_taken(step, self.state.weights_version),
                )
            answers = await asyncio.gather(*calls.values())
            progress.forwards = dict(zip(calls, answers, strict=True))
            progress.reward_figures = Counter(self.rewards.figures)
        else:
            self.rewards.figures = Counter(progress.reward_figures)
            if "log_prob" in progress.forwards:
                self.schedule.old_log_probs_taken(step, self.state.weights_version)
        timings["time/forward_wall_s"] = time.perf_counter() - forward_started
        return progress.forwards

    def _forward_calls(
        self, step: int, generation: Generation, single_pass: bool
    ) -> dict[str, Awaitable[Any]]:
        """The forwards the step needs: old log-probs unless the update computes them
        (single pass), the reward unless dynamic sampling scored the batch, ReMax's
        greedy baseline, reference log-probs and values when those services are in use."""
        batch = generation.batch
        sequences = batch.select(tensor_keys=SEQUENCE_KEYS, non_tensor_keys=[])
        needs = estimator_needs(self.config.algorithm.adv_estimator)
        calls: dict[str, Awaitable[Any]] = {}
        if not single_pass:
            request = api.ComputeLogProbRequest(
                sequences,
                return_entropy=True,
                expected_weights_version=self.state.weights_version,
                return_sum_pi_squared="sum_pi_squared" in needs,
            )
            calls["log_prob"] = self.clients.rollout.call_api(request)
        if "scores" not in batch.tensors:
            calls["reward"] = self.rewards.rewards(batch)
        if "baseline_scores" in needs:
            # dynamic sampling needs a group estimator, so `rows` is this step's prompts
            assert generation.rows is not None
            calls["greedy_baseline"] = self._greedy_baseline(generation.rows, step)
        if self.clients.reference is not None:
            calls["ref_log_prob"] = self.clients.reference.call_api(
                api.ComputeRefLogProbRequest(sequences)
            )
        if self.clients.critic is not None:
            calls["values"] = self.clients.critic.call_api(api.ComputeValuesRequest(sequences))
        return calls

    def _with_forward_results(
        self, batch: Batch, results: dict[str, Any]
    ) -> tuple[Batch, dict[str, float]]:
        """The batch with the forwards' tensors, and rollout correction's weights when it
        is on (`_rollout_is_weights`, whose metrics are returned)."""
        extra = {}
        if "log_prob" in results:
            log_probs = results["log_prob"].batch
            extra = {"old_log_probs": log_probs["log_probs"], "entropy": log_probs["entropy"]}
            if "sum_pi_squared" in log_probs.tensors:
                extra["sum_pi_squared"] = log_probs["sum_pi_squared"]
        if "reward" in results:
            extra.update(results["reward"])
        if "greedy_baseline" in results:
            # each sample gets the greedy score of its prompt (uid = the prompt's index)
            prompt_index = torch.tensor([int(uid) for uid in batch["uid"]], dtype=torch.int64)
            extra["baseline_scores"] = results["greedy_baseline"][prompt_index]
        if "ref_log_prob" in results:
            extra["ref_log_probs"] = results["ref_log_prob"].batch["ref_log_probs"]
        if "values" in results:
            extra["values"] = results["values"].batch["values"]
        batch = Batch(
            tensors={**batch.tensors, **extra}, non_tensors=batch.non_tensors, meta=batch.meta
        )
        if self.config.rollout_is_cap is None:
            return batch, {}
        return self._rollout_is_weights(batch)

    def _with_advantages(
        self, batch: Batch, timings: dict[str, float]
    ) -> tuple[Batch, dict[str, Any]]:
        """The batch with advantages and returns, and compute_advantages' metrics."""
        math_started = time.perf_counter()
        with tracing.span("trainer.advantages", batch_size=len(batch)):
            targets, adv_metrics = compute_advantages(
                batch,
                self.advantage_settings,
                self.kl_controller.value,
                self.rewards.component_weights(),
            )
        timings["time/advantages_s"] = time.perf_counter() - math_started
        batch = Batch(
            tensors={**batch.tensors, **targets}, non_tensors=batch.non_tensors, meta=batch.meta
        )
        return batch, adv_metrics

    def _actor_batch(
        self, batch: Batch, single_pass: bool, correction_metrics: dict[str, float]
    ) -> tuple[Batch, dict[str, float]]:
        """What UpdateActor trains on: the sequences, advantages (without the signal of
        truncated responses with algorithm.filter_overlong, weighted by rollout
        correction when it is on), old log-probs unless the update computes them, and
        reference log-probs for a KL loss; with the filters' metrics."""
        config = self.config
        actor_keys = [*SEQUENCE_KEYS, "advantages"] + ([] if single_pass else ["old_log_probs"])
        if config.actor.use_kl_loss:
            actor_keys.append("ref_log_probs")
        actor_batch = batch.select(tensor_keys=actor_keys, non_tensor_keys=[])
        metrics = {}
        if config.algorithm.filter_overlong:
            actor_batch, metrics = self._without_truncated_signal(actor_batch)
        agent = config.rollout.agent
        if agent is not None and agent.on_tool_error == "drop_sample":
            actor_batch, dropped = without_failed_tool_signal(actor_batch, batch["tool_errors"])
            metrics.update(dropped)
        if config.rollout_is_cap is not None:
            # each token's policy-gradient term weighted (see _rollout_is_weights)
            actor_batch = with_weighted_advantages(actor_batch, batch["rollout_is_weights"])
            metrics.update(correction_metrics)
        return actor_batch, metrics

    def _without_truncated_signal(self, batch: Batch) -> tuple[Batch, dict[str, float]]:
        """The actor's batch with zero advantage for every response cut off at
        max_new_tokens without EOS (DAPO's overlong filtering): such a response adds no
        policy-gradient signal. Its tokens stay in the batch, since the actor trains on
        whole rows (they still count in a token-mean's denominator and a KL loss)."""
        truncated = truncated_responses(
            batch["responses"],
            batch["response_mask"],
            self.tokenizer.eos_token_id,
            self.config.rollout.max_new_tokens,
        )
        metrics = {"overlong/truncated_fraction": float(truncated.float().mean())}
        return with_weighted_advantages(batch, ~truncated), metrics

    def _rollout_is_weights(self, batch: Batch) -> tuple[Batch, dict[str, float]]:
        """The batch with rollout_is_weights: each token's truncated importance weight
        min(π_old/π_rollout, RunConfig.rollout_is_cap). π_rollout is the generating
        engine's: with rollout.mode one_step_off, also the previous weights'. The actor's
        advantages are multiplied by them; every policy loss but clip_cov/kl_cov (refused by the run
        config) is linear in the advantage and branches on its sign only, so that is the
        same as weighting each token's policy-gradient term (the entropy and KL-loss
        terms stay unweighted). The optimal token baseline reads them too."""
        weights, metrics = truncated_is_weights(
            batch["old_log_probs"],
            batch["rollout_log_probs"],
            batch["response_mask"],
            self.config.rollout_is_cap,
        )
        weighted = Batch(
            {**batch.tensors, "rollout_is_weights": weights}, batch.non_tensors, batch.meta
        )
        return weighted, {f"rollout_is/{key}": float(value) for key, value in metrics.items()}

    async def _updates(
        self, step: int, batch: Batch, actor_batch: Batch, timings: dict[str, float]
    ) -> dict[str, Any]:
        """The actor's and critic's updates, concurrently, each timed and together
        (time/update_wall_s); name -> its answer."""
        actor_request = api.UpdateActorRequest(step, self.state.weights_version, actor_batch)
        updates: dict[str, Awaitable[Any]] = {
            "update_actor": self._update_actor(actor_request, timings)
        }
        if self.clients.critic is not None:
            critic_keys = [*SEQUENCE_KEYS, "values", "returns"]
            critic_batch = batch.select(tensor_keys=critic_keys, non_tensor_keys=[])
            update = self.clients.critic.call_api(api.UpdateCriticRequest(step, critic_batch))
            updates["update_critic"] = _timed("update_critic", timings, update)
        update_started = time.perf_counter()
        update_results = dict(zip(updates, await asyncio.gather(*updates.values()), strict=True))
        timings["time/update_wall_s"] = time.perf_counter() - update_started
        return update_results

    async def _update_actor(
        self,
        request: api.UpdateActorRequest,
        timings: dict[str, float],
    ) -> api.UpdateAnswer:
        # one_step_off: the next step's generation expects the weights this update replaces
        timings["time/update_actor_waits_generation_s"] = await self.schedule.before_actor_update()
        update = self.clients.rollout.call_api(request)
        return await _timed("update_actor", timings, update)

    def _with_update_scores(
        self, batch: Batch, update_scores: Batch | None
    ) -> tuple[Batch, dict[str, torch.Tensor]]:
        """A single-pass step's batch with the entropy its update's forward answered, and
        the policy's drift from the reference by that forward's log-probs (kl_mean and
        kl_token_mean, in place of compute_advantages'; none without a reference)."""
        if update_scores is None:
            raise RuntimeError(
                "UpdateActor answered no log-probs for a batch without old_log_probs; "
                "the rollout service predates single-pass updates: redeploy it"
            )
        batch = Batch(
            {**batch.tensors, "entropy": update_scores["entropy"]}, batch.non_tensors, batch.meta
        )
        if "ref_log_probs" not in batch.tensors:
            return batch, {}
        mask = batch["response_mask"].float()
        drift = reference_drift(
            update_scores["log_probs"], batch["ref_log_probs"], mask, self.advantage_settings
        )
        return batch, drift

    def _check_updates(self, step: int, update_results: dict[str, Any]) -> float:
        """How many of the step's updates were answered as replays (retries of a call
        whose first answer was lost). A service answers a replay only for the batch it
        applied, so a replay is sound when it reports the weights this step makes; one
        that reports others means something else updated the service since.

        Raises:
            RuntimeError: an update answered weights other than the ones this step makes.
        """
        replayed = 0
        expected = {"update_actor": self.state.weights_version + 1}
        for name, response in update_results.items():
            if not response.replayed:
                continue
            replayed += 1
            logger.info("step %d: %s answered a replay of the batch it applied", step, name)
            wanted = expected.get(name)
            if wanted is not None and response.weights_version != wanted:
                raise RuntimeError(
                    f"step {step}: {name} answered a replay at weights version "
                    f"{response.weights_version}, but this step makes version {wanted}: "
                    "another trainer is updating the service; stop it, then resume this run"
                )
        return float(replayed)

    # --- recovery ---------------------------------------------------------------------

    def intact_service_states(self) -> tuple[set[tuple[int, int]], set[int]]:
        """The (weights version, last applied step) of the rollout, and the critic's last
        applied step, at which the services have lost nothing of this run: the state
        after the last completed step, or, while a step is in progress whose updates can
        be sent again with the same batch, the state after its updates too. Empty when
        the step in progress cannot be run again (its early generation is gone)."""
        progress = self._in_progress
        if progress is None:
            return {(self.state.weights_version, self.state.step - 1)}, {self.state.step - 1}
        if progress.took_early_generation and progress.generation is None:
            return set(), set()
        rollout = {(progress.weights_version, progress.step - 1)}
        critic = {progress.step - 1}
        if progress.forwards is not None:
            rollout.add((progress.weights_version + 1, progress.step))
            critic.add(progress.step)
        return rollout, critic

    def rewind(self) -> None:
        """Back to the start of the step in progress, keeping its results so far (after a
        failure that lost no service state; see intact_service_states). Without one (the
        failure followed a completed step) nothing changes: a generation asked for the
        next step stays valid."""
        progress = self._in_progress
        if progress is None:
            return
        self.schedule.discard()  # asked for during this attempt, from its prompts
        self.state.step = progress.step
        self.state.weights_version = progress.weights_version
        self.kl_controller.load_state_dict(progress.kl_controller)
        self.stream.load_state_dict(progress.stream)
        restore_rng(progress.rng)

    # --- evaluation and checkpoints ---------------------------------------------------

    async def evaluate(self) -> dict[str, float]:
        """Greedy responses to the held-out prompts, scored by the reward service.

        eval_accuracy is the fraction of responses with full reward (≥ 1): exact match
        for the rule rewards.
        """
        if not self.eval_rows:
            return {}
        started = time.perf_counter()
        with tracing.span("trainer.evaluate", step=self.state.step, batch_size=len(self.eval_rows)):
            batch, _ = await self._generate(
                self.eval_rows, self._sampling(self.state.step, greedy=True)
            )
            scores = (await self.rewards.score(batch))["scores"].float()
        return {
            "eval_accuracy": float((scores >= 1.0 - 1e-6).float().mean()),
            "eval_reward_mean": float(scores.mean()),
            "time/eval_s": time.perf_counter() - started,
        }

    async def save_checkpoint(self) -> Path:
        """Writes the checkpoint of this step once (rlserve.trainer.checkpoint)."""
        with tracing.span("trainer.checkpoint", step=self.state.step):
            return await save_checkpoint(
                self.run_dir,
                self.config.trainer.run_dir,
                self.config.trainer.keep_checkpoints,
                self.state.step,
                self.clients.rollout,
                self.clients.critic,
                self._checkpoint_state,
            )

    async def _checkpoint_state(self, directory: Path) -> dict[str, Any]:
        """trainer_state.json, once the schedule has written what it holds beside it."""
        next_generation = await self.schedule.save(directory)
        return {
            "step": self.state.step,
            "weights_version": self.state.weights_version,
            # after the rows of a kept next generation were drawn
            "prompt_stream": self.stream.state_dict(),
            "kl_controller": self.kl_controller.state_dict(),
            "rng": rng_state(),
            "next_generation": next_generation,
        }

    async def reset_used_services(self) -> list[str]:
        """Resets the rollout and critic services when an earlier run left them trained
        (weights version or applied steps past the deployed state), so this run starts
        from the initial weights; returns the roles reset. One trace of its own
        (`trainer.reset_services`), like a checkpoint's."""
        with tracing.span("trainer.reset_services") as span:
            reset = await self._reset_used_services()
            span.set_attribute("rlserve.reset_roles", ",".join(reset))
            return reset

    async def _reset_used_services(self) -> list[str]:
        used = []
        for role, client, request in (
            ("rollout", self.clients.rollout, rollout_pb2.RolloutServiceGetInfoRequest()),
            ("critic", self.clients.critic, critic_pb2.CriticServiceGetInfoRequest()),
        ):
            if client is None:
                continue
            info = (await client.call("GetInfo", request)).info
            if info.weights_version != 0 or info.last_applied_step != -1:
                used.append((role, client))
        resets = {
            "rollout": rollout_pb2.RolloutServiceResetRequest(),
            "critic": critic_pb2.CriticServiceResetRequest(),
        }
        await asyncio.gather(*(client.call("Reset", resets[role]) for role, client in used))
        return [role for role, _ in used]

    async def load_checkpoint(self, directory: Path, trainer_state: dict[str, Any]) -> None:
        self.schedule.discard()
        self._in_progress = None
        await load_service_checkpoints(
            directory,
            self.config.trainer.run_dir,
            self.clients.rollout,
            self.clients.critic,
            trainer_state["weights_version"],
        )
        self.state.step = trainer_state["step"]
        self.state.weights_version = trainer_state["weights_version"]
        self.stream.load_state_dict(trainer_state["prompt_stream"])
        self.kl_controller.load_state_dict(trainer_state["kl_controller"])
        restore_rng(trainer_state["rng"])
        # absent from checkpoints written before one_step_off existed
        self.schedule.restore(directory, trainer_state.get("next_generation"))


def agent_params(agent: AgentConfig | None) -> api.Agent | None:
    """What GenerateSequences is asked for multi-turn responses (rollout.agent), calling
    the environment service the run deploys."""
    if agent is None:
        return None
    return api.Agent(
        environment_app="environment",
        tool_call_format=agent.tool_call_format,
        bracket_argument=agent.bracket_argument,
        max_turns=agent.max_turns,
        max_tool_calls=agent.max_tool_calls,
        max_tool_response_tokens=agent.max_tool_response_tokens,
        tool_timeout_s=agent.tool_timeout_s,
        observation_role=agent.observation_role,
    )
