"""ActorWorker: one data-parallel rank of the rollout service (a Ray actor, or in-process).

Each rank holds the training module inside a DeepSpeed engine (ZeRO stage, AdamW, grad
clipping and accumulation from DeepSpeed's config; NCCL between CUDA ranks, gloo on CPU)
and a generation engine ('hf' here, 'vllm' loaded lazily). The 'hf' engine generates
with the training module itself when that module holds whole plain weights (ZeRO stage
0-2, no LoRA): one copy of the policy. Otherwise (vLLM, ZeRO-3's partitioned
parameters, LoRA) the engine has its own inference weights, and after every update the
rank copies the full weights into them (with LoRA: base + adapters merged), so
generation always runs the latest policy. Log-probs are computed with the training
module, the source of truth that UpdateActor's ratios are taken against, on response
tokens only and in chunks (rlserve.core.response_scoring). Models and micro-batches live
on the rank's device (rlserve.core.devices); results go back to the CPU for the service
boundary.

Deadlines: generation and log-prob calls take the caller's deadline (absolute Unix
seconds, or None) and raise DEADLINE_EXCEEDED once it has passed: generation between
tokens (the engine), log-probs between micro-batches. So a request its caller gave up on
frees the worker within one token step or micro-batch instead of running on while the
next call queues behind it. Updates take none: they are atomic (see the controller).

The worker does not shuffle: the controller sends each rank its rows already in training
order (epochs and mini-batches planned once, globally), and the rank walks them in
mini-batches of its share and micro-batches of `micro_batch_samples`. So the same request
trains the same way whatever the number of workers.

Batch layout (rlserve.v1 names): prompts [N, P] left-padded, responses [N, R]
right-padded with the pad id to R = max_new_tokens (fixed, so ranks' results stack),
input_ids = prompts ‖ responses [N, P+R], attention_mask likewise, response_mask [N, R].
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from rlserve.core import tracing
from rlserve.core.algos.aggregation import aggregate_loss, mini_batch_loss_scale
from rlserve.core.algos.kl import kl_loss
from rlserve.core.algos.policy_loss_registry import get_policy_loss
from rlserve.core.batch import Batch
from rlserve.core.config import fields_from
from rlserve.core.lora import adapters_disabled, add_lora, merged_state_dict, save_adapter
from rlserve.core.modeling import load_causal_lm, load_tokenizer
from rlserve.core.rank_worker import RankSetup, TrainingRankWorker
from rlserve.core.response_scoring import (
    ResponseScores,
    forward_micro_batches,
    score_responses,
)
from rlserve.core.serving import Deadline, until_deadline
from rlserve.core.training import OptimizerSettings, grad_norm, live_state_dict
from rlserve.core.worker_settings import ActorSettings
from rlserve.rollout.config import RolloutServiceConfig
from rlserve.rollout.generation import GenerationEngine, SamplingSettings

MODEL_SUBDIR = "model"
ADAPTER_SUBDIR = "adapter"
# The span of each forward micro-batch, by the RPC it serves.
FORWARD_SPANS = {"ComputeLogProb": "rollout.forward", "ComputeRefLogProb": "reference.forward"}


def make_generation_engine(
    name: str,
    model_path: str,
    dtype: str,
    seed: int,
    device: torch.device | None = None,
    vllm: dict[str, Any] | None = None,
    shared_model: torch.nn.Module | None = None,
) -> GenerationEngine:
    """The one place that maps an engine name to its class. `vllm`: the fields of
    rlserve.core.vllm_config.VllmConfig (model_dump), keyword arguments of the vLLM engine.
    `shared_model`: the training module, for the hf engine to generate with (no copy)."""
    if name == "hf":
        from rlserve.rollout.hf_engine import HFGenerationEngine

        return HFGenerationEngine(model_path, dtype, device, shared_model=shared_model)
    if name == "vllm":
        # Imported here: vLLM is optional and heavy, and only this engine needs it.
        from rlserve.rollout.vllm_engine import VLLMGenerationEngine

        return VLLMGenerationEngine(model_path=model_path, dtype=dtype, seed=seed, **(vllm or {}))
    raise ValueError(f"engine: unknown generation engine {name!r}; use 'hf' or 'vllm'")


@dataclass(frozen=True)
class LoraSettings:
    """LoRA adapters on the actor (rlserve.core.lora); None in the worker = full weights."""

    rank: int
    alpha: float
    target_modules: list[str] | str


@dataclass(frozen=True)
class PolicyLossSettings:
    """The actor's loss: the policy loss by name with its knobs, and the terms added."""

    policy_loss: str
    """Name in policy_loss_registry.POLICY_LOSSES ("vanilla" = PPO clip, "gspo", "cispo", ...)."""
    knobs: dict[str, Any]
    """Every actor setting by name; the policy loss reads the ones its parameters name
    (rlserve.core.algos.policy_loss_registry), so a new knob needs no line here."""
    loss_agg_mode: str
    entropy_coef: float
    use_kl_loss: bool
    kl_loss_coef: float
    kl_loss_kind: str


def actor_worker_kwargs(config: RolloutServiceConfig) -> dict[str, Any]:
    """ActorWorker's constructor arguments (beyond rank and world_size) from the config."""
    return {
        "setup": RankSetup.of(config, num_threads=config.torch_threads_per_worker),
        "engine": config.engine,
        "seed": config.seed,
        "forward_micro_batch_samples": config.forward_micro_batch_samples,
        "logits_chunk_tokens": config.logits_chunk_tokens,
        "gradient_checkpointing": config.gradient_checkpointing,
        "lora": (
            LoraSettings(config.lora_rank, config.lora_alpha, config.lora_target_modules)
            if config.lora_rank
            else None
        ),
        "serve_reference": config.serve_reference,
        "vllm": config.vllm.model_dump(),
        "optimizer": fields_from(OptimizerSettings, config),
        "loss": fields_from(
            PolicyLossSettings,
            config,
            knobs={name: getattr(config, name) for name in ActorSettings.model_fields},
        ),
    }


class ActorWorker(TrainingRankWorker):
    """One DP rank: a DeepSpeed-trained policy plus a generation engine.

    Construct, then `init_distributed(address, port)` (WorkerGroup does both) before
    any other call: it joins the process group, then builds the DeepSpeed engine and
    the generation engine.
    """

    @classmethod
    def from_service_config(
        cls, rank: int, world_size: int, config: RolloutServiceConfig
    ) -> ActorWorker:
        """The worker a rollout service config describes (WorkerGroup's factory)."""
        return cls(rank=rank, world_size=world_size, **actor_worker_kwargs(config))

    def __init__(
        self,
        rank: int,
        world_size: int,
        setup: RankSetup,
        engine: str,
        seed: int,
        forward_micro_batch_samples: int,
        optimizer: OptimizerSettings,
        loss: PolicyLossSettings,
        serve_reference: bool = False,
        logits_chunk_tokens: int | None = None,
        gradient_checkpointing: bool = False,
        lora: LoraSettings | None = None,
        vllm: dict[str, Any] | None = None,
    ):
        super().__init__(rank, world_size, setup, optimizer)
        self.lora = lora
        self.vllm = vllm
        self.forward_micro_batch_samples = forward_micro_batch_samples
        self.logits_chunk_tokens = logits_chunk_tokens
        self.gradient_checkpointing = gradient_checkpointing
        self.loss = loss
        self.engine_name, self.seed = engine, seed
        self.tokenizer = load_tokenizer(setup.model_path)
        self.pad_token_id: int = self.tokenizer.pad_token_id
        # Built in init_distributed, like the training engine: vLLM would otherwise
        # create a world-size-1 default group of its own.
        self.generation: GenerationEngine | None = None
        self.generation_shares_weights = False
        self.serve_reference = serve_reference
        self.reference: torch.nn.Module | None = None

    # ---- set-up ---------------------------------------------------------------------

    def init_distributed(self, address: str, port: int) -> None:
        super().init_distributed(address, port)
        self._build_policy_engine()
        self.generation_shares_weights = (
            self.engine_name == "hf"
            and self.optimizer_settings.zero_stage < 3
            and self.lora is None
        )
        self.generation = self._make_generation_engine()
        # A LoRA actor's reference is its own base (adapters off): no second copy.
        if self.serve_reference and self.lora is None:
            self.reference = load_causal_lm(self.model_path, self.dtype).to(self.device).eval()
            self.reference.requires_grad_(False)

    def _build_policy_engine(self) -> None:
        """The DeepSpeed engine around the initial policy (LoRA adapters added)."""
        policy = load_causal_lm(self.model_path, self.dtype).to(self.device)
        if self.gradient_checkpointing:
            policy.gradient_checkpointing_enable({"use_reentrant": False})
        if self.lora is not None:
            # Adapters drawn from the service's seed: a reset service starts as a new one.
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(self.seed)
                policy = add_lora(policy, self.lora.rank, self.lora.alpha, self.lora.target_modules)
        self._build_engine(policy)

    def _make_generation_engine(self) -> GenerationEngine:
        return make_generation_engine(
            self.engine_name,
            self.model_path,
            self.dtype,
            self.seed,
            self.device,
            vllm=self.vllm,
            shared_model=self.engine.module if self.generation_shares_weights else None,
        )

    def reset(self) -> None:
        """The initial policy in a new engine with a fresh optimizer, and the generation
        engine on those weights; every rank (DeepSpeed's set-up is a collective). A
        generation engine with weights of its own (vLLM) stays and is sent the initial
        weights: building it again would cost as much as a new deployment. The frozen
        reference never changed."""
        if self.generation_shares_weights:
            self.generation = None  # it holds the old engine's module
        self._drop_engine()
        self._build_policy_engine()
        if self.generation_shares_weights:
            self.generation = self._make_generation_engine()
        else:
            self._sync_generation_weights()

    def model_limits(self) -> dict[str, int]:
        """vocab_size (ids must be below it) and max_positions of the policy."""
        config = self.engine.module.config.get_text_config()
        return {
            "vocab_size": int(config.vocab_size),
            "max_positions": int(getattr(config, "max_position_embeddings", None) or 2**31),
        }

    # ---- generation -----------------------------------------------------------------

    def generate(
        self, prompts: Batch, sampling: SamplingSettings, deadline: float | None = None
    ) -> Batch:
        """Samples responses for left-padded prompts (input_ids, attention_mask).

        Returns N = rows × n rows (responses of a prompt adjacent): prompts, responses,
        response_mask, input_ids, attention_mask (+ rollout_log_probs), and the prompt
        non-tensors repeated plus response_text. Meta is left to the caller. Raises
        DEADLINE_EXCEEDED once `deadline` (Unix seconds) passes, between tokens.
        """
        Deadline(deadline).check("GenerateSequences")
        self.use_threads("generate")
        if sampling.seed is not None and self.rank:
            # Ranks hold different prompts; distinct seeds keep their noise independent.
            sampling = dataclasses.replace(sampling, seed=sampling.seed + self.rank)
        input_ids, attention_mask = prompts["input_ids"], prompts["attention_mask"]
        prompt_ids = [
            ids[mask.bool()].tolist() for ids, mask in zip(input_ids, attention_mask, strict=True)
        ]
        # Normally awake already (update_actor wakes it); not if that update failed.
        self.generation.wake_up()
        with tracing.span(
            "rollout.generate", batch_size=len(prompt_ids), engine=self.engine_name
        ) as span:
            generated = self.generation.generate(prompt_ids, sampling, deadline)
            if span.is_recording():
                span.set_attribute("rlserve.tokens", sum(map(len, generated.response_ids)))
        n, width = sampling.responses_per_prompt, sampling.max_new_tokens
        rows = len(generated.response_ids)
        responses = torch.full((rows, width), self.pad_token_id, dtype=torch.long)
        response_mask = torch.zeros((rows, width), dtype=torch.long)
        for i, ids in enumerate(generated.response_ids):
            responses[i, : len(ids)] = torch.tensor(ids, dtype=torch.long)
            response_mask[i, : len(ids)] = 1
        repeated = prompts.index(torch.arange(len(prompts)).repeat_interleave(n))
        tensors = {
            "prompts": repeated["input_ids"].long(),
            "responses": responses,
            "response_mask": response_mask,
            "input_ids": torch.cat([repeated["input_ids"].long(), responses], dim=1),
            "attention_mask": torch.cat([repeated["attention_mask"].long(), response_mask], 1),
        }
        if generated.log_probs is not None:
            log_probs = torch.zeros((rows, width), dtype=torch.float32)
            for i, values in enumerate(generated.log_probs):
                log_probs[i, : len(values)] = torch.tensor(values, dtype=torch.float32)
            tensors["rollout_log_probs"] = log_probs
        texts = self.tokenizer.batch_decode(generated.response_ids, skip_special_tokens=True)
        non_tensors = {**repeated.non_tensors, "response_text": texts}
        return Batch(tensors=tensors, non_tensors=non_tensors)

    def generate_turns(
        self,
        samples: list[tuple[list[int], int]],
        sampling: SamplingSettings,
        deadline: float | None = None,
    ) -> list[tuple[list[int], list[float] | None, bool]]:
        """One more turn of each multi-turn sample, given as (its token ids so far, no
        padding; its budget of new tokens): ending at EOS or one of sampling's stop
        strings. Per sample: (the turn's ids, their log-probs if asked, whether the
        budget cut it)."""
        Deadline(deadline).check("GenerateSequences")
        if not samples:  # fewer samples than ranks
            return []
        sequences = [ids for ids, _ in samples]
        budgets = [budget for _, budget in samples]
        self.use_threads("generate")
        if sampling.seed is not None and self.rank:
            sampling = dataclasses.replace(sampling, seed=sampling.seed + self.rank)
        turn = dataclasses.replace(sampling, max_new_tokens=max(budgets), responses_per_prompt=1)
        self.generation.wake_up()
        with tracing.span("rollout.generate_turns", batch_size=len(sequences)):
            generated = self.generation.generate(sequences, turn, deadline)
        log_probs = generated.log_probs or [None] * len(sequences)
        turns = []
        for ids, values, budget in zip(generated.response_ids, log_probs, budgets, strict=True):
            text = self.tokenizer.decode(ids, skip_special_tokens=True)
            ended = bool(ids) and (
                ids[-1] == self.tokenizer.eos_token_id
                or any(stop in text for stop in sampling.stop_strings)
            )
            cut = len(ids) > budget or (len(ids) == budget and not ended)
            turns.append((ids[:budget], None if values is None else values[:budget], cut))
        return turns

    # ---- scoring --------------------------------------------------------------------

    @torch.no_grad()
    def compute_log_prob(
        self,
        batch: Batch,
        temperature: float = 1.0,
        return_entropy: bool = False,
        deadline: float | None = None,
        return_sum_pi_squared: bool = False,
    ) -> Batch:
        """log_probs [N, R] (and entropy, sum_pi_squared [N, R]) of the responses, 0
        outside response_mask. Raises DEADLINE_EXCEEDED once `deadline` passes, between
        micro-batches."""
        self.engine.eval()
        return self._score(
            self.engine,
            "ComputeLogProb",
            batch,
            temperature,
            return_entropy,
            deadline,
            return_sum_pi_squared,
        )

    @torch.no_grad()
    def compute_ref_log_prob(
        self, batch: Batch, temperature: float = 1.0, deadline: float | None = None
    ) -> Batch:
        """ref_log_probs [N, R] under the frozen initial weights (serve_reference): the
        frozen copy, or for a LoRA actor the same module with its adapters disabled.
        Raises DEADLINE_EXCEEDED once `deadline` passes, between micro-batches."""
        if not self.serve_reference:
            raise RuntimeError("this worker holds no reference weights (serve_reference is off)")
        if self.lora is not None:
            self.engine.eval()
            with adapters_disabled(self.engine.module):
                scored = self._score(
                    self.engine, "ComputeRefLogProb", batch, temperature, False, deadline
                )
        else:
            scored = self._score(
                self.reference, "ComputeRefLogProb", batch, temperature, False, deadline
            )
        return Batch(tensors={"ref_log_probs": scored["log_probs"]})

    def _score(
        self,
        model: torch.nn.Module,
        rpc: str,
        batch: Batch,
        temperature: float,
        return_entropy: bool,
        deadline: float | None,
        return_sum_pi_squared: bool = False,
    ) -> Batch:
        """Log-probs in micro-batches; `rpc` names the call (its span and its deadline)."""
        self.use_threads("forward")
        log_probs, entropies, squares = [], [], []
        micro_batches = forward_micro_batches(
            batch, self.forward_micro_batch_samples, self.forward_max_tokens
        )
        for micro in until_deadline(micro_batches, deadline, rpc):
            micro = micro.to(self.device)
            with tracing.span(FORWARD_SPANS[rpc], batch_size=len(micro)):
                scores = score_responses(
                    model,
                    micro["input_ids"],
                    micro["attention_mask"],
                    micro["responses"],
                    micro["response_mask"],
                    temperature,
                    chunk_tokens=self.logits_chunk_tokens,
                    with_entropy=return_entropy,
                    with_sum_pi_squared=return_sum_pi_squared,
                )
                log_probs.append(scores.log_probs.cpu())
                if return_entropy:
                    entropies.append(scores.entropy.cpu())
                if return_sum_pi_squared:
                    squares.append(scores.sum_pi_squared.cpu())
        tensors = {"log_probs": torch.cat(log_probs)}
        if return_entropy:
            tensors["entropy"] = torch.cat(entropies)
        if return_sum_pi_squared:
            tensors["sum_pi_squared"] = torch.cat(squares)
        return Batch(tensors=tensors)

    # ---- training -------------------------------------------------------------------

    def update_actor(
        self, batch: Batch, temperature: float = 1.0, return_scores: bool = False
    ) -> dict[str, float] | tuple[dict[str, float], Batch]:
        """PPO over this rank's rows, already in training order.

        Rows come as consecutive mini-batch shares (micro_batch_samples ×
        grad_accum_steps rows each); each share is one optimizer step, taken together by
        every rank. Returns means over micro-batches (losses, clip fraction, KL, entropy)
        and over optimizer steps (grad_norm before clipping, lr), and the response tokens
        this rank trained on (each epoch counts).

        Rows without old_log_probs (one mini-batch, one epoch: the controller checks)
        take the update's own forward, detached, as the behaviour policy: before the one
        optimizer step it is the policy that generated them. `return_scores` also returns
        that forward's log_probs and entropy [rows, R], in this rank's row order.
        """
        self.use_threads("update")
        settings = self.optimizer_settings
        share = settings.micro_batch_samples * settings.grad_accum_steps
        if len(batch) % share:
            raise ValueError(f"{len(batch)} rows are not a multiple of the share {share}")
        # ZeRO-0 in fp32 records no grad norm, and step() drops the grads: read it from
        # the (already all-reduced) grads just before the boundary step instead.
        norm_from_grads = self.engine.zero_optimization_stage() == 0 and self.dtype == "float32"
        # Frees the generation engine's GPU memory for training (vllm.sleep_while_training).
        self.generation.sleep()
        self.engine.train()
        sums: dict[str, float] = {}
        step_sums = {"grad_norm": 0.0, "lr": 0.0}
        micro_count = step_count = 0
        scored: list[tuple[torch.Tensor, torch.Tensor]] = []
        for index, mini in enumerate(batch.chunk(share)):
            norm = 0.0
            with tracing.span("actor.mini_batch", index=index, batch_size=len(mini)):
                for micro in mini.chunk(settings.micro_batch_samples):
                    with tracing.span("actor.forward", batch_size=len(micro)):
                        loss, metrics, scores = self._micro_batch_loss(
                            micro.to(self.device), temperature
                        )
                    if return_scores:
                        scored.append((scores.log_probs.detach().cpu(), scores.entropy.cpu()))
                    with tracing.span("actor.backward"):
                        self.engine.backward(loss)
                    if norm_from_grads and self.engine.is_gradient_accumulation_boundary():
                        norm = grad_norm(self.engine)
                    with tracing.span("actor.optimizer_step"):
                        self.engine.step()
                    for key, value in metrics.items():
                        sums[key] = sums.get(key, 0.0) + float(value)
                    micro_count += 1
            step_sums["grad_norm"] += norm if norm_from_grads else grad_norm(self.engine)
            step_sums["lr"] += float(self.engine.get_lr()[0])
            step_count += 1
        result = {key: value / micro_count for key, value in sums.items()}
        result.update({key: value / step_count for key, value in step_sums.items()})
        result["tokens"] = float(batch["response_mask"].sum())
        self._sync_generation_weights()
        if not return_scores:
            return result
        log_probs, entropy = (torch.cat(parts) for parts in zip(*scored, strict=True))
        return result, Batch(tensors={"log_probs": log_probs, "entropy": entropy})

    def _micro_batch_loss(
        self, micro: Batch, temperature: float
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor], ResponseScores]:
        loss_settings = self.loss
        mask = micro["response_mask"]
        scores = score_responses(
            self.engine,
            micro["input_ids"],
            micro["attention_mask"],
            micro["responses"],
            mask,
            temperature,
            chunk_tokens=self.logits_chunk_tokens,
            with_entropy=True,
            entropy_grad=loss_settings.entropy_coef > 0,
        )
        log_prob = scores.log_probs
        old_log_prob = micro.tensors.get("old_log_probs")
        loss, metrics = get_policy_loss(loss_settings.policy_loss)(
            log_prob.detach() if old_log_prob is None else old_log_prob,
            log_prob,
            micro["advantages"],
            mask,
            loss_settings.knobs,
        )
        entropy = aggregate_loss(scores.entropy, mask, loss_settings.loss_agg_mode)
        if loss_settings.entropy_coef > 0:
            loss = loss - loss_settings.entropy_coef * entropy
        metrics["entropy"] = entropy.detach()
        if loss_settings.use_kl_loss:
            kl, kl_metrics = kl_loss(
                log_prob,
                micro["ref_log_probs"],
                mask,
                kind=loss_settings.kl_loss_kind,
                loss_agg_mode=loss_settings.loss_agg_mode,
            )
            loss = loss + loss_settings.kl_loss_coef * kl
            metrics.update(kl_metrics)
        if "mini_batch_tokens" in micro.tensors:
            # the metrics stay this micro-batch's means; the gradient becomes its share
            loss = loss * mini_batch_loss_scale(
                mask,
                loss_settings.loss_agg_mode,
                mini_batch_tokens=float(micro["mini_batch_tokens"][0]),
                mini_batch_sequences=float(micro["mini_batch_sequences"][0]),
                ranks=self.world_size,
                accumulation_steps=self.optimizer_settings.grad_accum_steps,
            ).to(loss.device)
        return loss, metrics, scores

    # ---- weights and checkpoints --------------------------------------------------------

    def policy_weights(self, snapshot: bool = True) -> dict[str, torch.Tensor]:
        """The policy's full weights in the plain model's names (LoRA merged in); a
        collective under ZeRO-3: call on every rank. `snapshot` False: the training
        module's own tensors where they are whole (ZeRO 0-2 without LoRA), not a copy,
        for a caller done with them before the next optimizer step."""
        if self.lora is not None:
            return merged_state_dict(self.engine.module)
        return self.gathered_weights() if snapshot else live_state_dict(self.engine)

    def save_checkpoint(self, directory: str, client_state: dict[str, Any]) -> None:
        """<directory>/model (HF safetensors + tokenizer, rank 0; LoRA merged in),
        <directory>/adapter (LoRA only) and <directory>/deepspeed."""
        root = Path(directory)
        weights = self.policy_weights()  # every rank: a collective under ZeRO-3
        if self.rank == 0:
            model_dir = root / MODEL_SUBDIR
            plain = self.engine.module
            if self.lora is not None:
                save_adapter(plain, root / ADAPTER_SUBDIR)
                plain = plain.get_base_model()
            plain.save_pretrained(model_dir, state_dict=weights, safe_serialization=True)
            self.tokenizer.save_pretrained(model_dir)
        self._save_engine_state(directory, client_state)

    def load_checkpoint(self, directory: str) -> dict[str, Any]:
        """Restores weights + optimizer state, syncs the generation engine; the client_state."""
        client_state = super().load_checkpoint(directory)
        self._sync_generation_weights()
        return client_state

    def _sync_generation_weights(self) -> None:
        """Wakes the generation engine and gives it the policy's latest weights (nothing
        to copy when it shares the training module; the span stays, so every trace has
        the stage).

        The order keeps the GPU's peak low when the engine slept through the update
        (vllm.sleep_while_training): the engine's weights wake first, take the new
        weights, and the sync's own tensors are dropped before `wake_up` empties torch's
        cache and maps the KV cache, the largest allocation, last."""
        copies = not self.generation_shares_weights
        with tracing.span("actor.weight_sync", engine=self.engine_name, copied=copies):
            self.generation.wake_weights()
            if copies:
                # No snapshot: the engine copies the weights into its own during the
                # call, so a clone of the whole model would only raise the GPU's peak.
                # No reference survives the call either, so whatever the sync allocated
                # (LoRA's merged layers, ZeRO-3's gathered weights) is free before the
                # KV cache wakes.
                self.generation.load_weights(self.policy_weights(snapshot=False))
            self.generation.wake_up()
