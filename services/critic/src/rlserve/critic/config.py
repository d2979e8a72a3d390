"""The critic service's configuration: one typed, documented, validated model.

Batch sizes say their unit and scope in their names: `ppo_mini_batch_samples` is global
(summed over workers), `micro_batch_samples` and `forward_micro_batch_samples` are per
worker. The validator checks here what would otherwise fail deep inside DeepSpeed: a
mini-batch must split evenly over the workers and each worker's share evenly into
micro-batches, so every rank runs the same number of backward passes per optimizer step.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from rlserve.core.config import ConfigError, ConfigModel
from rlserve.core.devices import DeviceSetting
from rlserve.core.placement import WorkerPlacementConfig
from rlserve.core.run_config import TracingConfig

LossAggMode = Literal["token-mean", "seq-mean-token-sum", "seq-mean-token-mean"]
# A critic checkpoint directory: the value model (safetensors) and DeepSpeed's state.
MODEL_DIR = "model"
DEEPSPEED_DIR = "deepspeed"
Dtype = Literal["float32", "bfloat16", "float16"]


class CriticServiceConfig(ConfigModel):
    """A value model (causal-LM backbone + scalar head) behind CriticService."""

    model_path: str
    """Causal-LM directory (HF format) the backbone starts from; the value head starts at
    zero, so every initial value is 0."""
    dtype: Dtype = "float32"
    """Parameter dtype of the model (bfloat16/float16 turn on DeepSpeed's mixed precision)."""
    workers: int = Field(1, ge=1)
    """Data-parallel workers (DeepSpeed ranks), one Ray actor each."""
    device: DeviceSetting = "auto"
    """Where each worker computes: 'cuda' (its bundle's GPU; ranks use NCCL), 'cpu'
    (gloo), or 'auto' = CUDA when the worker sees a GPU."""
    gradient_checkpointing: bool = False
    """Recompute the backbone's activations in backward instead of keeping them (less
    memory for long sequences, ≈ one more forward of compute)."""
    num_cpus_per_worker: float = Field(1.0, gt=0)
    """Ray CPUs reserved per worker; also its torch thread count (rounded down, at least 1)."""
    placement: WorkerPlacementConfig | None = None
    """Named placement group (a resource pool's) the workers run in, worker i in bundle
    placement.bundle_offset + i, each asking for its bundle's resources (then
    num_cpus_per_worker only sets torch threads); None = Ray picks nodes."""
    zero_stage: int = Field(0, ge=0, le=3)
    """DeepSpeed ZeRO stage (0 = plain data parallel)."""
    lr: float = Field(1e-3, gt=0)
    """Learning rate of AdamW."""
    weight_decay: float = Field(0.0, ge=0)
    """AdamW weight decay."""
    ppo_epochs: int = Field(2, ge=1)
    """Passes over each UpdateCritic batch."""
    ppo_mini_batch_samples: int = Field(64, ge=1)
    """Samples per optimizer step, across all workers; an update's rows must be a multiple."""
    micro_batch_samples: int = Field(64, ge=1)
    """Samples per forward/backward pass on one worker; gradients accumulate over a
    worker's share of the mini-batch."""
    cliprange_value: float = Field(0.2, ge=0)
    """Value clip ε: in the loss a new value moves at most ε from the request's old value."""
    loss_agg_mode: LossAggMode = "token-mean"
    """How token losses become one number: mean over all tokens of a mini-batch, or
    per-sequence sum/mean then mean over sequences."""
    grad_clip: float = Field(1.0, gt=0)
    """Clip the global gradient norm to this value."""
    forward_micro_batch_samples: int = Field(64, ge=1)
    """Samples per forward pass of ComputeValues on one worker."""
    forward_max_tokens: int | None = Field(None, ge=1)
    """Most tokens per forward micro-batch (rows × (longest prompt + longest response)
    in it), so a few long sequences make a small micro-batch; None = by sample count only."""
    max_batch_samples: int = Field(4096, ge=1)
    """Most rows one request may carry (larger ones get RESOURCE_EXHAUSTED)."""
    max_request_tokens: int = Field(262_144, ge=1)
    """Most token positions one request may carry: rows × input_ids columns (prompt +
    response); larger requests get RESOURCE_EXHAUSTED naming this setting. Sized like the
    rollout's limit of the same name, to a worker's memory: the default runs send 17,408
    (PPO: 256 × (64 + 4)) and 34,816 (GRPO: 512 × 68); raise it for larger steps where
    the workers have the memory."""
    checkpoint_root: str | None = None
    """Directory SaveCheckpoint / LoadCheckpoint are confined to: requests name a
    checkpoint by a path relative to it (e.g. "step_000010/critic"); absolute paths,
    '..' and symlinks leading out are refused. Must be shared by every worker (same path
    on every node). None = the service saves and loads no checkpoints. The trainer sets
    its run's checkpoints directory here when it deploys the service."""
    tracing: TracingConfig = Field(default_factory=TracingConfig)
    """OpenTelemetry span export of this service (and its workers); off by default. The
    trainer passes its own `trainer.tracing` here when it deploys the service."""

    @model_validator(mode="after")
    def _batches_split_evenly(self) -> CriticServiceConfig:
        if self.placement is not None:
            self.placement.require_room_for(self.workers)
        if self.ppo_mini_batch_samples % self.workers:
            raise ConfigError(
                "workers",
                f"must divide ppo_mini_batch_samples ({self.ppo_mini_batch_samples}) so each "
                f"worker gets an equal share of a mini-batch; got {self.workers}",
            )
        share = self.ppo_mini_batch_samples // self.workers
        if share % self.micro_batch_samples and self.micro_batch_samples < share:
            raise ConfigError(
                "micro_batch_samples",
                f"must divide each worker's share of a mini-batch, {share} samples "
                f"(ppo_mini_batch_samples {self.ppo_mini_batch_samples} / workers "
                f"{self.workers}); got {self.micro_batch_samples}",
            )
        return self

    @property
    def worker_mini_batch_samples(self) -> int:
        """One worker's share of a mini-batch."""
        return self.ppo_mini_batch_samples // self.workers

    @property
    def grad_accum_steps(self) -> int:
        """Micro-batches (backward passes) per worker per optimizer step."""
        return max(1, self.worker_mini_batch_samples // self.micro_batch_samples)
