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

from pydantic import Field, model_validator

from rlserve.core.auth import ServiceAuth
from rlserve.core.config import ConfigError
from rlserve.core.environment_settings import EnvironmentSettings, ToolConfig
from rlserve.core.replica_pool import ReplicaPlacementConfig
from rlserve.core.tracing_config import TracingConfig
from rlserve.environment.python_tool import PythonTool
from rlserve.environment.tools import Calculator, Tool, user_tool

BUILT_IN_TOOLS: dict[str, Any] = {"calculator": Calculator, "python": PythonTool}
"""Built-in tools by name."""


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


class EnvironmentServiceConfig(EnvironmentSettings, ServiceAuth):
    """The environment service: tools, sessions, request limits, replicas and placement."""

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
        if issues:
            raise ConfigError(issues)
        return self
