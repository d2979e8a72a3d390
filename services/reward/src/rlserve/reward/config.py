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

from pydantic import Field, model_validator

from rlserve.core.auth import ServiceAuth
from rlserve.core.config import ConfigError
from rlserve.core.replica_pool import ReplicaPlacementConfig
from rlserve.core.reward_settings import RewardKindsConfig, RewardSettings
from rlserve.core.tracing_config import TracingConfig
from rlserve.reward.rules import resolve_rule


class RewardServiceConfig(RewardSettings, ServiceAuth):
    """The reward service: kinds with weights, batch limit, replicas and placement."""

    kinds: RewardKindsConfig
    """Reward kinds and their weights (required here; a run's default is its rule)."""
    num_cpus_per_replica: float = Field(1.0, gt=0, allow_inf_nan=False)
    """Logical CPUs Ray reserves per replica; replicas take no GPU."""
    placement: ReplicaPlacementConfig = Field(default_factory=ReplicaPlacementConfig)
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
