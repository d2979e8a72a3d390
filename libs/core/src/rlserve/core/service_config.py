"""What a deployment adds to a worker service's settings: one settings path.

A worker service's config is two parts. Its *settings* are the run config's section
(rlserve.core.worker_settings: ActorSettings for the rollout, CriticSettings, ReferenceConfig),
so a field added there is settable from the run config and reaches the service with no
other edit: the trainer passes each section's settings on by name. Its *deployment* is
what whoever deploys it decides from elsewhere: the model, its dtype, the CPUs and
placement group of its workers, tracing (`WorkerDeployment`) and, for the services that
train, the mini-batch in samples and the checkpoint root (`TrainingDeployment`). A
service's config class subclasses one of each, and adds only what the trainer derives
for that service alone.
"""

from __future__ import annotations

from pydantic import Field, model_validator

from rlserve.core.auth import ServiceAuth
from rlserve.core.config import ConfigError, ConfigModel
from rlserve.core.inputs_config import Dtype
from rlserve.core.placement_config import WorkerPlacementConfig, shares_a_gpu
from rlserve.core.tracing_config import TracingConfig
from rlserve.core.worker_settings import WorkerSettings


class StageThreads(ConfigModel):
    """torch intra-op threads a worker uses in each stage of a PPO step. The trainer
    plans them from the node's cores and the workers busy in each stage at once
    (rlserve.trainer.deploy.stage_thread_plan); a stage a service has not is ignored."""

    generate: int = Field(1, ge=1)
    forward: int = Field(1, ge=1)
    """Log-prob, reference and value forwards."""
    update: int = Field(1, ge=1)


class WorkerDeployment(WorkerSettings, ServiceAuth):
    """Where and on what a worker service runs."""

    model_path: str
    """Causal-LM directory (Hugging Face format) the service's model starts from."""
    dtype: Dtype = "auto"
    """Parameter dtype of the model (bfloat16/float16 turn on DeepSpeed's mixed precision
    where the service trains); 'auto' is bfloat16 on a GPU with native bf16, else
    float32, decided by each worker for its device. Log-probs and values are computed in
    float32 either way."""
    num_cpus_per_worker: float = Field(1.0, gt=0)
    """Ray CPUs reserved per worker; also its torch thread count (rounded down, at least
    1) unless the service has a thread setting of its own."""
    placement: WorkerPlacementConfig | None = None
    """Named placement group (a resource pool's) the workers run in, worker i in bundle
    placement.bundle_offset + i, each asking for its bundle's resources (then
    num_cpus_per_worker only sets torch threads); None = Ray picks nodes."""
    tracing: TracingConfig = Field(default_factory=TracingConfig)
    """OpenTelemetry span export of this service (and its workers); off by default. The
    trainer passes its own `trainer.tracing` here when it deploys the service."""
    stage_threads: StageThreads | None = None
    """torch threads per stage (each call sets its stage's); None = the fixed thread
    count above. The trainer sets it when it knows the cores its workers share."""
    keep_freed_pages: bool = False
    """Worker allocators keep freed pages for reuse instead of returning them to the
    kernel (faster updates of large models at their peak resident memory; see
    rlserve.core.workers). The trainer sets it for models of >= 100 MiB of weights."""
    gpus_per_worker: float | None = Field(None, ge=0, le=1)
    """GPUs each worker reserves when `placement` is None; a fraction shares a GPU among
    workers. The trainer sets it when the run has more GPU workers than the cluster has
    GPUs (rlserve.core.devices.worker_gpus); None = decided from this service's own
    workers and device (1 for 'cuda', or 'auto' on a cluster with a GPU to each)."""

    @model_validator(mode="after")
    def _placement_has_room(self) -> WorkerDeployment:
        if self.placement is not None:
            self.placement.require_room_for(self.workers)
        return self

    def fractional_gpu_field(self) -> str | None:
        """The field that gives this service's workers part of a GPU, or None (whole
        GPUs, or none)."""
        if self.placement is not None:
            own = self.placement.bundles[self.placement.bundle_offset :][: self.workers]
            if any(shares_a_gpu(bundle) for bundle in own):
                return "placement.bundles"
        elif self.gpus_per_worker is not None and 0 < self.gpus_per_worker < 1:
            return "gpus_per_worker"
        return None


class TrainingDeployment(WorkerDeployment):
    """A worker service that trains its model with DeepSpeed (one rank per worker)."""

    ppo_mini_batch_samples: int = Field(64, ge=1)
    """Samples per optimizer step, across all workers; an update's rows must be a multiple
    (the trainer sets the run's mini-batch prompts × responses per prompt)."""
    checkpoint_root: str | None = None
    """Directory SaveCheckpoint / LoadCheckpoint are confined to: requests name a
    checkpoint by a path relative to it (e.g. "step_000010/critic"); absolute paths,
    '..' and symlinks leading out are refused. Must be shared by every worker (same path
    on every node). None = the service saves and loads no checkpoints. The trainer sets
    its run's checkpoints directory here when it deploys the service."""

    @model_validator(mode="after")
    def _one_gpu_per_rank(self) -> TrainingDeployment:
        field = self.fractional_gpu_field()
        if self.workers > 1 and field is not None:
            raise ConfigError(
                "workers",
                f"{self.workers} ranks of one NCCL group on shares of a GPU ({field} gives "
                "each worker less than one) may land on one GPU, which NCCL refuses; give "
                "each worker a whole GPU or set workers: 1",
            )
        return self

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
