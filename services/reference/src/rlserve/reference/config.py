"""The reference service's configuration: one typed, documented, validated model."""

from typing import Literal

from pydantic import Field, model_validator

from rlserve.core.config import ConfigModel
from rlserve.core.devices import DeviceSetting
from rlserve.core.placement import WorkerPlacementConfig
from rlserve.core.run_config import TracingConfig


class ReferenceServiceConfig(ConfigModel):
    """A frozen copy of the initial policy behind ReferenceService."""

    model_path: str
    """Causal-LM directory (HF format) of the initial policy."""
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """Parameter dtype of the model; log-probs are computed in float32 either way."""
    workers: int = Field(1, ge=1)
    """Data-parallel workers, one Ray actor each; a request's rows are split over them."""
    device: DeviceSetting = "auto"
    """Where each worker computes: 'cuda' (its bundle's GPU), 'cpu', or 'auto' = CUDA
    when the worker sees a GPU."""
    logits_chunk_tokens: int = Field(256, ge=1)
    """Response tokens per LM-head chunk: peak logits memory is ≈ 3 × this × vocabulary
    floats, whatever the batch and sequence length."""
    num_cpus_per_worker: float = Field(1.0, gt=0)
    """Ray CPUs reserved per worker; also its torch thread count (rounded down, at least 1)."""
    placement: WorkerPlacementConfig | None = None
    """Named placement group (a resource pool's) the workers run in, worker i in bundle
    placement.bundle_offset + i, each asking for its bundle's resources (then
    num_cpus_per_worker only sets torch threads); None = Ray picks nodes."""
    micro_batch_samples: int = Field(64, ge=1)
    """Samples per forward pass on one worker."""
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
    temperature: float = Field(1.0, gt=0)
    """Logits are divided by it before the log-softmax, for batches whose meta carries no
    'temperature' (the rollout stamps its sampling temperature there, and that one wins);
    set it to the rollout's sampling temperature so the KL compares the same distributions."""
    tracing: TracingConfig = Field(default_factory=TracingConfig)
    """OpenTelemetry span export of this service (and its workers); off by default. The
    trainer passes its own `trainer.tracing` here when it deploys the service."""

    @model_validator(mode="after")
    def _placement_has_room(self) -> "ReferenceServiceConfig":
        if self.placement is not None:
            self.placement.require_room_for(self.workers)
        return self
