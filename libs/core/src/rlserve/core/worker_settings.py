"""The settings a run's actor, critic and reference sections share with the worker
services that take them.

Each worker service's config subclasses its section's settings class here
(`ActorSettings` for the rollout, `CriticSettings`, `ReferenceConfig`) plus what its
deployer decides (rlserve.core.service_config), so a field added here is settable from
the run config and reaches the service with no other edit: the trainer passes each
section's settings on by name. The run's own sections (rlserve.core.run_config) add only
what is counted per run, such as mini-batches in prompts. Checks within one section live
here, so the service gets them too; `reward_settings` is the same for the reward service.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import ClassVar, Literal

from pydantic import Field, model_validator

from rlserve.core.algos.aggregation import LOSS_AGG_MODE_NOTES
from rlserve.core.algos.kl import KL_KIND_NOTES
from rlserve.core.algos.notes import choices_extra
from rlserve.core.algos.policy_loss_registry import POLICY_LOSS_NOTES
from rlserve.core.config import ConfigError, ConfigModel
from rlserve.core.devices import DeviceSetting

__all__ = [
    "ActorSettings",
    "CriticLossAggMode",
    "CriticSettings",
    "KlKind",
    "LossAggMode",
    "PolicyLossName",
    "ReferenceConfig",
    "RequestLimits",
    "TrainingSettings",
    "WorkerSettings",
]

# The choices are the PPO math registries' names (one list each, in rlserve.core.algos),
# so a config accepts exactly what is implemented and an unknown name fails validation,
# naming the field and every valid choice.
PolicyLossName = Literal[tuple(POLICY_LOSS_NOTES)]  # type: ignore[valid-type]
KlKind = Literal[tuple(KL_KIND_NOTES)]  # type: ignore[valid-type]
LossAggMode = Literal[tuple(LOSS_AGG_MODE_NOTES)]  # type: ignore[valid-type]
CriticLossAggMode = Literal["token-mean", "seq-mean-token-sum", "seq-mean-token-mean"]
"""The modes the critic service implements (its loss units per micro-batch)."""


class WorkerSettings(ConfigModel):
    """What every service with a worker group (rollout's actor, critic, reference) lets a
    run set about its workers."""

    workers: int = Field(1, ge=1)
    """Data-parallel workers (one Ray actor each; DeepSpeed ranks where the service
    trains); a request's rows are split over them."""
    device: DeviceSetting = "auto"
    """Where each worker computes: 'cuda' (one GPU per worker bundle, NCCL between
    ranks), 'cpu' (gloo), or 'auto' = CUDA when the worker sees a GPU."""
    forward_max_tokens: int | None = Field(None, ge=1)
    """Most tokens per forward micro-batch (rows × longest prompt + response in it): a
    few long sequences make a small micro-batch; None = by sample count only."""


class TrainingSettings(WorkerSettings):
    """What the two services that train (rollout's actor, critic) share."""

    grad_clip: float = Field(1.0, gt=0)
    """Clip the global gradient norm to this value."""
    zero_stage: int = Field(0, ge=0, le=3)
    """DeepSpeed ZeRO stage (0 = plain data parallel)."""
    weight_decay: float = Field(0.0, ge=0)
    """AdamW weight decay."""
    gradient_checkpointing: bool = False
    """Recompute activations in backward instead of keeping them (less memory for long
    sequences, ≈ one more forward of compute)."""


class RequestLimits(ConfigModel):
    """A service's limits on one request (the rollout's are rollout.max_*)."""

    max_batch_samples: int = Field(4096, ge=1)
    """Most rows one request may carry (larger ones get RESOURCE_EXHAUSTED); must hold a
    whole step's samples."""
    max_request_tokens: int = Field(262_144, ge=1)
    """Most token positions one request may carry: rows × input_ids columns (prompt +
    response); larger requests get RESOURCE_EXHAUSTED naming this setting. Sized to a
    worker's memory; must hold a whole step's."""


class ActorSettings(TrainingSettings):
    """The actor's training settings: every one reaches the rollout service's field of
    the same name (RolloutServiceConfig subclasses this)."""

    former_fields: ClassVar[Mapping[str, str]] = {
        "logprob_micro_batch_samples": "forward_micro_batch_samples"
    }

    lr: float = Field(2e-4, gt=0)
    """Learning rate of the actor's AdamW optimizer."""
    ppo_epochs: int = Field(2, ge=1)
    """Passes over each step's samples."""
    micro_batch_samples: int = Field(64, ge=1)
    """Samples per forward/backward pass on one worker (per worker; gradients accumulate
    over micro-batches up to the mini-batch). Left unset in a run: the largest divisor of
    a worker's share of the mini-batch up to 64."""
    clip_ratio_low: float | None = Field(None, ge=0, lt=1)
    """PPO clip: the ratio is kept above 1 - clip_ratio_low (dppo_tv/dppo_kl: the
    divergence allowed to a negative-advantage token). None = the policy loss's own
    default: 0.2, gspo 3e-4, gmpo 0.33, dppo_tv 0.15, dppo_kl 0.05."""
    clip_ratio_high: float | None = Field(None, ge=0)
    """PPO clip: the ratio is kept below 1 + clip_ratio_high (dppo_tv/dppo_kl: the
    divergence allowed to a positive-advantage token). None = the policy loss's own
    default: 0.2, gspo 4e-4, gmpo 0.49, dppo_tv 0.15, dppo_kl 0.05."""
    clip_ratio_dual: float | None = Field(None, gt=1)
    """Dual-clip bound c > 1 on the loss of negative-advantage tokens; None turns it off.
    Read by policy_loss 'vanilla' only."""
    policy_loss: PolicyLossName = Field(
        "vanilla", json_schema_extra=choices_extra(POLICY_LOSS_NOTES)
    )
    """Policy loss: 'vanilla' is PPO's clipped surrogate; clip_ratio_low/high are the clip
    of vanilla, gspo, cispo, gmpo and clip_cov (each in its own sense, see the list)."""
    loss_agg_mode: LossAggMode = Field(
        "token-mean", json_schema_extra=choices_extra(LOSS_AGG_MODE_NOTES)
    )
    """How a micro-batch's token losses (policy, entropy and KL loss) become one number;
    micro-batches and workers are then averaged, so 'token-sum' is the micro-batch's sum
    (see loss_normalizer)."""
    loss_normalizer: Literal["micro_batch", "mini_batch"] = "micro_batch"
    """Whose count divides the loss_agg_mode's sums: each micro-batch's own tokens (or
    sequences), then micro-batches and workers averaged; or 'mini_batch': the whole
    optimizer step's, across workers and micro-batches, so the gradient does not depend
    on how a mini-batch is split (VeRL's global-batch normalisation)."""
    clip_cov_fraction: float = Field(2e-4, gt=0, le=1)
    """Clip-Cov: fraction of a micro-batch's response tokens whose gradient is dropped
    (picked at random among those in the covariance band); policy_loss 'clip_cov' only."""
    clip_cov_low: float = 1.0
    """Clip-Cov: lower bound of the advantage-logprob covariance band (exclusive)."""
    clip_cov_high: float = 5.0
    """Clip-Cov: upper bound of the covariance band (exclusive); must exceed clip_cov_low."""
    kl_cov_fraction: float = Field(2e-3, gt=0, le=1)
    """KL-Cov: fraction of a micro-batch's response tokens, those of largest
    advantage-logprob covariance, that pay kl_cov_coef·|log ratio|; policy_loss 'kl_cov'
    only (the paper: 2e-3 for 7B models, 2e-4 for 32B)."""
    kl_cov_coef: float = Field(1.0, ge=0)
    """KL-Cov: weight β of the |log ratio| penalty on the selected tokens."""
    sapo_tau_pos: float = Field(1.0, gt=0)
    """SAPO: gate temperature of positive-advantage tokens (larger = the gradient fades
    sooner as the ratio leaves 1); policy_loss 'sapo' only."""
    sapo_tau_neg: float = Field(1.05, gt=0)
    """SAPO: gate temperature of zero and negative-advantage tokens."""
    dppo_max_ratio: float = Field(20.0, gt=0)
    """DPPO: cap on the importance weight of the tokens inside the trust region;
    policy_loss 'dppo_tv'/'dppo_kl' only (keep it large: the cap biases the gradient)."""
    entropy_coef: float = Field(0.0, ge=0)
    """Weight of the entropy bonus."""
    use_kl_loss: bool = False
    """Add a KL(policy‖reference) term to the actor loss (GRPO style) in addition to any
    KL penalty in the reward."""
    kl_loss_coef: float = Field(0.04, ge=0)
    """Weight of the KL loss term; used only when use_kl_loss."""
    kl_loss_kind: KlKind = Field("k3", json_schema_extra=choices_extra(KL_KIND_NOTES))
    """KL estimator of the KL loss term (a '+' variant: the estimator's value with k2's
    gradient)."""
    forward_micro_batch_samples: int = Field(64, ge=1)
    """Samples per forward pass of ComputeLogProb on one worker (and of the reference
    when it is merged into the rollout)."""
    logits_chunk_tokens: int | None = Field(None, ge=1)
    """Response tokens per LM-head chunk when scoring and training: peak logits memory
    is ≈ 3 × this × vocabulary floats, whatever the batch and sequence length. None =
    256 on a CPU worker, 4096 on a GPU one (rlserve.core.response_scoring)."""
    lora_rank: int = Field(0, ge=0)
    """Rank of LoRA adapters on the actor's linear layers (lora_target_modules); only the
    adapters train, generation gets merged weights, and the reference is the base with
    adapters off. 0 trains the full weights."""
    lora_alpha: float = Field(16.0, gt=0)
    """LoRA scale numerator: the adapters' update is scaled by lora_alpha / lora_rank."""
    lora_target_modules: list[str] | Literal["all-linear"] = "all-linear"
    """Module names that get adapters (e.g. [q_proj, v_proj]), or 'all-linear' (every
    linear layer but the LM head)."""
    kept_update_results: int = Field(16, ge=1)
    """Results of the most recent UpdateActor steps the service keeps to answer a
    retried step without training twice."""
    worker_call_timeout_s: float = Field(1800.0, gt=0)
    """Upper bound on one call from the rollout service to its workers, in seconds."""

    @model_validator(mode="after")
    def _kl_loss_has_weight(self) -> ActorSettings:
        if self.use_kl_loss and self.kl_loss_coef == 0:
            raise ConfigError(
                "kl_loss_coef", "is 0 while use_kl_loss is true; set it > 0 or turn the loss off"
            )
        if self.lora_rank and self.zero_stage == 3:
            raise ConfigError(
                "zero_stage",
                "3 partitions the base weights that LoRA merges for generation; use "
                "zero_stage 0-2 with lora_rank > 0",
            )
        if self.clip_ratio_dual is not None and self.policy_loss != "vanilla":
            raise ConfigError(
                "clip_ratio_dual",
                f"is read by policy_loss 'vanilla' only, not {self.policy_loss!r}; set it to null",
            )
        if self.clip_cov_low >= self.clip_cov_high:
            raise ConfigError(
                "clip_cov_high",
                f"must exceed clip_cov_low ({self.clip_cov_low}); got {self.clip_cov_high}",
            )
        return self


class CriticSettings(TrainingSettings, RequestLimits):
    """The critic's settings: every one reaches the critic service's field of the same
    name (CriticServiceConfig subclasses this)."""

    lr: float = Field(1e-3, gt=0)
    """Learning rate of the critic's AdamW optimizer."""
    ppo_epochs: int = Field(2, ge=1)
    """Passes over each step's samples."""
    micro_batch_samples: int = Field(64, ge=1)
    """Samples per forward/backward pass on one worker (per worker; a larger value
    trains a worker's whole share of a mini-batch at once). Left unset in a run: the
    largest divisor of a worker's share of the mini-batch up to 64."""
    cliprange_value: float = Field(0.2, gt=0)
    """Value clip: new values stay within this distance of the old ones in the loss."""
    forward_micro_batch_samples: int = Field(64, ge=1)
    """Samples per forward pass of ComputeValues on one worker."""
    loss_agg_mode: CriticLossAggMode = Field(
        "token-mean",
        json_schema_extra=choices_extra(LOSS_AGG_MODE_NOTES, CriticLossAggMode.__args__),
    )
    """How token value losses become one number: mean over all tokens, or per-sequence
    sum/mean then mean over sequences."""


class ReferenceConfig(WorkerSettings, RequestLimits):
    """The frozen reference policy (reference.ComputeRefLogProb); used when the run has a
    KL penalty or KL loss. Merged into the rollout (placement.reference_in_rollout), it
    runs inside the actor's workers with the actor's settings instead. Every field
    reaches the reference service's field of the same name."""

    former_fields: ClassVar[Mapping[str, str]] = {
        "micro_batch_samples": "forward_micro_batch_samples"
    }

    forward_micro_batch_samples: int = Field(64, ge=1)
    """Samples per forward pass on one worker."""
    logits_chunk_tokens: int | None = Field(None, ge=1)
    """Response tokens per LM-head chunk (peak logits memory ≈ 3 × this × vocabulary
    floats); None = 256 on a CPU worker, 4096 on a GPU one."""
