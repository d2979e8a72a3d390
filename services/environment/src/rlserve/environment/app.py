"""Serve application builder of the environment service.

    import_path: rlserve.environment.app:build_app
    args: {tools: {calculator: {tool: calculator}}, num_replicas: 2,
           placement: {label_selector: {rlserve.io/pool: cheap}}}

`build_app` validates `args` into an EnvironmentServiceConfig (a ConfigError names each
bad field, a tool that cannot be built included) before anything is deployed, then
turns it into Serve deployment options like the reward service's: replica count or
autoscaling, per-replica CPUs with `num_gpus=0`, and node placement.
"""

from typing import Any

from ray import serve

from rlserve.core.config import validate_config
from rlserve.core.message_limits import ENVIRONMENT_LIMIT_BYTES
from rlserve.core.replica_pool import replica_deployment_options
from rlserve.environment.config import EnvironmentServiceConfig
from rlserve.environment.deployment import EnvironmentDeployment


def deployment_options(config: EnvironmentServiceConfig) -> dict[str, Any]:
    """Serve `.options(...)` for the environment deployment."""
    return replica_deployment_options(config, ENVIRONMENT_LIMIT_BYTES)


def build_app(args: dict[str, Any]) -> serve.Application:
    """The environment service app for `args` (an EnvironmentServiceConfig as plain data)."""
    config = validate_config(EnvironmentServiceConfig, args)
    return EnvironmentDeployment.options(**deployment_options(config)).bind(config.model_dump())
