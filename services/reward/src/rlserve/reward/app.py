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
from rlserve.core.message_limits import REWARD_LIMIT_BYTES, with_message_limit
from rlserve.reward.config import RewardServiceConfig
from rlserve.reward.deployment import RewardDeployment


def deployment_options(config: RewardServiceConfig) -> dict[str, Any]:
    """Serve `.options(...)` for the reward deployment."""
    actor_options: dict[str, Any] = {"num_cpus": config.num_cpus_per_replica, "num_gpus": 0}
    if config.placement.resources:
        actor_options["resources"] = dict(config.placement.resources)
    if config.placement.label_selector:
        actor_options["label_selector"] = dict(config.placement.label_selector)
    options: dict[str, Any] = {
        "ray_actor_options": with_message_limit(actor_options, REWARD_LIMIT_BYTES),
        "max_ongoing_requests": config.max_ongoing_requests,
    }
    if config.autoscaling_config is not None:
        options["autoscaling_config"] = config.autoscaling_config.model_dump(exclude_none=True)
    else:
        options["num_replicas"] = config.num_replicas or 1
    return options


def build_app(args: dict[str, Any]) -> serve.Application:
    """The reward service app for `args` (a RewardServiceConfig as plain data)."""
    config = validate_config(RewardServiceConfig, args)
    return RewardDeployment.options(**deployment_options(config)).bind(config.model_dump())
