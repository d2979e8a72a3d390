"""One data-parallel rank of the critic: a value model inside a DeepSpeed engine.

Used as a Ray actor by the controller's WorkerGroup (one per rank), and in-process by
unit tests (`init_distributed("127.0.0.1", free_port())` with world size 1).

Update semantics, chosen so that N workers compute the same update as one:
- The controller plans the mini-batches globally (rlserve.core.service.plan.MiniBatchPlan:
  one permutation per epoch over the request's rows) and gives each rank an equal slice
  of every mini-batch, with the mini-batch's global loss units. A rank runs
  its slice as `grad_accum_steps` micro-batches, one backward + `engine.step()` each;
  DeepSpeed steps the optimizer at the accumulation boundary.
- Each micro-batch's loss is weighted so the summed gradient is the gradient of the
  loss aggregated over the whole global mini-batch: weight = this micro-batch's share
  of the mini-batch's loss units (response tokens for token-mean, non-empty sequences
  for the seq-mean modes), times grad_accum_steps × world_size to undo DeepSpeed's
  division by the accumulation steps and its gradient averaging over ranks.
- A micro-batch without response tokens still runs a (zero) backward, so every rank
  runs the same collectives (ZeRO-2/3 reduce in backward).
"""

from pathlib import Path
from typing import Any

import torch

from rlserve.core import tracing
from rlserve.core.algos.value import value_loss
from rlserve.core.batch import Batch
from rlserve.core.rank_worker import RankSetup, TrainingRankWorker
from rlserve.core.response_scoring import forward_micro_batches, trim_padding
from rlserve.core.service.plan import RankUpdate, loss_units
from rlserve.core.serving import until_deadline
from rlserve.core.training import OptimizerSettings, grad_norm
from rlserve.critic.config import MODEL_DIR
from rlserve.critic.model import load_value_model, response_values, save_value_model
from rlserve.critic.requests import ValueLossSettings


class CriticWorker(TrainingRankWorker):
    """Value model + DeepSpeed engine of one rank; the engine exists after init_distributed."""

    def __init__(
        self,
        rank: int,
        world_size: int,
        setup: RankSetup,
        optimizer: OptimizerSettings,
        loss: ValueLossSettings,
        forward_micro_batch_samples: int,
        gradient_checkpointing: bool = False,
    ):
        super().__init__(rank, world_size, setup, optimizer)
        self.loss = loss
        self.forward_micro_batch_samples = forward_micro_batch_samples
        self.gradient_checkpointing = gradient_checkpointing
        self.model = self._initial_model()

    def _initial_model(self) -> torch.nn.Module:
        model = load_value_model(self.model_path, self.dtype).to(self.device)
        if self.gradient_checkpointing:
            model.backbone.gradient_checkpointing_enable({"use_reentrant": False})
        return model

    # ---- process group ----------------------------------------------------------------

    def init_distributed(self, address: str, port: int) -> None:
        """Joins the gloo group, then wraps the model in its DeepSpeed engine."""
        super().init_distributed(address, port)
        self._build_engine(self.model)

    def reset(self) -> None:
        """The initial weights (value head zero) in a new engine with a fresh optimizer;
        every rank (DeepSpeed's set-up is a collective)."""
        self._drop_engine()
        self.model = None
        self.model = self._initial_model()
        self._build_engine(self.model)

    def info(self) -> dict[str, Any]:
        """Rank, placement and model facts for GetInfo and request validation."""
        return {**super().info(), "vocab_size": self.model.config.get_text_config().vocab_size}

    # ---- work ---------------------------------------------------------------------------

    def _values(self, batch: Batch) -> torch.Tensor:
        """Response values [n, R] on the worker's device (through the engine, so ZeRO-3
        gathers its shards); padding columns no row uses are not computed."""
        response_mask = batch.tensors["response_mask"].to(self.device)
        input_ids, attention_mask, kept = trim_padding(
            batch.tensors["input_ids"].to(self.device),
            batch.tensors["attention_mask"].to(self.device),
            response_mask,
        )
        values = self.engine(input_ids, attention_mask)
        kept_values = response_values(values, response_mask[:, :kept], kept)
        return torch.nn.functional.pad(kept_values, (0, response_mask.shape[1] - kept))

    @torch.no_grad()
    def compute_values(self, batch: Batch, deadline: float | None = None) -> Batch:
        """values [n, R] float32 for a sequence batch, in forward micro-batches; raises
        DEADLINE_EXCEEDED between them once `deadline` (Unix seconds) has passed."""
        self.use_threads("forward")
        self.engine.eval()
        chunks = []
        micro_batches = forward_micro_batches(
            batch, self.forward_micro_batch_samples, self.forward_max_tokens
        )
        for micro in until_deadline(micro_batches, deadline, "ComputeValues"):
            with tracing.span("critic.forward", batch_size=len(micro)):
                chunks.append(self._values(micro).cpu())
        response_len = batch.tensors["responses"].shape[1]
        values = torch.cat(chunks) if chunks else torch.zeros(0, response_len)
        return Batch(tensors={"values": values})

    def update_critic(self, work: RankUpdate) -> list[dict[str, float]]:
        """Trains on this rank's slices; per mini-batch: this rank's metric sums.

        Returns, per mini-batch: vf_loss (this rank's share of the global loss; sum over
        ranks = the mini-batch loss), clipped_tokens and tokens (sum over ranks gives
        the clip fraction), grad_norm and lr (equal on every rank).
        """
        self.use_threads("update")
        self.engine.train()
        micro_batch_samples = self.optimizer_settings.micro_batch_samples
        grad_accum_steps = self.optimizer_settings.grad_accum_steps
        scale = grad_accum_steps * self.world_size
        zero_0 = self.engine.zero_optimization_stage() == 0
        results = []
        for mini_index, mini in enumerate(work.mini_batches):
            sums = {"vf_loss": 0.0, "clipped_tokens": 0.0, "tokens": 0.0}
            micro_batches = list(work.batch.index(mini.rows).chunk(micro_batch_samples))
            if len(micro_batches) != grad_accum_steps:
                raise ValueError(
                    f"mini-batch slice of {len(mini.rows)} rows makes {len(micro_batches)} "
                    f"micro-batches; the engine accumulates {grad_accum_steps}"
                )
            with tracing.span("critic.mini_batch", index=mini_index, batch_size=len(mini.rows)):
                for index, micro in enumerate(micro_batches):
                    micro = micro.to(self.device)
                    mask = micro.tensors["response_mask"]
                    with tracing.span("critic.forward", batch_size=len(micro)):
                        values = self._values(micro)
                        units = loss_units(mask, self.loss.loss_agg_mode)
                        if units == 0 or mini.global_units == 0:
                            loss = values.sum() * 0.0  # keeps every rank's collectives in step
                        else:
                            loss, metrics = value_loss(
                                values,
                                micro.tensors["values"],
                                micro.tensors["returns"],
                                mask,
                                clip_range=self.loss.cliprange_value,
                                loss_agg_mode=self.loss.loss_agg_mode,
                            )
                            weight = units / mini.global_units
                            loss = loss * (weight * scale)
                            tokens = float(mask.sum())
                            sums["vf_loss"] += weight * float(metrics["vf_loss"])
                            sums["clipped_tokens"] += float(metrics["vf_clipfrac"]) * tokens
                            sums["tokens"] += tokens
                    with tracing.span("critic.backward"):
                        self.engine.backward(loss)
                    if index == len(micro_batches) - 1 and zero_0:
                        # ZeRO-0 records no norm and step() zeroes the (already all-reduced)
                        # grads, so read it now; ZeRO-1/2/3 record it during step().
                        sums["grad_norm"] = grad_norm(self.engine)
                    with tracing.span("critic.optimizer_step"):
                        self.engine.step()
                if not zero_0:
                    sums["grad_norm"] = grad_norm(self.engine)
            sums["lr"] = float(self.engine.get_lr()[0])
            results.append(sums)
        return results

    # ---- checkpoints ----------------------------------------------------------------------

    def save_checkpoint(self, directory: str, client_state: dict[str, Any]) -> None:
        """model/ (safetensors, rank 0) and deepspeed/ (every rank); call on all ranks."""
        state_dict = self.gathered_weights()
        if self.rank == 0:
            save_value_model(self.model, state_dict, Path(directory) / MODEL_DIR)
        self._save_engine_state(directory, client_state)
