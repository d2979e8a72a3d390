"""The environment service's one typed config: its tools, sessions, limits, scaling and
placement.

    tools:
      calculator: {tool: calculator}
      python: {tool: python, timeout_s: 15, kwargs: {limits: {cpu_s: 5, wall_s: 10}}}
      lookup: {tool: "my_pkg.tools:Lookup", kwargs: {table: /data/table.json}}
    autoscaling_config: {min_replicas: 1, max_replicas: 8, target_ongoing_requests: 16}
    placement: {label_selector: {rlserve.io/pool: cheap}}

Each tool is built once here (so a tool that cannot be built is a ConfigError naming its
field before anything deploys) and again in each replica. Replicas take no GPU; like the
reward service they scale out on cheap CPU nodes.
"""

from __future__ import annotations

from typing import Any

from pydantic import Field, JsonValue, model_validator

from rlserve.core.auth import ServiceAuth
from rlserve.core.config import ConfigError, ConfigModel
from rlserve.core.replica_pool import ReplicaPlacementConfig
from rlserve.core.reward_settings import AutoscalingConfig
from rlserve.core.tracing_config import TracingConfig
from rlserve.environment.tools import Calculator, Tool, user_tool

BUILT_IN_TOOLS: dict[str, Any] = {"calculator": Calculator}
"""Built-in tools by name (the sandboxed Python executor registers as "python")."""


class ToolConfig(ConfigModel):
    """One tool the service offers, under the name the model calls it by."""

    tool: str
    """A built-in tool ("calculator", "python") or your own class as
    "package.module:Class" (built with `kwargs`; see rlserve.environment.tools)."""
    kwargs: dict[str, JsonValue] = Field(default_factory=dict)
    """Keyword arguments the tool is built with (e.g. the Python tool's sandbox limits)."""
    timeout_s: float = Field(30.0, gt=0, allow_inf_nan=False)
    """Most seconds one call may take; past it the call answers a "timeout" observation."""


def build_tool(config: ToolConfig) -> Tool:
    """The tool `config` names, built with its kwargs (ConfigError naming the field)."""
    built_in = BUILT_IN_TOOLS.get(config.tool)
    if built_in is None:
        if ":" not in config.tool:
            raise ConfigError(
                "tool",
                f"unknown tool {config.tool!r}; built-in tools: {', '.join(sorted(BUILT_IN_TOOLS))}"
                " (or give your own class as 'package.module:Class')",
            )
        return user_tool(config.tool, config.kwargs)
    try:
        return built_in(**config.kwargs)
    except (TypeError, ValueError) as error:
        raise ConfigError("kwargs", f"{config.tool} cannot be built with them: {error}") from None


def _default_tools() -> dict[str, ToolConfig]:
    return {"calculator": ToolConfig(tool="calculator")}


class EnvironmentServiceConfig(ServiceAuth):
    """The environment service: tools, sessions, request limits, replicas and placement."""

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
    num_cpus_per_replica: float = Field(1.0, gt=0, allow_inf_nan=False)
    """Logical CPUs Ray reserves per replica; replicas take no GPU."""
    placement: ReplicaPlacementConfig = Field(default_factory=ReplicaPlacementConfig)
    """Node placement of the replicas (e.g. the cheap pool)."""
    tracing: TracingConfig = Field(default_factory=TracingConfig)
    """OpenTelemetry span export of this service; off by default."""

    @model_validator(mode="after")
    def _tools_build(self) -> EnvironmentServiceConfig:
        issues = []
        for name, tool in self.tools.items():
            try:
                build_tool(tool)
            except ConfigError as error:
                issues += [
                    (f"tools.{name}" + (f".{field}" if field else ""), message)
                    for field, message in error.issues
                ]
        if self.num_replicas is not None and self.autoscaling_config is not None:
            issues.append(("num_replicas", "set num_replicas or autoscaling_config, not both"))
        if issues:
            raise ConfigError(issues)
        return self
