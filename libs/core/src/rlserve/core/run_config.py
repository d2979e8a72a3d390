"""The config of one PPO / GRPO run: `RunConfig` and its sections.

Defaults are the PPO recipe measured on the embedded default: a tiny Llama
(hidden 128, 4 layers) warmed up on two-number addition, then PPO with 256 prompts × 1
sample per step, ≤ 4 new tokens, actor lr 2e-4, critic lr 1e-3, token KL penalty 0.02
(k1) in the reward, GAE γ=1 λ=0.95, whitened advantages, clip 0.2, 2 epochs.
`configs/embedded_default.yaml` spells the same values out; `configs/embedded_grpo.yaml`
is GRPO's recipe on top of them.

Units are in the names: `*_prompts` counts prompts, `*_samples` counts samples (one
sample = one prompt + one response; a step has `prompts_per_step × responses_per_prompt`
of them), `*_s` is seconds, `*_steps` counts PPO steps. Batch sizes are global (the whole
step, across workers) unless the docstring says "per worker".

The sections a service shares, and those with a purpose of their own, live in their own
modules: the worker services' settings (rlserve.core.worker_settings, which `actor`,
`critic` and `reference` are or extend), the reward's (reward_settings), `model` and
`data` (inputs_config), `placement` (placement_config), `trainer.tracing`
(tracing_config) and `rollout.vllm` (vllm_config). Checks that involve several sections
(batch divisibility, estimator needs) live on `RunConfig`; checks within one section live
on that section, so a service whose config subclasses that section's settings (each
worker service, and the reward service through rlserve.core.reward_settings) gets them
too.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Mapping
from pathlib import Path
from typing import ClassVar, Literal

from pydantic import Field, field_validator, model_validator

from rlserve.core.algos.advantage_registry import (
    ADVANTAGE_ESTIMATOR_NOTES,
    estimator_needs,
    needs_group_ids,
)
from rlserve.core.algos.advantage_registry import needs_critic as estimator_needs_critic
from rlserve.core.algos.advantages import SINGLETON_GROUP_CHOICES
from rlserve.core.algos.kl import KL_KIND_NOTES
from rlserve.core.algos.notes import choices_extra
from rlserve.core.config import ConfigError, ConfigModel
from rlserve.core.environment_settings import AgentConfig
from rlserve.core.inputs_config import (
    LARGE_MODEL_WEIGHT_BYTES,
    DataConfig,
    ModelConfig,
    model_weight_bytes,
)
from rlserve.core.placement_config import PlacementConfig, shares_a_gpu
from rlserve.core.reward_settings import RewardSettings
from rlserve.core.tracing_config import TracingConfig
from rlserve.core.vllm_config import VllmConfig
from rlserve.core.worker_settings import ActorSettings, CriticSettings, KlKind, ReferenceConfig

__all__ = [
    "EMBEDDED_AGENT_CONFIG_PATH",
    "EMBEDDED_DAPO_CONFIG_PATH",
    "EMBEDDED_DEFAULT_CONFIG_PATH",
    "EMBEDDED_GRPO_CONFIG_PATH",
    "GROUP_ESTIMATORS",
    "ActorConfig",
    "AdvEstimator",
    "AlgorithmConfig",
    "CriticConfig",
    "KlControlConfig",
    "RewardConfig",
    "RolloutConfig",
    "RunConfig",
    "SingletonGroups",
    "TrainerConfig",
]

EMBEDDED_DEFAULT_CONFIG_PATH = Path(__file__).parent / "configs" / "embedded_default.yaml"
"""The example config: the embedded default run with every setting written out."""

EMBEDDED_GRPO_CONFIG_PATH = Path(__file__).parent / "configs" / "embedded_grpo.yaml"
EMBEDDED_DAPO_CONFIG_PATH = Path(__file__).parent / "configs" / "embedded_dapo.yaml"
EMBEDDED_AGENT_CONFIG_PATH = Path(__file__).parent / "configs" / "embedded_agent.yaml"
"""GRPO's recipe for the embedded default: the settings it changes, and why (the one
copy: docs/algorithms.md, tests and benchmarks load this file)."""

ONE_STEP_OFF_IS_CAP = 2.0
"""The rollout correction's cap when rollout.mode is one_step_off and
algorithm.rollout_is_cap is null."""

# The choices of the algorithm fields are the PPO math registries' names (one list each,
# in rlserve.core.algos), so the config accepts exactly what is implemented and an
# unknown name fails validation, naming the field and every valid choice.
AdvEstimator = Literal[tuple(ADVANTAGE_ESTIMATOR_NOTES)]  # type: ignore[valid-type]
SingletonGroups = Literal[SINGLETON_GROUP_CHOICES]  # type: ignore[valid-type]

GROUP_ESTIMATORS: frozenset[str] = frozenset(
    name for name in ADVANTAGE_ESTIMATOR_NOTES if needs_group_ids(name)
)
"""Estimators whose baseline comes from the other responses to the same prompt."""


# --- rollout ----------------------------------------------------------------------------


class RolloutConfig(ConfigModel):
    """Generation by the rollout service."""

    former_fields: ClassVar[Mapping[str, str]] = {
        # it never reached the service: the actor's workers are the ones that generate
        "workers": "actor.workers (the actor's data-parallel workers generate and train)"
    }

    engine: Literal["auto", "hf", "vllm"] = "auto"
    """Generation engine: transformers 'generate' or vLLM. 'auto': vLLM when it is
    installed and model.path holds LARGE_MODEL_WEIGHT_BYTES of safetensors, else hf
    (on SmolLM2-135M and 2 CPU cores vLLM generated 32 × 48 tokens in 3.9 s, hf in
    11-13 s; on a tiny model vLLM's fixed cost per call outweighs its kernels)."""
    vllm: VllmConfig = Field(default_factory=VllmConfig)
    """vLLM engine settings (KV cache, context length, CUDA graphs, sleep while
    training); used when engine is 'vllm'. Passed to the rollout service as they are."""
    temperature: float = Field(1.0, ge=0)
    """Sampling temperature; 0 means greedy decoding."""
    top_p: float = Field(1.0, gt=0, le=1)
    """Nucleus sampling mass; 1 keeps every token."""
    top_k: int = -1
    """Sample from the k most likely tokens; -1 turns it off."""
    max_new_tokens: int = Field(4, ge=1)
    """Most tokens generated per response."""
    responses_per_prompt: int = Field(1, ge=1)
    """Responses sampled per prompt (n); group estimators need at least 2."""
    ignore_eos: bool = False
    """Keep sampling past EOS to exactly max_new_tokens per training response (fixed
    workloads for benchmarks); greedy evaluation stops at EOS regardless."""
    mode: Literal["sync", "one_step_off"] = "sync"
    """'sync': every step generates with the weights it then trains (metric staleness 0).
    'one_step_off': step t+1's generation is asked for as soon as step t's batch is in,
    so it runs beside step t's other forwards and the critic's update, and each step
    after the first trains on samples of the weights one update older (staleness 1),
    weighted by the truncated importance ratio to the policy that generated them
    (algorithm.rollout_is_cap, 2.0 when null). The actor's update waits for that
    generation, which uses the same workers."""
    eval_every_steps: int = Field(10, ge=0)
    """Greedy held-out evaluation every this many PPO steps; 0 turns it off."""
    eval_prompts: int = Field(500, ge=1)
    """Held-out prompts per evaluation (fewer if the eval set is smaller)."""
    max_batch_samples: int = Field(4096, ge=1)
    """Most rows one rollout-service request may carry or produce (prompts × responses);
    larger requests are refused. Must hold a whole step's samples."""
    max_request_tokens: int = Field(262_144, ge=1)
    """Most token positions one rollout-service request may carry or produce (rows ×
    (prompt + response) columns; the service's setting of the same name says why and
    how it is sized). Must hold a whole step's and an evaluation's: samples ×
    (data.max_prompt_tokens + rollout.max_new_tokens)."""
    agent: AgentConfig | None = None
    """Multi-turn, tool-calling responses (the run also deploys the environment service
    with these tools); null = one turn. The model's tokenizer needs a chat template."""

    @field_validator("top_k")
    @classmethod
    def _top_k_off_or_positive(cls, value: int) -> int:
        if value != -1 and value < 1:
            raise ValueError(f"must be -1 (off) or >= 1; got {value}")
        return value


# --- actor and critic -------------------------------------------------------------------


class ActorConfig(ActorSettings):
    """Policy training (rollout.UpdateActor)."""

    ppo_mini_batch_prompts: int = Field(64, ge=1)
    """Prompts per optimizer step (samples = prompts × responses_per_prompt); must divide
    trainer.prompts_per_step. Left unset in a run: the largest divisor of
    trainer.prompts_per_step up to 64 (the whole step when it has at most 64 prompts)."""
    reuse_update_forward: bool = True
    """When a step's update is one on-policy optimizer step (see RunConfig.
    single_pass_update), take the old log-probs from the update's own forward instead
    of a ComputeLogProb pass before it: the same numbers, one forward fewer. False
    always runs the separate pass."""


class CriticConfig(CriticSettings):
    """Value-model training (critic.UpdateCritic); used only by the 'gae' estimator."""

    model_path: str | None = None
    """Weights to start the critic from; None uses the policy's (model.path or the embedded
    model), with a zero-initialised value head."""
    ppo_mini_batch_prompts: int = Field(64, ge=1)
    """Prompts per optimizer step (samples = prompts × responses_per_prompt); must divide
    trainer.prompts_per_step. Left unset in a run: the largest divisor of
    trainer.prompts_per_step up to 64 (the whole step when it has at most 64 prompts)."""


# --- algorithm --------------------------------------------------------------------------


class KlControlConfig(ConfigModel):
    """Coefficient β of the KL penalty in the token rewards (score − β·KL)."""

    kind: Literal["fixed", "adaptive"] = "fixed"
    """'fixed' keeps β = kl_coef; 'adaptive' steers the measured KL toward target_kl."""
    kl_coef: float = Field(0.02, ge=0)
    """β, or its starting value when adaptive; 0 removes the KL penalty from the reward."""
    target_kl: float = Field(0.1, gt=0)
    """KL per sequence that the adaptive controller aims for; unused when fixed."""
    horizon: int = Field(10000, ge=1)
    """Samples over which the adaptive controller moves β by its proportional error."""


class AlgorithmConfig(ConfigModel):
    """Advantage estimation and the KL penalty, computed by the trainer."""

    adv_estimator: AdvEstimator = Field(
        "gae", json_schema_extra=choices_extra(ADVANTAGE_ESTIMATOR_NOTES)
    )
    """Advantage estimator; 'gae' needs the critic, the others use reward baselines."""
    gamma: float = Field(1.0, ge=0, le=1)
    """Discount per token (GAE)."""
    lam: float = Field(0.95, ge=0, le=1)
    """GAE λ: trades bias (0) for variance (1)."""
    kl_penalty: KlKind = Field("k1", json_schema_extra=choices_extra(KL_KIND_NOTES))
    """KL estimator of the per-token penalty in the rewards (a '+' variant counts as its
    base estimator here: a reward has no gradient)."""
    kl_ctrl: KlControlConfig = Field(default_factory=KlControlConfig)
    """Controller of the penalty's coefficient β."""
    whiten_advantages: bool = True
    """Whiten 'gae' advantages over the step's response tokens; the other estimators
    ignore it (GRPO's std division is norm_adv_by_std_in_grpo)."""
    norm_adv_by_std_in_grpo: bool = True
    """'grpo' divides each score's distance from its group mean by the group's std;
    false is Dr. GRPO (no std division: easy and hard prompts are not up-weighted)."""
    singleton_groups: SingletonGroups = "zero"
    """What a prompt group of one response gets from the group estimators (grpo, rloo,
    reinforce_plus_plus_baseline, opo, gpg, grpo_passk, gdpo): 'zero' (no other response
    to compare with, so no signal) or 'score' (baseline 0: its raw score passes through,
    as VeRL does). A run's groups all hold rollout.responses_per_prompt >= 2 responses today; this
    decides what a group cut down to one would get."""
    dynamic_sampling: bool = False
    """DAPO's dynamic sampling (Yu et al. 2025, arXiv:2503.14476): train only on prompt
    groups whose scores differ, generating further rounds from the next prompts until
    trainer.prompts_per_step groups are kept; needs a group estimator (grpo, rloo, ...)."""
    dynamic_sampling_max_rounds: int = Field(4, ge=1)
    """Most generation rounds per step with dynamic_sampling; a step whose rounds run out
    trains on the whole actor mini-batches of groups it has (metric
    generate/dynamic_sampling/groups), and fails if that is none."""
    overlong_buffer_tokens: int = Field(0, ge=0)
    """DAPO's soft overlong punishment: over the last this many tokens before
    rollout.max_new_tokens, a response's score loses up to overlong_penalty_factor,
    linearly with its length; 0 = off."""
    overlong_penalty_factor: float = Field(1.0, ge=0, allow_inf_nan=False)
    """The punishment at rollout.max_new_tokens tokens."""
    rollout_is_cap: float | None = Field(None, gt=0)
    """Rollout correction: weight each token's policy-gradient term by the truncated
    importance weight min(π_old/π_rollout, this) between the trainer's log-probs and
    those the generating engine reported (vLLM and hf generation compute slightly
    different probabilities than the trainer's forward, and rollout.mode one_step_off
    generates with the previous weights); None = off (2.0 with one_step_off, which always
    corrects), 2.0 is usual. Costs the rollout's log-probs in GenerateSequences; metrics
    rollout_is/*."""
    filter_overlong: bool = False
    """DAPO's overlong filtering: responses cut off at rollout.max_new_tokens without EOS
    get zero advantage, so they add no policy-gradient signal (the actor trains on whole
    rows: their tokens still count in a token-mean and a KL loss)."""

    @model_validator(mode="after")
    def _grpo_std_has_its_own_switch(self) -> AlgorithmConfig:
        explicit = "whiten_advantages" in self.model_fields_set
        if self.adv_estimator == "grpo" and explicit and not self.whiten_advantages:
            raise ConfigError(
                "whiten_advantages",
                "false no longer changes 'grpo' (it whitens 'gae' advantages only); for GRPO "
                "without the std division (Dr. GRPO) set algorithm.norm_adv_by_std_in_grpo="
                "false and leave this out",
            )
        return self


# --- reward -----------------------------------------------------------------------------


class RewardConfig(RewardSettings):
    """How the reward service scores responses: its kinds with their weights, its limits
    and scaling (rlserve.core.reward_settings, the service's own settings)."""

    former_fields: ClassVar[Mapping[str, str]] = {
        "kind": "reward.kinds.<kind> (rule, model or http; several may be set, each weighted)",
        "rule_name": "reward.kinds.rule.rule_name",
        "rule_max_text_chars": "reward.kinds.rule.max_text_chars",
        "rule_time_budget_s": "reward.kinds.rule.time_budget_s",
        "model_path": "reward.kinds.model.model_path (reward.kinds.rule=null for the model alone)",
        "model_dtype": "reward.kinds.model.dtype",
        "model_micro_batch_samples": "reward.kinds.model.micro_batch_samples",
        "http": "reward.kinds.http (reward.kinds.rule=null for the API alone)",
        "autoscaling": "reward.autoscaling_config",
    }


# --- trainer ----------------------------------------------------------------------------


class TrainerConfig(ConfigModel):
    """The PPO loop that composes the services."""

    total_steps: int = Field(90, ge=1)
    """PPO steps to run."""
    prompts_per_step: int = Field(256, ge=1)
    """Prompts per PPO step (samples per step = prompts × rollout.responses_per_prompt)."""
    seed: int = 0
    """The run's one seed: the embedded task's train/held-out split, the tiny model's
    initialisation and warm-up, the order prompts are drawn in, and sampling."""
    checkpoint_every_steps: int = Field(20, ge=0)
    """Save a checkpoint every this many steps, and at the end; 0 = only at the end."""
    keep_checkpoints: int | None = Field(None, ge=1)
    """How many complete checkpoints a run keeps (the newest); None keeps every one."""
    run_dir: str = "runs/embedded_default"
    """Directory for the resolved config, metrics and checkpoints."""
    ray_address: str | None = None
    """Ray cluster to join (e.g. 'ray://head:10001' or 'auto'); None starts a local one."""
    rpc_timeout_s: float = Field(600.0, gt=0)
    """Deadline of each call to a service, in seconds."""
    rpc_retries: int = Field(2, ge=0)
    """Retries of a call that failed with a retryable status (0 = try once)."""
    lease_ttl_s: float = Field(60.0, gt=0, le=3600)
    """The run holds its rollout and critic services by a lease, renewed every third of
    this; another run is refused, naming this one, until the run releases it at its end
    or this long after the run stopped renewing (a killed trainer). `rlserve resume` of
    the same run directory takes it back at once."""
    call_routes: Literal["cluster", "proxy"] = "cluster"
    """How the trainer reaches the services. "cluster": on the Ray cluster, each call goes
    to its replica's own gRPC port (Serve's direct ingress) or, for large batches, through
    a DeploymentHandle, and through Serve's gRPC proxy otherwise; "proxy": every call
    through the proxy, the one port a firewall between trainer and replicas must open
    (what a trainer off the cluster does anyway)."""
    handle_route_min_bytes: int | None = Field(None, ge=0)
    """On the Ray cluster, a call whose batch holds this many bytes of tensors or more (the
    request's, or a generation's expected answer) goes to its service through a Serve
    DeploymentHandle (Ray's object store) instead of protobuf over gRPC; None = from where
    that was measured to be faster (2 MiB against a direct gRPC call, 64 KiB against the
    proxy; rlserve.core.rpc.HANDLE_ROUTE_MIN_BYTES); 0 = every batch."""
    max_recoveries: int = Field(3, ge=0)
    """Times a run may recover from a service that died or came back with fresh state
    (wait until every service answers, restore all of them and the trainer from the last
    checkpoint, replay the steps since); 0 = fail at the first such error. With recovery
    on, a checkpoint is also written before step 1, so there is always one to return to."""
    recovery_timeout_s: float = Field(300.0, gt=0)
    """Longest wait, per recovery, for every service to answer again."""
    resources_every_steps: int = Field(10, ge=0)
    """Record the object store's use and each service's resident memory (its replicas and
    their workers, measured from outside) as `resources/*` metrics (MiB) every this many
    steps; 0 = never. Costs a few milliseconds each time."""
    tracing: TracingConfig = Field(default_factory=TracingConfig)
    """Span export to an OTLP backend."""
    control_port: int | None = Field(0, ge=0, le=65535)
    """Port of the trainer's own gRPC control service (status, checkpoint now, stop);
    0 picks a free port (written to run_dir/control_address), None serves none."""
    deploy_timeout_s: float = Field(300.0, gt=0)
    """Longest wait for the services to be deployed and running, in seconds."""
    resource_shortfall_timeout_s: float | None = Field(15.0, gt=0)
    """Longest wait, while deploying, on a replica or worker that no node has the free
    resources for; then the run fails naming what is pending and what each node offers.
    None waits up to deploy_timeout_s (a cluster whose autoscaler adds nodes)."""
    replace_deployed_services: bool = False
    """On a cluster where a service is already deployed with other settings than this run
    asks for, replace it with this run's (true) or stop before deploying and list the
    differences (false)."""
    serve_grpc_port: int = Field(0, ge=0, le=65535)
    """Port of Serve's gRPC proxy, where the services answer; 0 picks a free port (local
    cluster only: with ray_address set, give the port the cluster's Serve uses)."""
    service_auth: Literal["token", "none"] = "token"
    """The `auth` of every service the run deploys: "token" (each call carries the
    cluster's token; a service without one refuses to start, and so does a run on
    ray_address whose trainer has none) or "none" (services without a token answer
    anyone who reaches their port: for a cluster nobody else can reach)."""

    @model_validator(mode="after")
    def _remote_cluster_names_its_port(self) -> TrainerConfig:
        if self.ray_address is not None and self.serve_grpc_port == 0:
            raise ConfigError(
                "serve_grpc_port",
                "must be set when ray_address is set (the port of that cluster's Serve gRPC "
                "proxy, e.g. 9000)",
            )
        return self


# --- the run ----------------------------------------------------------------------------


class RunConfig(ConfigModel):
    """One PPO / GRPO run: model, data, the four services' settings and the loop."""

    model: ModelConfig = Field(default_factory=ModelConfig)
    """Policy (and reference) model."""
    data: DataConfig = Field(default_factory=DataConfig)
    """Training and evaluation prompts."""
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    """Generation."""
    actor: ActorConfig = Field(default_factory=ActorConfig)
    """Policy training."""
    critic: CriticConfig = Field(default_factory=CriticConfig)
    """Value-model training; ignored unless algorithm.adv_estimator is 'gae'."""
    reference: ReferenceConfig = Field(default_factory=ReferenceConfig)
    """The frozen reference policy; ignored when the run uses no KL."""
    algorithm: AlgorithmConfig = Field(default_factory=AlgorithmConfig)
    """Advantages and KL."""
    reward: RewardConfig = Field(default_factory=RewardConfig)
    """Scoring."""
    trainer: TrainerConfig = Field(default_factory=TrainerConfig)
    """The loop itself."""
    placement: PlacementConfig = Field(default_factory=PlacementConfig)
    """Resource pools and which service runs in which; empty = Ray picks the nodes."""

    @property
    def samples_per_step(self) -> int:
        """Samples (prompt + one response) generated and trained on per PPO step."""
        return self.trainer.prompts_per_step * self.rollout.responses_per_prompt

    @property
    def actor_mini_batch_samples(self) -> int:
        """Samples per actor optimizer step, across all actor workers."""
        return self.actor.ppo_mini_batch_prompts * self.rollout.responses_per_prompt

    @property
    def critic_mini_batch_samples(self) -> int:
        """Samples per critic optimizer step, across all critic workers."""
        return self.critic.ppo_mini_batch_prompts * self.rollout.responses_per_prompt

    @property
    def needs_critic(self) -> bool:
        """Whether the run uses the critic service (GAE advantages)."""
        return estimator_needs_critic(self.algorithm.adv_estimator)

    @property
    def rollout_is_cap(self) -> float | None:
        """The rollout correction's cap in effect: algorithm.rollout_is_cap, else
        ONE_STEP_OFF_IS_CAP when rollout.mode is one_step_off; None = no correction."""
        cap = self.algorithm.rollout_is_cap
        if cap is None and self.rollout.mode == "one_step_off":
            return ONE_STEP_OFF_IS_CAP
        return cap

    @property
    def needs_reference(self) -> bool:
        """Whether the run uses reference log-probs (a KL penalty or KL loss is on)."""
        return self.algorithm.kl_ctrl.kl_coef > 0 or self.actor.use_kl_loss

    @property
    def generation_engine(self) -> Literal["hf", "vllm"]:
        """The rollout engine the run deploys: rollout.engine, with 'auto' resolved."""
        if self.rollout.engine != "auto":
            return self.rollout.engine
        if importlib.util.find_spec("vllm") is None:
            return "hf"
        large = model_weight_bytes(self.model.path) >= LARGE_MODEL_WEIGHT_BYTES
        return "vllm" if large else "hf"

    @property
    def reference_merged(self) -> bool:
        """Whether the rollout service answers ComputeRefLogProb (placement.
        reference_in_rollout, or by default a LoRA actor's own base)."""
        merged = self.placement.reference_in_rollout
        if merged is None:
            return self.actor.lora_rank > 0 and "reference" not in self.placement.roles
        return merged

    @property
    def single_pass_update(self) -> bool:
        """Whether a step's actor update is one optimizer step on-policy, so that its own
        first forward (detached) is the behaviour policy and no ComputeLogProb pass is
        needed: actor.reuse_update_forward, rollout.mode sync, one actor epoch over one
        mini-batch of the whole step, no rollout correction, no KL penalty in the reward
        (it reads old log-probs before the update) and an estimator that reads neither
        old log-probs nor Σπ²."""
        needs = estimator_needs(self.algorithm.adv_estimator)
        return (
            self.actor.reuse_update_forward
            and self.rollout.mode == "sync"
            and self.actor.ppo_epochs == 1
            and self.actor.ppo_mini_batch_prompts == self.trainer.prompts_per_step
            and self.rollout_is_cap is None
            and (self.actor.use_kl_loss or self.algorithm.kl_ctrl.kl_coef == 0)
            and not {"old_log_probs", "sum_pi_squared"} & set(needs)
        )

    @model_validator(mode="after")
    def _unset_sizes_follow_the_set_ones(self) -> RunConfig:
        """A user who sets the step's size is not made to set three: an unset mini-batch
        or micro-batch is the largest divisor of what it tiles (the step's prompts, a
        worker's share of the mini-batch) up to its default, 64; the defaults themselves
        are kept where they fit. Runs before the checks below. The sections are frozen
        and may be shared with the caller, so a section that changes is replaced by a
        copy (written in place on this new, not yet returned config, once, here)."""
        roles = ["actor", "critic"] if self.needs_critic else ["actor"]
        n = self.rollout.responses_per_prompt
        for role in roles:
            section = getattr(self, role)
            sizes = {}
            if "ppo_mini_batch_prompts" not in section.model_fields_set:
                sizes["ppo_mini_batch_prompts"] = _largest_divisor_up_to(
                    self.trainer.prompts_per_step, _default(section, "ppo_mini_batch_prompts")
                )
            mini_samples = sizes.get("ppo_mini_batch_prompts", section.ppo_mini_batch_prompts) * n
            if "micro_batch_samples" not in section.model_fields_set and (
                mini_samples % section.workers == 0
            ):
                sizes["micro_batch_samples"] = _largest_divisor_up_to(
                    mini_samples // section.workers, _default(section, "micro_batch_samples")
                )
            if sizes:
                object.__setattr__(self, role, section.model_copy(update=sizes))
        return self

    @model_validator(mode="after")
    def _sections_agree(self) -> RunConfig:
        issues = self._batch_issues("actor", self.actor)
        if self.needs_critic:
            issues += self._batch_issues("critic", self.critic)
        n = self.rollout.responses_per_prompt
        estimator = self.algorithm.adv_estimator
        if estimator in GROUP_ESTIMATORS:
            if n < 2:
                issues.append(
                    (
                        "rollout.responses_per_prompt",
                        f"must be >= 2 for algorithm.adv_estimator {estimator!r} (its baseline "
                        f"is the other responses to the same prompt); got {n}",
                    )
                )
            elif self.rollout.temperature == 0:
                issues.append(
                    (
                        "rollout.temperature",
                        f"is 0 (greedy), so the {n} responses to a prompt are identical and "
                        f"{estimator!r} advantages are all zero; use a temperature > 0",
                    )
                )
        issues += self._dapo_issues()
        issues += self._catalogue_issues()
        issues += self._request_size_issues()
        issues += self._request_token_issues()
        issues += self._vllm_context_issues()
        issues += self._vllm_memory_issues()
        issues += self._gpu_sharing_issues()
        if issues:
            raise ConfigError(issues)
        return self

    def _gpu_sharing_issues(self) -> list[tuple[str, str]]:
        """A training service's ranks form one NCCL group, which refuses two ranks on one
        GPU; bundles of part of a GPU may put two there."""
        sections = {"rollout": ("actor", self.actor)}
        if self.needs_critic:
            sections["critic"] = ("critic", self.critic)
        issues = []
        for role, (name, section) in sections.items():
            placed = self.placement.roles.get(role)
            if placed is None or section.workers < 2 or not shares_a_gpu(placed.worker_resources):
                continue
            issues.append(
                (
                    f"{name}.workers",
                    f"{section.workers} ranks of one NCCL group on bundles of "
                    f"placement.roles.{role}.worker_resources.GPU "
                    f"{placed.worker_resources['GPU']:g} may land on one GPU, which NCCL "
                    f"refuses; give each {name} worker a whole GPU (GPU: 1) or set "
                    f"{name}.workers: 1",
                )
            )
        return issues

    def _catalogue_issues(self) -> list[tuple[str, str]]:
        algorithm, issues = self.algorithm, []
        if self.rollout_is_cap is not None and self.actor.policy_loss in (
            "clip_cov",
            "kl_cov",
        ):
            # the weights scale the advantages, which these losses also use to pick tokens
            if algorithm.rollout_is_cap is None:
                field, fix = "rollout.mode", "use rollout.mode sync (one_step_off always corrects)"
            else:
                field, fix = "algorithm.rollout_is_cap", "set it to null"
            issues.append(
                (
                    field,
                    f"needs the rollout correction, which is not supported with "
                    f"actor.policy_loss {self.actor.policy_loss!r} (its token selection reads "
                    f"the advantages the correction scales); {fix} or choose another loss",
                )
            )
        greedy_baseline = "baseline_scores" in estimator_needs(algorithm.adv_estimator)
        if greedy_baseline and self.rollout.temperature == 0:
            issues.append(
                (
                    "rollout.temperature",
                    f"is 0 (greedy), so every sample equals the greedy baseline of "
                    f"{algorithm.adv_estimator!r} and all advantages are zero; use a "
                    "temperature > 0",
                )
            )
        return issues

    def _dapo_issues(self) -> list[tuple[str, str]]:
        algorithm, issues = self.algorithm, []
        if algorithm.dynamic_sampling and algorithm.adv_estimator not in GROUP_ESTIMATORS:
            issues.append(
                (
                    "algorithm.dynamic_sampling",
                    f"keeps prompt groups whose scores differ, which matters to the group "
                    f"estimators {sorted(GROUP_ESTIMATORS)}, not to "
                    f"{algorithm.adv_estimator!r}; choose one of them or turn it off",
                )
            )
        if algorithm.overlong_buffer_tokens > self.rollout.max_new_tokens:
            issues.append(
                (
                    "algorithm.overlong_buffer_tokens",
                    f"{algorithm.overlong_buffer_tokens} is more than rollout.max_new_tokens "
                    f"({self.rollout.max_new_tokens}), the length the buffer ends at",
                )
            )
        return issues

    def _vllm_context_issues(self) -> list[tuple[str, str]]:
        """vLLM's max_model_len must hold the longest prompt plus its response."""
        limit = self.rollout.vllm.max_model_len
        need = self.data.max_prompt_tokens + self.rollout.max_new_tokens
        if self.generation_engine != "vllm" or limit is None or limit >= need:
            return []
        return [
            (
                "rollout.vllm.max_model_len",
                f"{limit} is below data.max_prompt_tokens {self.data.max_prompt_tokens} + "
                f"rollout.max_new_tokens {self.rollout.max_new_tokens}; raise it to at least "
                f"{need}, or null for the model's own context",
            )
        ]

    def _vllm_memory_issues(self) -> list[tuple[str, str]]:
        """vLLM starts only when gpu_memory_utilization × the GPU's memory is free (even
        with kv_cache_gib set), and it is built after the actor's training copy, in the
        same process: its fraction must stay below the rollout worker's share of the
        GPU, with room for that copy. The share is placement.roles.rollout's GPU, else
        taken as a whole GPU (a share that WorkerGroup packs on a cluster with fewer
        GPUs than workers is known only once the cluster is)."""
        placed = self.placement.roles.get("rollout")
        share = 1.0 if placed is None else placed.worker_resources.get("GPU", 0.0)
        utilization = self.rollout.vllm.gpu_memory_utilization
        if (
            self.generation_engine != "vllm"
            or self.actor.device == "cpu"
            or share == 0  # no GPU reserved: vLLM runs on the CPU
            or utilization < share
        ):
            return []
        source = (
            "a whole GPU: no placement.roles.rollout"
            if placed is None
            else "placement.roles.rollout.worker_resources.GPU"
        )
        return [
            (
                "rollout.vllm.gpu_memory_utilization",
                f"{utilization:g} leaves no room on each rollout worker's share of its GPU "
                f"({share:g}, {source}) for the actor's training copy, which shares the "
                f"worker's process and is on the GPU before vLLM starts, and vLLM refuses "
                f"to start unless {utilization:g} of the GPU is free; set it below "
                f"{share:g} with room for the training copy (e.g. {share / 2:g}), or give "
                f"the rollout workers more of the GPU",
            )
        ]

    def _request_size_issues(self) -> list[tuple[str, str]]:
        """Each service must accept a whole step's samples in one request."""
        limits = {"rollout.max_batch_samples": self.rollout.max_batch_samples}
        limits["reward.max_batch_samples"] = self.reward.max_batch_samples
        if self.needs_critic:
            limits["critic.max_batch_samples"] = self.critic.max_batch_samples
        if self.needs_reference and not self.reference_merged:
            limits["reference.max_batch_samples"] = self.reference.max_batch_samples
        samples = self.samples_per_step
        return [
            (
                field,
                f"{limit} is below the {samples} samples of a step (trainer.prompts_per_step × "
                f"rollout.responses_per_prompt); raise it to at least {samples}",
            )
            for field, limit in limits.items()
            if limit < samples
        ]

    def _request_token_issues(self) -> list[tuple[str, str]]:
        """Each service's max_request_tokens must hold the run's largest request to it:
        a step's samples (and, for the rollout, an evaluation's prompts) × the longest
        sequence, data.max_prompt_tokens + rollout.max_new_tokens."""
        sequence = self.data.max_prompt_tokens + self.rollout.max_new_tokens
        step = self.samples_per_step
        evaluates = self.data.eval_path is not None or self.data.train_path is None
        rollout_rows = max(step, self.rollout.eval_prompts if evaluates else 0)
        needs = {"rollout.max_request_tokens": (self.rollout.max_request_tokens, rollout_rows)}
        if self.needs_critic:
            needs["critic.max_request_tokens"] = (self.critic.max_request_tokens, step)
        if self.needs_reference and not self.reference_merged:
            needs["reference.max_request_tokens"] = (self.reference.max_request_tokens, step)
        issues = []
        for field, (limit, rows) in needs.items():
            if limit < rows * sequence:
                what = (
                    "rollout.eval_prompts (evaluation)"
                    if rows > step
                    else "trainer.prompts_per_step × rollout.responses_per_prompt"
                )
                issues.append(
                    (
                        field,
                        f"{limit:,} is below the {rows * sequence:,} token positions of the "
                        f"run's requests ({rows} rows from {what} × (data.max_prompt_tokens "
                        f"{self.data.max_prompt_tokens} + rollout.max_new_tokens "
                        f"{self.rollout.max_new_tokens})); raise it to at least "
                        f"{rows * sequence}, where the workers have the memory",
                    )
                )
        return issues

    def _batch_issues(
        self, role: str, section: ActorConfig | CriticConfig
    ) -> list[tuple[str, str]]:
        """Mini-batches must tile the step, and split evenly over workers and micro-batches."""
        issues: list[tuple[str, str]] = []
        prompts = self.trainer.prompts_per_step
        mini = section.ppo_mini_batch_prompts
        if prompts % mini:
            issues.append(
                (
                    f"{role}.ppo_mini_batch_prompts",
                    f"must divide trainer.prompts_per_step ({prompts}); got {mini}"
                    + _nearest_divisors_hint(prompts, mini),
                )
            )
            return issues
        n = self.rollout.responses_per_prompt
        mini_samples = mini * n
        if mini_samples % section.workers:
            issues.append(
                (
                    f"{role}.workers",
                    f"must divide the mini-batch of {mini_samples} samples "
                    f"({role}.ppo_mini_batch_prompts {mini} × rollout.responses_per_prompt {n}) "
                    f"so each worker gets an equal share; got {section.workers}",
                )
            )
            return issues
        share = mini_samples // section.workers
        if share % section.micro_batch_samples:
            issues.append(
                (
                    f"{role}.micro_batch_samples",
                    f"must divide each worker's share of a mini-batch, {share} samples "
                    f"({role}.ppo_mini_batch_prompts {mini} × rollout.responses_per_prompt {n} "
                    f"/ {role}.workers {section.workers}); got {section.micro_batch_samples}"
                    + _nearest_divisors_hint(share, section.micro_batch_samples),
                )
            )
        return issues


def _largest_divisor_up_to(total: int, cap: int) -> int:
    return max(d for d in range(1, min(cap, total) + 1) if total % d == 0)


def _default(section: ConfigModel, name: str) -> int:
    return type(section).model_fields[name].default


def _nearest_divisors_hint(total: int, got: int) -> str:
    """' — e.g. 64 or 128' naming the divisors of total nearest to got."""
    divisors = [d for d in range(1, total + 1) if total % d == 0]
    below = [d for d in divisors if d < got]
    above = [d for d in divisors if d > got]
    picks = ([below[-1]] if below else []) + ([above[0]] if above else [])
    return " — e.g. " + " or ".join(str(d) for d in picks) if picks else ""
