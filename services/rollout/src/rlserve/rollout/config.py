"""The rollout service's configuration: one typed, documented, validated model.

Batch sizes carry their unit and scope in their names: `ppo_mini_batch_samples` and
`max_batch_samples` are global (the whole request, summed over workers);
`micro_batch_samples` and `forward_micro_batch_samples` are per worker. The validator
checks here what would otherwise fail deep inside DeepSpeed: a mini-batch must split
evenly over the workers and each worker's share evenly into micro-batches, so every rank
runs the same number of backward passes per optimizer step.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from rlserve.core.config import ConfigError
from rlserve.core.service_config import TrainingDeployment
from rlserve.core.vllm_config import VllmConfig
from rlserve.core.worker_settings import ActorSettings


class RolloutServiceConfig(ActorSettings, TrainingDeployment):
    """The actor (generation + PPO training of one policy) behind RolloutService: the run
    config's actor settings (rlserve.core.worker_settings.ActorSettings, whose validator
    checks their combinations), where and on what it runs
    (rlserve.core.service_config.TrainingDeployment), and the generation settings below,
    which the trainer takes from the run's rollout section."""

    engine: Literal["hf", "vllm"] = "hf"
    """Generation engine: transformers `generate` ('hf') or vLLM in-process ('vllm')."""
    vllm: VllmConfig = Field(default_factory=VllmConfig)
    """vLLM engine settings (KV cache, context length, sleep while training); used when
    engine is 'vllm'. The trainer passes its `rollout.vllm` here."""
    torch_threads_per_worker: int = Field(1, ge=1)
    """torch intra-op threads in each worker (keep workers × threads ≤ physical cores)."""
    serve_reference: bool = False
    """Also answer ReferenceService.ComputeRefLogProb: each worker keeps a frozen copy of
    the initial weights beside its training engine (the reference merged into the actor's
    process, no separate reference service; with LoRA, the same weights with adapters off)."""
    seed: int = 0
    """Seed of the mini-batch shuffling (offset by the step) and of the vLLM engine."""

    temperature: float = Field(1.0, gt=0)
    """Softmax temperature of ComputeLogProb and UpdateActor for batches whose meta has no
    'temperature' (GenerateSequences stamps the sampling temperature into its batches)."""
    max_batch_samples: int = Field(4096, ge=1)
    """Most rows one request may carry or produce (prompts × responses for generation);
    larger requests get RESOURCE_EXHAUSTED."""
    max_new_tokens_limit: int = Field(1024, ge=1)
    """Largest sampling.max_new_tokens a GenerateSequences request may ask for."""
    max_request_tokens: int = Field(262_144, ge=1)
    """Most token positions one request may carry or produce (rows × sequence length);
    larger requests get RESOURCE_EXHAUSTED naming this setting. GenerateSequences counts
    prompts × responses_per_prompt × (prompt columns + max_new_tokens), the batch it
    returns, which is also what the 'hf' engine's KV cache holds; ComputeLogProb,
    ComputeRefLogProb and UpdateActor count rows × input_ids columns. A request of a few
    hundred bytes (1 prompt × 4096 responses × 120 tokens) would otherwise ask a worker
    for gigabytes. Sized to a worker's memory: 262,144 positions of KV cache take 1 GiB
    with the embedded tiny model (4 KiB per position), 11 GiB with SmolLM2-135M in
    float32 (45 KiB: 30 layers × 3 KV heads × 64 dims × 2 × 4 bytes), while the default
    runs ask for 17,408 (PPO: 256 × 1 × (64 + 4)) and 34,816 (GRPO: 64 × 8 × 68), and
    four responses per prompt at the default 256 prompts 69,632. Lower it on small
    workers; raise it for larger steps where the workers have the memory."""

    @model_validator(mode="after")
    def _batches_split_evenly(self) -> RolloutServiceConfig:
        issues = self.mini_batch_split_issues(self.micro_batch_samples)
        if issues:
            raise ConfigError(issues)
        return self

    @property
    def grad_accum_steps(self) -> int:
        """Micro-batches per optimizer step on each worker."""
        return self.worker_mini_batch_samples // self.micro_batch_samples
