"""The critic service's configuration: one typed, documented, validated model.

Batch sizes say their unit and scope in their names: `ppo_mini_batch_samples` is global
(summed over workers), `micro_batch_samples` and `forward_micro_batch_samples` are per
worker. The validator checks here what would otherwise fail deep inside DeepSpeed: a
mini-batch must split evenly over the workers and each worker's share evenly into
micro-batches, so every rank runs the same number of backward passes per optimizer step.
"""

from __future__ import annotations

from pydantic import Field, model_validator

from rlserve.core.config import ConfigError
from rlserve.core.run_config import CriticLossAggMode
from rlserve.core.service_config import TrainingServiceConfig

# A critic checkpoint directory: the value model (safetensors) and DeepSpeed's state.
MODEL_DIR = "model"
DEEPSPEED_DIR = "deepspeed"


class CriticServiceConfig(TrainingServiceConfig):
    """A value model (causal-LM backbone + scalar head) behind CriticService; the fields
    every worker service shares are documented in rlserve.core.service_config."""

    model_path: str
    """Causal-LM directory (HF format) the backbone starts from; the value head starts at
    zero, so every initial value is 0."""
    lr: float = Field(1e-3, gt=0)
    """Learning rate of AdamW."""
    ppo_epochs: int = Field(2, ge=1)
    """Passes over each UpdateCritic batch."""
    micro_batch_samples: int = Field(64, ge=1)
    """Samples per forward/backward pass on one worker; gradients accumulate over a
    worker's share of the mini-batch (a larger value trains the whole share at once)."""
    cliprange_value: float = Field(0.2, ge=0)
    """Value clip ε: in the loss a new value moves at most ε from the request's old value."""
    loss_agg_mode: CriticLossAggMode = "token-mean"
    """How token losses become one number: mean over all tokens of a mini-batch, or
    per-sequence sum/mean then mean over sequences."""
    forward_micro_batch_samples: int = Field(64, ge=1)
    """Samples per forward pass of ComputeValues on one worker."""

    @model_validator(mode="after")
    def _batches_split_evenly(self) -> CriticServiceConfig:
        # A micro-batch larger than a worker's share trains the share at once.
        micro_batch_samples = min(self.micro_batch_samples, max(1, self.worker_mini_batch_samples))
        issues = self.mini_batch_split_issues(micro_batch_samples)
        if issues:
            raise ConfigError(issues)
        return self

    @property
    def grad_accum_steps(self) -> int:
        """Micro-batches (backward passes) per worker per optimizer step."""
        return max(1, self.worker_mini_batch_samples // self.micro_batch_samples)
