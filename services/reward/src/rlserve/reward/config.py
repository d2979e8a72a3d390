"""The reward service's one typed config: reward kinds, scaling and placement.

Any combination of three kinds, each with a weight; the service's score is the weighted
sum (`scores = Σ weight_k · scores_k`):

    kinds:
      rule: {rule_name: gsm8k, weight: 1.0}
      model: {model_path: /models/rm, weight: 0.5}
      http: {url: "http://verifier:8000/score", timeout_s: 3.0, on_failure: fallback}
    autoscaling_config: {min_replicas: 1, max_replicas: 8, target_ongoing_requests: 2}
    placement: {resources: {cpu_pool: 0.001}}

Replicas never take a GPU (`num_gpus` is always 0); `placement` pins them to cheap CPU
nodes by a custom resource or a Ray node-label selector. `build_app` validates this
before deploying, so every mistake is a ConfigError naming the field.

HTTP API contract (kind `http`), one POST per sample:
    request  body: a JSON object with that sample's non-tensor columns, e.g.
             {"response_text": "...", "ground_truth": "...", "prompt_text": "..."}
             (every column the caller sent, JSON scalars), Content-Type application/json,
             plus the configured `headers`.
    response 2xx with a JSON object {"score": <finite number>}.
    Retried (up to `retries`, exponential backoff with jitter, honouring Retry-After):
    timeouts, connection errors, 5xx, 408 and 429. Any other status, or a body without a
    finite "score", is a permanent failure of that sample.
"""

import math
from typing import Literal

from pydantic import Field, model_validator

from rlserve.core.config import SECRET, ConfigError, ConfigModel
from rlserve.core.run_config import AutoscalingConfig, TracingConfig
from rlserve.reward.rules import resolve_rule

KIND_NAMES = ("rule", "model", "http")
# Resources Ray schedules by their own options; a custom resource must not shadow them.
_BUILTIN_RESOURCES = ("CPU", "GPU", "memory", "object_store_memory")


class RuleKindConfig(ConfigModel):
    """A rule function scores each (response, ground truth) pair on the replica's CPU."""

    rule_name: str
    """Registered rule ('arithmetic_exact_match', 'gsm8k') or your own
    'package.module:function' taking (response_text, ground_truth, **extra) -> float."""
    weight: float = Field(1.0, allow_inf_nan=False)
    """Weight of this kind's score in the combined score (may be 0 or negative)."""
    max_text_chars: int = Field(65_536, ge=1)
    """Longest response_text and ground_truth, in characters, a rule reads (default
    65,536: about 16k tokens of English); a longer one is INVALID_ARGUMENT naming the
    row, before any scoring. With the shipped rules' linear-time patterns this bounds
    the time one row can take."""
    time_budget_s: float = Field(30.0, gt=0, allow_inf_nan=False)
    """Most seconds one ComputeReward call may spend in the rule (default 30); past it
    the call is RESOURCE_EXHAUSTED naming this field. Checked between rows, so one row's
    rule call is not interrupted: keep user rules linear in their text."""

    @model_validator(mode="after")
    def _rule_exists(self) -> "RuleKindConfig":
        try:
            resolve_rule(self.rule_name)
        except ConfigError as error:
            raise ConfigError([("rule_name", message) for _, message in error.issues]) from None
        return self


class ModelKindConfig(ConfigModel):
    """A reward model (AutoModelForSequenceClassification, num_labels=1) scores token ids."""

    model_path: str = Field(min_length=1)
    """Local HF model directory, readable on every node the replicas may run on."""
    weight: float = Field(1.0, allow_inf_nan=False)
    """Weight of this kind's score in the combined score (may be 0 or negative)."""
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """Parameter dtype the reward model is loaded in."""
    micro_batch_samples: int = Field(16, ge=1)
    """Samples per forward pass; bounds the replica's activation memory."""


class HttpKindConfig(ConfigModel):
    """An external scoring API, called once per sample over a pooled client session."""

    url: str
    """Endpoint receiving one POST per sample (format in this module's docstring)."""
    weight: float = Field(1.0, allow_inf_nan=False)
    """Weight of this kind's score in the combined score (may be 0 or negative)."""
    headers: dict[str, str] = Field(default_factory=dict, json_schema_extra=SECRET)
    """Extra request headers, e.g. {"Authorization": "Bearer ..."}."""
    timeout_s: float = Field(3.0, gt=0, allow_inf_nan=False)
    """Per-request timeout in seconds (connect + response), for every attempt."""
    max_concurrency: int = Field(32, ge=1)
    """Requests in flight at once per replica, shared by all its concurrent calls."""
    retries: int = Field(2, ge=0)
    """Retries after a retryable failure (0 = try once)."""
    backoff_initial_s: float = Field(0.1, ge=0, allow_inf_nan=False)
    """Wait before the first retry; doubles each retry (times a jitter in [0.5, 1])."""
    backoff_max_s: float = Field(2.0, ge=0, allow_inf_nan=False)
    """Longest wait between two attempts."""
    on_failure: Literal["raise", "fallback"] = "raise"
    """When a sample still fails: fail the call ('raise': UNAVAILABLE, DEADLINE_EXCEEDED
    or FAILED_PRECONDITION naming the row) or score it fallback_score ('fallback',
    counted in the http_failures metric)."""
    fallback_score: float = Field(0.0, allow_inf_nan=False)
    """Score of a failed sample when on_failure is 'fallback'."""
    deadline_reserve_s: float = Field(0.1, ge=0, allow_inf_nan=False)
    """HTTP work stops this long before the caller's deadline, so a 'fallback' answer
    still reaches the caller in time."""

    @model_validator(mode="after")
    def _check(self) -> "HttpKindConfig":
        if not self.url.startswith(("http://", "https://")):
            raise ConfigError("url", f"must start with http:// or https://; got {self.url!r}")
        if self.backoff_max_s < self.backoff_initial_s:
            raise ConfigError(
                "backoff_max_s",
                f"must be >= backoff_initial_s ({self.backoff_initial_s}); "
                f"got {self.backoff_max_s}",
            )
        return self


class RewardKindsConfig(ConfigModel):
    """The reward kinds this service combines; set at least one."""

    rule: RuleKindConfig | None = None
    """Rule function kind; None = not used."""
    model: ModelKindConfig | None = None
    """Reward-model kind; None = not used."""
    http: HttpKindConfig | None = None
    """External HTTP API kind; None = not used."""

    @model_validator(mode="after")
    def _at_least_one(self) -> "RewardKindsConfig":
        if all(getattr(self, name) is None for name in KIND_NAMES):
            raise ConfigError(
                "", "no reward kind configured; set at least one of rule, model, http"
            )
        return self

    def weights(self) -> dict[str, float]:
        """Weight of each configured kind, by kind name."""
        return {
            name: kind.weight for name in KIND_NAMES if (kind := getattr(self, name)) is not None
        }


class PlacementConfig(ConfigModel):
    """Which Ray nodes replicas may run on (e.g. a pool of cheap CPU nodes)."""

    resources: dict[str, float] = Field(default_factory=dict)
    """Custom Ray resources each replica needs, name -> amount, e.g. {"cpu_pool": 0.001}:
    start the cheap nodes with `ray start --resources='{"cpu_pool": 1000}'`."""
    label_selector: dict[str, str] = Field(default_factory=dict)
    """Ray node-label selector, e.g. {"node-pool": "cpu"} (nodes started with
    `ray start --labels='{"node-pool": "cpu"}'`); values may use Ray's operators (!, in())."""

    @model_validator(mode="after")
    def _check(self) -> "PlacementConfig":
        issues = []
        for name, amount in self.resources.items():
            if name in _BUILTIN_RESOURCES:
                issues.append(
                    (f"resources.{name}", "built-in resource; set num_cpus_per_replica instead")
                )
            elif not math.isfinite(amount) or amount <= 0:
                issues.append((f"resources.{name}", f"amount must be > 0 and finite; got {amount}"))
        if self.label_selector:
            # Ray's own check (the one Serve applies later), so a bad selector fails here.
            from ray._private.label_utils import validate_label_selector

            problem = validate_label_selector(self.label_selector)
            if problem:
                issues.append(("label_selector", problem))
        if issues:
            raise ConfigError(issues)
        return self


class RewardServiceConfig(ConfigModel):
    """The reward service: kinds with weights, batch limit, replicas and placement."""

    kinds: RewardKindsConfig
    """Reward kinds and their weights."""
    max_batch_samples: int = Field(4096, ge=1)
    """Most samples one ComputeReward call may carry (more is RESOURCE_EXHAUSTED)."""
    num_replicas: int | None = Field(None, ge=1)
    """Fixed replica count; None = 1, or autoscaling when autoscaling_config is set."""
    autoscaling_config: AutoscalingConfig | None = None
    """Serve autoscaling; excludes num_replicas."""
    max_ongoing_requests: int = Field(64, ge=1)
    """Calls one replica takes at once (its HTTP concurrency bound is shared by them).
    Keep it above the callers' concurrency: when every replica holds this many, Serve's
    router backs off before retrying and throughput collapses (bench_reward_load.py: at
    8, 32 clients got 56 calls/s with p99 2.4 s; at 64, 378 calls/s, p99 0.14 s)."""
    num_cpus_per_replica: float = Field(1.0, gt=0, allow_inf_nan=False)
    """Logical CPUs Ray reserves per replica; replicas take no GPU."""
    torch_threads: int = Field(1, ge=1)
    """torch intra-op threads per replica (reward-model forward passes)."""
    placement: PlacementConfig = Field(default_factory=PlacementConfig)
    """Node placement of the replicas."""
    tracing: TracingConfig = Field(default_factory=TracingConfig)
    """OpenTelemetry span export of this service (and its workers); off by default. The
    trainer passes its own `trainer.tracing` here when it deploys the service."""

    @model_validator(mode="after")
    def _one_scaling_mode(self) -> "RewardServiceConfig":
        if self.num_replicas is not None and self.autoscaling_config is not None:
            raise ConfigError(
                "num_replicas", "set either num_replicas or autoscaling_config, not both"
            )
        return self
