"""The reward service's one typed config: reward kinds, scaling and placement.

Its kinds, limits and scaling are rlserve.core.reward_settings.RewardSettings, the same
model as a run's `reward` section; the service adds where replicas run and tracing. Any
combination of three kinds, each with a weight; the service's score is the weighted sum
(`scores = Σ weight_k · scores_k`):

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

from pydantic import Field, model_validator

from rlserve.core.auth import ServiceAuth
from rlserve.core.config import ConfigError, ConfigModel
from rlserve.core.reward_settings import RewardKindsConfig, RewardSettings
from rlserve.core.tracing_config import TracingConfig
from rlserve.reward.rules import resolve_rule

# Resources Ray schedules by their own options; a custom resource must not shadow them.
_BUILTIN_RESOURCES = ("CPU", "GPU", "memory", "object_store_memory")


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


class RewardServiceConfig(RewardSettings, ServiceAuth):
    """The reward service: kinds with weights, batch limit, replicas and placement."""

    kinds: RewardKindsConfig
    """Reward kinds and their weights (required here; a run's default is its rule)."""
    num_cpus_per_replica: float = Field(1.0, gt=0, allow_inf_nan=False)
    """Logical CPUs Ray reserves per replica; replicas take no GPU."""
    placement: PlacementConfig = Field(default_factory=PlacementConfig)
    """Node placement of the replicas."""
    tracing: TracingConfig = Field(default_factory=TracingConfig)
    """OpenTelemetry span export of this service (and its workers); off by default. The
    trainer passes its own `trainer.tracing` here when it deploys the service."""

    @model_validator(mode="after")
    def _rule_exists(self) -> "RewardServiceConfig":
        if self.kinds.rule is not None:
            try:
                resolve_rule(self.kinds.rule.rule_name)
            except ConfigError as error:
                raise ConfigError(
                    [("kinds.rule.rule_name", message) for _, message in error.issues]
                ) from None
        return self
