"""Where the replicas of a stateless, scaled-out service run, and Serve's options for
them: the reward service and the environment service, which users scale on cheap CPU
nodes (many replicas, autoscaling, no GPU).
"""

from __future__ import annotations

import math
from typing import Any

from pydantic import Field, model_validator

from rlserve.core.config import ConfigError, ConfigModel
from rlserve.core.message_limits import with_message_limit
from rlserve.core.reward_settings import AutoscalingConfig

# Resources Ray schedules by their own options; a custom resource must not shadow them.
_BUILTIN_RESOURCES = ("CPU", "GPU", "memory", "object_store_memory")


class ReplicaPlacementConfig(ConfigModel):
    """Which Ray nodes replicas may run on (e.g. a pool of cheap CPU nodes)."""

    resources: dict[str, float] = Field(default_factory=dict)
    """Custom Ray resources each replica needs, name -> amount, e.g. {"cpu_pool": 0.001}:
    start the cheap nodes with `ray start --resources='{"cpu_pool": 1000}'`."""
    label_selector: dict[str, str] = Field(default_factory=dict)
    """Ray node-label selector, e.g. {"node-pool": "cpu"} (nodes started with
    `ray start --labels='{"node-pool": "cpu"}'`); values may use Ray's operators (!, in())."""

    @model_validator(mode="after")
    def _check(self) -> ReplicaPlacementConfig:
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


def replica_deployment_options(
    num_cpus_per_replica: float,
    placement: ReplicaPlacementConfig,
    max_ongoing_requests: int,
    autoscaling_config: AutoscalingConfig | None,
    num_replicas: int | None,
    message_limit_bytes: int,
) -> dict[str, Any]:
    """Serve `.options(...)` of a scaled-out deployment: its CPUs with `num_gpus=0`, node
    placement by custom resource and/or node-label selector, the gRPC message bound,
    concurrency, and autoscaling or a fixed replica count (default 1)."""
    actor_options: dict[str, Any] = {"num_cpus": num_cpus_per_replica, "num_gpus": 0}
    if placement.resources:
        actor_options["resources"] = dict(placement.resources)
    if placement.label_selector:
        actor_options["label_selector"] = dict(placement.label_selector)
    options: dict[str, Any] = {
        "ray_actor_options": with_message_limit(actor_options, message_limit_bytes),
        "max_ongoing_requests": max_ongoing_requests,
    }
    if autoscaling_config is not None:
        options["autoscaling_config"] = autoscaling_config.model_dump(exclude_none=True)
    else:
        options["num_replicas"] = num_replicas or 1
    return options
