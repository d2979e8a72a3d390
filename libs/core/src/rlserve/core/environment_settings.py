"""What an environment service offers and how it scales, and how a run's rollout calls
it: the settings a run's `rollout.agent` section and a deployed environment service
share (the service's config, rlserve.environment.config, builds on them).
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, JsonValue, model_validator

from rlserve.core.config import ConfigError, ConfigModel
from rlserve.core.reward_settings import AutoscalingConfig


class ToolConfig(ConfigModel):
    """One tool the environment service offers, under the name the model calls it by."""

    tool: str
    """A built-in tool ("calculator", "python") or your own class as
    "package.module:Class" (built with `kwargs`; see rlserve.environment.tools)."""
    kwargs: dict[str, JsonValue] = Field(default_factory=dict)
    """Keyword arguments the tool is built with (e.g. the Python tool's sandbox limits)."""
    timeout_s: float = Field(30.0, gt=0, allow_inf_nan=False)
    """Most seconds one call may take; past it the call answers a "timeout" observation."""


def _default_tools() -> dict[str, ToolConfig]:
    return {"calculator": ToolConfig(tool="calculator")}


class EnvironmentSettings(ConfigModel):
    """The environment service's tools, sessions, request limits and scaling."""

    tools: dict[str, ToolConfig] = Field(default_factory=_default_tools, min_length=1)
    """The tools by the name the model calls them (default: the calculator)."""
    session_ttl_s: float = Field(600.0, gt=0, allow_inf_nan=False)
    """Seconds a session's state outlives its last call on a replica."""
    max_sessions: int = Field(10_000, ge=1)
    """Sessions whose state a replica keeps; past it the least recently used goes first
    (its next call starts afresh, and the eviction is counted)."""
    max_arguments_chars: int = Field(65_536, ge=1)
    """Longest arguments_json or tools_kwargs_json of a call (INVALID_ARGUMENT past it)."""
    max_observation_chars: int = Field(16_384, ge=1)
    """Longest observation answered; a longer one is cut, with a note saying so."""
    num_replicas: int | None = Field(None, ge=1)
    """Fixed replica count (default 1), or None with autoscaling_config."""
    autoscaling_config: AutoscalingConfig | None = None
    """Serve autoscaling of the replicas; None = num_replicas."""
    max_ongoing_requests: int = Field(256, ge=1)
    """Calls one replica runs at once (tool calls mostly wait: on a sandbox, a user's
    API), beyond which Serve queues or routes to another replica."""

    @model_validator(mode="after")
    def _one_way_to_scale(self) -> EnvironmentSettings:
        if self.num_replicas is not None and self.autoscaling_config is not None:
            raise ConfigError("num_replicas", "set num_replicas or autoscaling_config, not both")
        return self


class AgentConfig(ConfigModel):
    """Multi-turn rollouts: the model calls tools over several turns and only its own
    tokens train (observations have response mask 0)."""

    tool_call_format: Literal["hermes", "bracket"] = "hermes"
    """How the model writes a call: "hermes" (<tool_call>{"name", "arguments"}</tool_call>)
    or "bracket" ([tool_name: text], the embedded task's)."""
    bracket_argument: str = Field("expression", min_length=1)
    """The argument a "bracket" call's text is passed as."""
    max_turns: int = Field(4, ge=1)
    """Most model turns per response (the last one's calls are not run)."""
    max_tool_calls: int = Field(8, ge=0)
    """Most tool calls per response; a turn that would pass it ends the response."""
    max_tool_response_tokens: int = Field(256, ge=1)
    """Most tokens of one observation's text; a longer one is cut. rollout.max_new_tokens
    bounds the whole response, model turns and observations together."""
    tool_timeout_s: float = Field(30.0, gt=0, allow_inf_nan=False)
    """Seconds one call may take end to end; past it the model reads a timeout."""
    observation_role: str = Field("tool", min_length=1)
    """The chat role observations are rendered as."""
    tool_reward_weight: float = Field(0.0, allow_inf_nan=False)
    """Weight of the tools' step rewards (summed per response) added to its score."""
    on_tool_error: Literal["continue", "zero_reward", "drop_sample"] = "continue"
    """A response with a failed call (timeout, tool error, unreachable tool, malformed
    call): "continue" scores it as any other; "zero_reward" scores it 0; "drop_sample"
    gives it no policy-gradient signal (advantage 0; its row stays in the batch and is
    counted in agent/dropped_samples). Either way the failures are counted in the step's
    metrics (generate/agent/errors_<kind>)."""
    environment: EnvironmentSettings = Field(default_factory=EnvironmentSettings)
    """The environment service the run deploys (Serve app "environment"): its tools,
    limits and scaling."""
