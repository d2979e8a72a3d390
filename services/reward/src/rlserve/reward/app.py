"""Serve application builder of the reward service.

    import_path: rlserve.reward.app:build_app
    args: {kinds: {rule: {rule_name: gsm8k}}, num_replicas: 4,
           placement: {resources: {cpu_pool: 0.001}}}

`build_app` validates `args` into a RewardServiceConfig (a ConfigError names each bad
field) before anything is deployed, then turns the config into Serve deployment options:
replica count or autoscaling, per-replica CPUs with `num_gpus=0`, and node placement by
custom resource and/or node-label selector.
"""

from typing import Any

from ray import serve

from rlserve.core.config import validate_config
from rlserve.core.message_limits import REWARD_LIMIT_BYTES
from rlserve.core.replica_pool import replica_deployment_options
from rlserve.reward.config import RewardServiceConfig
from rlserve.reward.deployment import RewardDeployment


def deployment_options(config: RewardServiceConfig) -> dict[str, Any]:
    """Serve `.options(...)` for the reward deployment."""
    return replica_deployment_options(config, REWARD_LIMIT_BYTES)


def build_app(args: dict[str, Any]) -> serve.Application:
    """The reward service app for `args` (a RewardServiceConfig as plain data)."""
    config = validate_config(RewardServiceConfig, args)
    return RewardDeployment.options(**deployment_options(config)).bind(config.model_dump())
