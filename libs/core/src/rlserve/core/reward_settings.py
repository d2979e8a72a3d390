"""What a reward service scores with and how it scales: the settings a run's `reward`
section and a deployed reward service share.

Any combination of three kinds, each with a weight; the service's score is the weighted
sum (`scores = Σ weight_k · scores_k`), and `scores_<kind>` ride along for estimators
that weigh kinds themselves (GDPO):

    kinds:
      rule: {rule_name: gsm8k, weight: 1.0}
      model: {model_path: /models/rm, weight: 0.5}
      http: {url: "http://verifier:8000/score", timeout_s: 3.0, on_failure: fallback}

`RewardSettings` is both the run config's `reward` section (rlserve.core.run_config
.RewardConfig) and the base of the service's config (rlserve.reward.config
.RewardServiceConfig), so a field added here is settable from a run with no other edit.
The HTTP kind's wire contract is in rlserve.reward.config's docstring.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Literal

from pydantic import Field, model_validator

from rlserve.core.config import SECRET, ConfigError, ConfigModel
from rlserve.core.inputs_config import Dtype

KIND_NAMES = ("rule", "model", "http")
DEFAULT_RULE = "arithmetic_exact_match"
"""The embedded task's rule: the default kind of a run that names none."""


class RuleKindConfig(ConfigModel):
    """A rule function scores each (response, ground truth) pair on the replica's CPU (the
    reward service checks that `rule_name` resolves: rlserve.reward.rules)."""

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


class ModelKindConfig(ConfigModel):
    """A reward model (AutoModelForSequenceClassification, num_labels=1) scores token ids."""

    model_path: str = Field(min_length=1)
    """Local HF model directory, readable on every node the replicas may run on."""
    weight: float = Field(1.0, allow_inf_nan=False)
    """Weight of this kind's score in the combined score (may be 0 or negative)."""
    dtype: Dtype = "auto"
    """Parameter dtype the reward model is loaded in; it runs on the replica's CPU, where
    'auto' is float32."""
    micro_batch_samples: int = Field(16, ge=1)
    """Samples per forward pass; bounds the replica's activation memory."""


class HttpKindConfig(ConfigModel):
    """An external scoring API, called once per sample over a pooled client session."""

    url: str
    """Endpoint receiving one POST per sample (format in this module's docstring)."""
    weight: float = Field(1.0, allow_inf_nan=False)
    """Weight of this kind's score in the combined score (may be 0 or negative)."""
    headers: dict[str, str] = Field(default_factory=dict, json_schema_extra=SECRET)
    """Extra request headers, e.g. {"Authorization": "env:VERIFIER_AUTH"}. A value
    "env:NAME" is read from the replica's environment variable NAME, "file:/path" from
    that file (surrounding whitespace dropped), when the replica starts, so the secret is
    in neither the run's config.yaml nor Serve's app args; any other value is sent as
    written. Printed configs show headers as <redacted>."""
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
    redirects: Literal["refuse", "same_origin"] = "refuse"
    """A 3xx answer: 'refuse' fails the sample (rejected, naming the status and the
    Location); 'same_origin' follows up to 5 redirects to the url's own scheme, host and
    port, re-sending the POST. A redirect elsewhere is always refused: it would carry
    the headers and every sample's ground truth to another host."""
    max_response_bytes: int = Field(65536, ge=64)
    """Largest response body read; a longer one fails the sample (rejected) after this
    many bytes, so a hostile or broken API cannot fill the replica's memory."""

    @model_validator(mode="after")
    def _check(self) -> HttpKindConfig:
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
    def _at_least_one(self) -> RewardKindsConfig:
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


class AutoscalingConfig(ConfigModel):
    """Serve autoscaling: replicas follow the number of requests in flight."""

    min_replicas: int = Field(1, ge=0)
    """Fewest replicas (0 lets the service scale to zero when idle)."""
    max_replicas: int = Field(4, ge=1)
    """Most replicas."""
    initial_replicas: int | None = Field(None, ge=0)
    """Replicas at deployment; None = min_replicas."""
    target_ongoing_requests: float = Field(2.0, gt=0, allow_inf_nan=False)
    """Requests in flight per replica the autoscaler aims for."""
    upscale_delay_s: float = Field(30.0, ge=0, allow_inf_nan=False)
    """How long demand must stay high before replicas are added."""
    downscale_delay_s: float = Field(600.0, ge=0, allow_inf_nan=False)
    """How long demand must stay low before replicas are removed."""

    @model_validator(mode="after")
    def _ordered(self) -> AutoscalingConfig:
        if self.max_replicas < self.min_replicas:
            raise ConfigError(
                "max_replicas",
                f"must be >= min_replicas ({self.min_replicas}); got {self.max_replicas}",
            )
        if self.initial_replicas is not None and not (
            self.min_replicas <= self.initial_replicas <= self.max_replicas
        ):
            raise ConfigError(
                "initial_replicas",
                f"must lie in min_replicas..max_replicas ({self.min_replicas}..{self.max_replicas})"
                f"; got {self.initial_replicas}",
            )
        return self


class RewardSettings(ConfigModel):
    """The reward kinds and the service's limits and scaling."""

    kinds: RewardKindsConfig = Field(
        default_factory=lambda: RewardKindsConfig(rule=RuleKindConfig(rule_name=DEFAULT_RULE))
    )
    """Reward kinds and their weights; a config that sets none scores with the rule
    arithmetic_exact_match (weight 1). The embedded configs list that rule, so a kind set
    on their command line joins it; `reward.kinds.rule=null` drops it."""
    max_batch_samples: int = Field(4096, ge=1)
    """Most samples one ComputeReward call may carry (more is RESOURCE_EXHAUSTED); a run
    checks that it holds a whole step's samples."""
    num_replicas: int | None = Field(None, ge=1)
    """Fixed replica count; None = 1, or autoscaling when autoscaling_config is set."""
    autoscaling_config: AutoscalingConfig | None = None
    """Serve autoscaling of the replicas (min/max replicas, target requests in flight per
    replica); excludes num_replicas."""
    max_ongoing_requests: int = Field(64, ge=1)
    """Calls one replica takes at once (its HTTP concurrency bound is shared by them).
    Keep it above the callers' concurrency: when every replica holds this many, Serve's
    router backs off before retrying and throughput collapses (bench_reward_load.py: at
    8, 32 clients got 56 calls/s with p99 2.4 s; at 64, 378 calls/s, p99 0.14 s)."""
    torch_threads: int = Field(1, ge=1)
    """torch intra-op threads per replica (reward-model forward passes)."""

    @model_validator(mode="after")
    def _one_scaling_mode(self) -> RewardSettings:
        if self.num_replicas is not None and self.autoscaling_config is not None:
            raise ConfigError(
                "num_replicas", "set either num_replicas or autoscaling_config, not both"
            )
        return self


HEADER_ENV_PREFIX = "env:"
HEADER_FILE_PREFIX = "file:"


def resolve_header_values(headers: Mapping[str, str]) -> dict[str, str]:
    """The headers to send: each "env:NAME" / "file:/path" value replaced by what it
    refers to (HttpKindConfig.headers).

    Raises:
        ConfigError: a reference to an unset variable or an unreadable file, naming the
            header (never its value) and the fix.
    """
    resolved = {}
    for name, value in headers.items():
        field = f"kinds.http.headers.{name}"
        if value.startswith(HEADER_ENV_PREFIX):
            variable = value[len(HEADER_ENV_PREFIX) :]
            if variable not in os.environ:
                raise ConfigError(
                    field, f"refers to environment variable {variable!r}, which the reward "
                    "replica's environment does not set: set it on every reward node")  # fmt: skip
            resolved[name] = os.environ[variable]
        elif value.startswith(HEADER_FILE_PREFIX):
            path = Path(value[len(HEADER_FILE_PREFIX) :])
            try:
                resolved[name] = path.read_text(encoding="utf-8").strip()
            except (OSError, UnicodeDecodeError) as error:
                reason = getattr(error, "strerror", None) or "not UTF-8 text"
                raise ConfigError(
                    field, f"refers to file {str(path)!r}, which the reward replica cannot "
                    f"read ({reason}): put the file on every reward node") from None  # fmt: skip
        else:
            resolved[name] = value
    return resolved
