"""Where the replicas of a stateless, scaled-out service run, and Serve's options for
them: the reward service and the environment service, which users scale on cheap CPU
nodes (many replicas, autoscaling, no GPU).
"""

from __future__ import annotations

import math
import os
import socket
from typing import Any, Protocol

from pydantic import Field, model_validator

from rlserve.core.config import ConfigError, ConfigModel
from rlserve.core.message_limits import with_message_limit
from rlserve.core.reward_settings import AutoscalingConfig
from rlserve.v1 import common_pb2

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


class ScaledService(Protocol):
    """The fields a scaled-out service's config has (the reward's, the environment's)."""

    num_cpus_per_replica: float
    placement: ReplicaPlacementConfig
    max_ongoing_requests: int
    autoscaling_config: AutoscalingConfig | None
    num_replicas: int | None


def replica_deployment_options(config: ScaledService, message_limit_bytes: int) -> dict[str, Any]:
    """Serve `.options(...)` of a scaled-out deployment: its CPUs with `num_gpus=0`, node
    placement by custom resource and/or node-label selector, the gRPC message bound,
    concurrency, and autoscaling or a fixed replica count (default 1)."""
    placement = config.placement
    actor_options: dict[str, Any] = {"num_cpus": config.num_cpus_per_replica, "num_gpus": 0}
    if placement.resources:
        actor_options["resources"] = dict(placement.resources)
    if placement.label_selector:
        actor_options["label_selector"] = dict(placement.label_selector)
    options: dict[str, Any] = {
        "ray_actor_options": with_message_limit(actor_options, message_limit_bytes),
        "max_ongoing_requests": config.max_ongoing_requests,
    }
    if config.autoscaling_config is not None:
        options["autoscaling_config"] = config.autoscaling_config.model_dump(exclude_none=True)
    else:
        options["num_replicas"] = config.num_replicas or 1
    return options


def replica_worker_info() -> common_pb2.WorkerInfo:
    """This replica as worker 0 of its service's GetInfo (a scaled-out service has no
    worker actors), so callers see which node it landed on."""
    import ray

    return common_pb2.WorkerInfo(
        rank=0,
        node_id=ray.get_runtime_context().get_node_id(),
        hostname=socket.gethostname(),
        pid=os.getpid(),
    )
