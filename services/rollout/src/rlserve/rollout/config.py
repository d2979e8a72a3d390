"""The rollout service's configuration: one typed, documented, validated model.

Batch sizes carry their unit and scope in their names: `ppo_mini_batch_samples` and
`max_batch_samples` are global (the whole request, summed over workers);
`micro_batch_samples` and `logprob_micro_batch_samples` are per worker. The validator
checks here what would otherwise fail deep inside DeepSpeed: a mini-batch must split
evenly over the workers and each worker's share evenly into micro-batches, so every rank
runs the same number of backward passes per optimizer step.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from rlserve.core.config import ConfigError
from rlserve.core.run_config import KlKind, LossAggMode, PolicyLossName
from rlserve.core.service_config import TrainingServiceConfig
from rlserve.core.vllm_config import VllmConfig


class RolloutServiceConfig(TrainingServiceConfig):
    """The actor (generation + PPO training of one policy) behind RolloutService; the
    fields every worker service shares are documented in rlserve.core.service_config."""

    engine: Literal["hf", "vllm"] = "hf"
    """Generation engine: transformers `generate` ('hf') or vLLM in-process ('vllm')."""
    vllm: VllmConfig = Field(default_factory=VllmConfig)
    """vLLM engine settings (KV cache, context length, sleep while training); used when
    engine is 'vllm'. The trainer passes its `rollout.vllm` here."""
    lora_rank: int = Field(0, ge=0)
    """Rank of LoRA adapters on every linear layer but the LM head (lora_target_modules);
    only the adapters train and the reference is the base with adapters off. 0 trains
    the full weights."""
    lora_alpha: float = Field(16.0, gt=0)
    """LoRA scale numerator: the adapter's update is scaled by lora_alpha / lora_rank."""
    lora_target_modules: list[str] | Literal["all-linear"] = "all-linear"
    """Module names (e.g. [q_proj, v_proj]) that get adapters, or 'all-linear'."""
    logits_chunk_tokens: int = Field(256, ge=1)
    """Response tokens per LM-head chunk when scoring and training: peak logits memory is
    ≈ 3 × this × vocabulary floats, whatever the batch and sequence length."""
    torch_threads_per_worker: int = Field(1, ge=1)
    """torch intra-op threads in each worker (keep workers × threads ≤ physical cores)."""
    serve_reference: bool = False
    """Also answer ReferenceService.ComputeRefLogProb: each worker keeps a frozen copy of
    the initial weights beside its training engine (the reference merged into the actor's
    process, no separate reference service; with LoRA, the same weights with adapters off)."""
    seed: int = 0
    """Seed of the mini-batch shuffling (offset by the step) and of the vLLM engine."""

    lr: float = Field(2e-4, gt=0)
    """Learning rate of the actor's AdamW optimizer."""
    ppo_epochs: int = Field(1, ge=1)
    """Passes over each UpdateActor batch."""
    micro_batch_samples: int = Field(16, ge=1)
    """Samples per forward/backward pass on one worker; gradients accumulate over a
    worker's share of the mini-batch."""
    clip_ratio_low: float | None = Field(None, ge=0, lt=1)
    """PPO clip: the ratio is kept above 1 - clip_ratio_low (the DPPO losses' divergence
    threshold); None = the policy loss's default (rlserve.core.ppo_math.DEFAULT_CLIP_RATIOS)."""
    clip_ratio_high: float | None = Field(None, ge=0)
    """PPO clip: the ratio is kept below 1 + clip_ratio_high; None = the loss's default."""
    clip_ratio_dual: float | None = Field(None, gt=1)
    """Dual-clip bound c > 1 on the loss of negative-advantage tokens; None turns it off
    (policy_loss 'vanilla' only)."""
    policy_loss: PolicyLossName = "vanilla"
    """Policy loss by name (rlserve.core.ppo_math.POLICY_LOSSES); 'vanilla' is PPO's
    clipped surrogate."""
    loss_agg_mode: LossAggMode = "token-mean"
    """How token losses of a micro-batch become one number (rlserve.core.ppo_math
    .aggregate_loss)."""
    loss_normalizer: Literal["micro_batch", "mini_batch"] = "micro_batch"
    """Whose token (or sequence) count divides the loss: each micro-batch's own, or the
    whole mini-batch's across workers and micro-batches (the gradient then does not
    depend on how a mini-batch is split)."""
    clip_cov_fraction: float = Field(2e-4, gt=0, le=1)
    """Clip-Cov: fraction of a micro-batch's response tokens whose gradient is dropped."""
    clip_cov_low: float = 1.0
    """Clip-Cov: lower bound of the covariance band (exclusive)."""
    clip_cov_high: float = 5.0
    """Clip-Cov: upper bound of the covariance band (exclusive)."""
    kl_cov_fraction: float = Field(2e-3, gt=0, le=1)
    """KL-Cov: fraction of a micro-batch's response tokens that pay the |log ratio| penalty."""
    kl_cov_coef: float = Field(1.0, ge=0)
    """KL-Cov: weight of the |log ratio| penalty."""
    sapo_tau_pos: float = Field(1.0, gt=0)
    """SAPO: gate temperature of positive-advantage tokens."""
    sapo_tau_neg: float = Field(1.05, gt=0)
    """SAPO: gate temperature of zero and negative-advantage tokens."""
    dppo_max_ratio: float = Field(20.0, gt=0)
    """DPPO: cap on the importance weight of tokens inside the trust region."""
    entropy_coef: float = Field(0.0, ge=0)
    """Weight of the entropy bonus (subtracted from the loss)."""
    use_kl_loss: bool = False
    """Add a KL(policy‖reference) loss term; UpdateActor batches then need ref_log_probs."""
    kl_loss_coef: float = Field(0.04, ge=0)
    """Weight of the KL loss term; used only when use_kl_loss."""
    kl_loss_kind: KlKind = "k3"
    """KL estimator of the KL loss term."""

    temperature: float = Field(1.0, gt=0)
    """Softmax temperature of ComputeLogProb and UpdateActor for batches whose meta has no
    'temperature' (GenerateSequences stamps the sampling temperature into its batches)."""
    logprob_micro_batch_samples: int = Field(64, ge=1)
    """Samples per forward pass of ComputeLogProb on one worker."""
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
    kept_update_results: int = Field(16, ge=1)
    """Results of the most recent UpdateActor steps kept to answer retries idempotently."""
    worker_call_timeout_s: float = Field(1800.0, gt=0)
    """Upper bound on one call to the workers, in seconds (the caller's deadline, when
    sooner, bounds generation and log-prob calls too)."""

    @model_validator(mode="after")
    def _batches_split_evenly(self) -> RolloutServiceConfig:
        issues = self.mini_batch_split_issues(self.micro_batch_samples)
        if self.lora_rank and self.zero_stage == 3:
            issues.append(
                (
                    "zero_stage",
                    "3 partitions the base weights that LoRA merges for generation; use "
                    "zero_stage 0-2 with lora_rank > 0",
                )
            )
        if self.use_kl_loss and self.kl_loss_coef == 0:
            issues.append(
                ("kl_loss_coef", "is 0 while use_kl_loss is true; set it > 0 or turn the loss off")
            )
        if self.clip_ratio_dual is not None and self.policy_loss != "vanilla":
            issues.append(
                (
                    "clip_ratio_dual",
                    f"is read by policy_loss 'vanilla' only, not {self.policy_loss!r}; set it "
                    "to null",
                )
            )
        if self.clip_cov_low >= self.clip_cov_high:
            issues.append(
                (
                    "clip_cov_high",
                    f"must exceed clip_cov_low ({self.clip_cov_low}); got {self.clip_cov_high}",
                )
            )
        if issues:
            raise ConfigError(issues)
        return self

    @property
    def grad_accum_steps(self) -> int:
        """Micro-batches per optimizer step on each worker."""
        return self.worker_mini_batch_samples // self.micro_batch_samples
