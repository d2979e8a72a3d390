"""The critic service's configuration: one typed, documented, validated model.

Batch sizes say their unit and scope in their names: `ppo_mini_batch_samples` is global
(summed over workers), `micro_batch_samples` and `forward_micro_batch_samples` are per
worker. The validator checks here what would otherwise fail deep inside DeepSpeed: a
mini-batch must split evenly over the workers and each worker's share evenly into
micro-batches, so every rank runs the same number of backward passes per optimizer step.
"""

from __future__ import annotations

from pydantic import model_validator

from rlserve.core.config import ConfigError
from rlserve.core.service_config import TrainingDeployment
from rlserve.core.worker_settings import CriticSettings

# A critic checkpoint directory: the value model (safetensors) here, DeepSpeed's state
# in rlserve.core.training.DEEPSPEED_SUBDIR.
MODEL_DIR = "model"


class CriticServiceConfig(CriticSettings, TrainingDeployment):
    """A value model (causal-LM backbone + scalar head, the head starting at zero, so
    every initial value is 0) behind CriticService: the run config's critic settings
    (rlserve.core.worker_settings.CriticSettings) plus where and on what it runs
    (rlserve.core.service_config.TrainingDeployment)."""

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
