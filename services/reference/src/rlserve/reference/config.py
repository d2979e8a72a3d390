"""The reference service's configuration: one typed, documented, validated model."""

from pydantic import Field

from rlserve.core.service_config import WorkerServiceConfig


class ReferenceServiceConfig(WorkerServiceConfig):
    """A frozen copy of the initial policy behind ReferenceService; the fields every
    worker service shares are documented in rlserve.core.service_config."""

    logits_chunk_tokens: int = Field(256, ge=1)
    """Response tokens per LM-head chunk: peak logits memory is ≈ 3 × this × vocabulary
    floats, whatever the batch and sequence length."""
    micro_batch_samples: int = Field(64, ge=1)
    """Samples per forward pass on one worker."""
    temperature: float = Field(1.0, gt=0)
    """Logits are divided by it before the log-softmax, for batches whose meta carries no
    'temperature' (the rollout stamps its sampling temperature there, and that one wins);
    set it to the rollout's sampling temperature so the KL compares the same distributions."""
