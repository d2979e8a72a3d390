"""The reference service's configuration: one typed, documented, validated model."""

from pydantic import Field

from rlserve.core.service_config import WorkerDeployment
from rlserve.core.worker_settings import ReferenceConfig


class ReferenceServiceConfig(ReferenceConfig, WorkerDeployment):
    """A frozen copy of the initial policy behind ReferenceService: the run config's
    reference settings (rlserve.core.worker_settings.ReferenceConfig) plus where and on what
    it runs (rlserve.core.service_config.WorkerDeployment)."""

    temperature: float = Field(1.0, gt=0)
    """Logits are divided by it before the log-softmax, for batches whose meta carries no
    'temperature' (the rollout stamps its sampling temperature there, and that one wins);
    set it to the rollout's sampling temperature so the KL compares the same distributions."""
