"""The settings every service with a worker group shares, written once.

`WorkerServiceConfig` is what the rollout, critic and reference services have in common
(the model, the workers and where they run, request limits, tracing);
`TrainingServiceConfig` adds what the two services that train (rollout's actor, critic)
share: the DeepSpeed engine, the optimizer, mini-batches and checkpoints. A service's
own config subclasses one of them and adds (or re-documents) only its own fields, so a
shared setting has one name, one unit and one validation everywhere.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from rlserve.core.config import ConfigModel
from rlserve.core.devices import DeviceSetting
from rlserve.core.placement import WorkerPlacementConfig
from rlserve.core.run_config import TracingConfig

Dtype = Literal["float32", "bfloat16", "float16"]


class WorkerServiceConfig(ConfigModel):
    """A service whose model runs in a group of Ray workers (ranks)."""

    model_path: str
    """Causal-LM directory (Hugging Face format) the service's model starts from."""
    dtype: Dtype = "float32"
    """Parameter dtype of the model (bfloat16/float16 turn on DeepSpeed's mixed precision
    where the service trains); log-probs and values are computed in float32 either way."""
    workers: int = Field(1, ge=1)
    """Data-parallel workers, one Ray actor each; a request's rows are split over them."""
    device: DeviceSetting = "auto"
    """Where each worker computes: 'cuda' (its bundle's GPU; ranks use NCCL), 'cpu'
    (gloo), or 'auto' = CUDA when the worker sees a GPU."""
    num_cpus_per_worker: float = Field(1.0, gt=0)
    """Ray CPUs reserved per worker; also its torch thread count (rounded down, at least
    1) unless the service has a thread setting of its own."""
    placement: WorkerPlacementConfig | None = None
    """Named placement group (a resource pool's) the workers run in, worker i in bundle
    placement.bundle_offset + i, each asking for its bundle's resources (then
    num_cpus_per_worker only sets torch threads); None = Ray picks nodes."""
    forward_max_tokens: int | None = Field(None, ge=1)
    """Most tokens per forward micro-batch (rows × (longest prompt + longest response)
    in it), so a few long sequences make a small micro-batch; None = by sample count only."""
    max_batch_samples: int = Field(4096, ge=1)
    """Most rows one request may carry (larger ones get RESOURCE_EXHAUSTED)."""
    max_request_tokens: int = Field(262_144, ge=1)
    """Most token positions one request may carry: rows × input_ids columns (prompt +
    response); larger requests get RESOURCE_EXHAUSTED naming this setting. Sized to a
    worker's memory: the default runs send 17,408 (PPO: 256 × (64 + 4)) and 34,816 (GRPO:
    512 × 68); raise it for larger steps where the workers have the memory."""
    tracing: TracingConfig = Field(default_factory=TracingConfig)
    """OpenTelemetry span export of this service (and its workers); off by default. The
    trainer passes its own `trainer.tracing` here when it deploys the service."""

    @model_validator(mode="after")
    def _placement_has_room(self) -> WorkerServiceConfig:
        if self.placement is not None:
            self.placement.require_room_for(self.workers)
        return self


class TrainingServiceConfig(WorkerServiceConfig):
    """A worker service that trains its model with DeepSpeed (one rank per worker)."""

    gradient_checkpointing: bool = False
    """Recompute the model's activations in backward instead of keeping them (less
    memory for long sequences, ≈ one more forward of compute)."""
    zero_stage: int = Field(0, ge=0, le=3)
    """DeepSpeed ZeRO stage (0 = plain data parallel)."""
    weight_decay: float = Field(0.0, ge=0)
    """AdamW weight decay."""
    grad_clip: float = Field(1.0, gt=0)
    """Clip the global gradient norm to this value (DeepSpeed's gradient_clipping)."""
    ppo_mini_batch_samples: int = Field(64, ge=1)
    """Samples per optimizer step, across all workers; an update's rows must be a multiple."""
    checkpoint_root: str | None = None
    """Directory SaveCheckpoint / LoadCheckpoint are confined to: requests name a
    checkpoint by a path relative to it (e.g. "step_000010/critic"); absolute paths,
    '..' and symlinks leading out are refused. Must be shared by every worker (same path
    on every node). None = the service saves and loads no checkpoints. The trainer sets
    its run's checkpoints directory here when it deploys the service."""

    @property
    def worker_mini_batch_samples(self) -> int:
        """One worker's share of a mini-batch."""
        return self.ppo_mini_batch_samples // self.workers

    def mini_batch_split_issues(self, micro_batch_samples: int) -> list[tuple[str, str]]:
        """(field, problem) when a mini-batch does not split evenly over the workers, and
        each worker's share into micro-batches of `micro_batch_samples`: DeepSpeed needs
        every rank to run the same number of backward passes per optimizer step."""
        if self.ppo_mini_batch_samples % self.workers:
            return [
                (
                    "workers",
                    f"must divide ppo_mini_batch_samples ({self.ppo_mini_batch_samples}) so "
                    f"each worker gets an equal share of a mini-batch; got {self.workers}",
                )
            ]
        share = self.worker_mini_batch_samples
        if share % micro_batch_samples:
            return [
                (
                    "micro_batch_samples",
                    f"must divide each worker's share of a mini-batch, {share} samples "
                    f"(ppo_mini_batch_samples {self.ppo_mini_batch_samples} / workers "
                    f"{self.workers}); got {micro_batch_samples}",
                )
            ]
        return []
