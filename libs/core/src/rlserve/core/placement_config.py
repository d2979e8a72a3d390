"""The run's `placement` section: resource pools and which service runs in which.

A pool is a set of nodes picked by Ray node labels; each service (role) placed in one
gets its workers' bundles in the pool's placement group. The trainer turns this section
into each service's `WorkerPlacementConfig` (rlserve.trainer.deploy), and
rlserve.core.placement creates and checks the groups on the cluster.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator, model_validator

from rlserve.core.config import ConfigError, ConfigModel

__all__ = [
    "PlacedRole",
    "PlacementConfig",
    "PlacementStrategy",
    "ResourcePoolConfig",
    "RolePlacementConfig",
    "WorkerPlacementConfig",
    "shares_a_gpu",
]

PlacedRole = Literal["rollout", "critic", "reference", "reward"]
PlacementStrategy = Literal["PACK", "STRICT_PACK", "SPREAD", "STRICT_SPREAD"]


def shares_a_gpu(resources: dict[str, float]) -> bool:
    """Whether a bundle gives its worker part of a GPU: NCCL refuses two ranks of one
    group on one GPU, and Ray may pack two such bundles onto the same GPU."""
    return 0 < resources.get("GPU", 0) < 1


class ResourcePoolConfig(ConfigModel):
    """A named set of nodes (by Ray node label) and how bundles spread over them."""

    label_selector: dict[str, str] = Field(default_factory=dict)
    """Ray node labels the pool's nodes carry, e.g. {"rlserve.io/pool": "gpu"} for nodes
    started with `ray start --labels='{"rlserve.io/pool": "gpu"}'`; empty = every node."""
    strategy: PlacementStrategy = "PACK"
    """How the pool's placement group spreads its bundles: STRICT_PACK colocates every
    worker of the pool's roles on one node; SPREAD puts them on different nodes."""


class RolePlacementConfig(ConfigModel):
    """Which pool one service runs in, and what each of its workers (or, for reward,
    replicas) takes."""

    pool: str
    """Name of a pool in placement.pools."""
    worker_resources: dict[str, float] = Field(default_factory=lambda: {"CPU": 1.0})
    """Resources of one worker's bundle, e.g. {CPU: 4, GPU: 1} or a fractional custom
    resource {CPU: 1, GPU_group: 0.5}; for reward, those of one replica (never a GPU)."""

    @field_validator("worker_resources")
    @classmethod
    def _asks_for_something(cls, resources: dict[str, float]) -> dict[str, float]:
        if not resources or any(amount < 0 for amount in resources.values()):
            raise ValueError(f"needs amounts >= 0, at least one > 0; got {resources}")
        if not any(amount > 0 for amount in resources.values()):
            raise ValueError(f"asks for nothing; give it e.g. {{CPU: 1}}; got {resources}")
        return resources


class PlacementConfig(ConfigModel):
    """Resource pools and the role → pool mapping (VeRL's resource pool manager).

    Roles that share a pool share one named placement group, their workers' bundles in
    the order rollout, critic, reference. The actor's training engine and generation
    engine always share one process. Reward runs only on its pool's nodes, scales by
    replicas and never takes a GPU. Empty (the default): Ray picks the nodes."""

    pools: dict[str, ResourcePoolConfig] = Field(default_factory=dict)
    """Resource pools by name, e.g. {global_pool: ..., reward_pool: ...}."""
    roles: dict[PlacedRole, RolePlacementConfig] = Field(default_factory=dict)
    """Pool (and per-worker resources) of each service; a role left out is placed by Ray."""
    timeout_s: float = Field(60.0, gt=0)
    """Longest wait for a pool's placement group when other work holds its resources
    (a pool that can never hold it fails at once)."""
    group_prefix: str = "rlserve"
    """Placement groups are named '<group_prefix>-<pool>'."""
    reference_in_rollout: bool | None = None
    """Merge the reference into the rollout service: its workers keep a frozen copy of the
    initial weights beside the actor and answer ComputeRefLogProb, and no separate
    reference service is deployed (saves a deployment and its nodes; with LoRA, the same
    weights with adapters off, so no copy at all). None: merged when the actor trains
    LoRA adapters and roles.reference places no reference of its own. Ignored when the
    run uses no reference."""
    stage_threads: bool = True
    """Give each stage of a step (generation, forwards, updates) the node's cores, shared
    among the workers busy in that stage at once, as torch threads set per call; off =
    each worker keeps as many threads as its bundle has CPUs. Applies to large models
    (LARGE_MODEL_WEIGHT_BYTES) where the trainer knows the cores its workers share: a
    local cluster it starts (no roles placed), or node_cpus."""
    node_cpus: int | None = Field(None, ge=1)
    """Cores of the one node the run's workers share, for stage_threads on a cluster the
    trainer joins; None = this machine's cores when the trainer starts its own cluster,
    and bundle-sized threads otherwise."""

    @model_validator(mode="after")
    def _roles_name_pools(self) -> PlacementConfig:
        issues = []
        if self.reference_in_rollout and "reference" in self.roles:
            issues.append(
                ("roles.reference", "the reference is merged into rollout; remove its pool")
            )
        for role, placed in self.roles.items():
            if placed.pool not in self.pools:
                issues.append(
                    (
                        f"roles.{role}.pool",
                        f"no pool {placed.pool!r}; define it under placement.pools "
                        f"(defined: {sorted(self.pools) or 'none'})",
                    )
                )
        reward = self.roles.get("reward")
        if reward is not None and reward.worker_resources.get("GPU", 0) > 0:
            issues.append(
                ("roles.reward.worker_resources.GPU", "reward never takes a GPU; remove it")
            )
        if issues:
            raise ConfigError(issues)
        return self

    def roles_in_pool(self, pool: str) -> list[str]:
        """Roles placed in `pool` that hold worker actors, in bundle order."""
        return [
            role
            for role in ("rollout", "critic", "reference")
            if role in self.roles and self.roles[role].pool == pool
        ]


class WorkerPlacementConfig(ConfigModel):
    """The placement group a service's workers go into: worker i takes bundle
    `bundle_offset + i`. The service creates the group if it does not exist yet."""

    group_name: str = Field(min_length=1)
    """Name of the placement group (shared by the services of one pool)."""
    pool: str = ""
    """Name of the resource pool, for messages."""
    bundles: list[dict[str, float]] = Field(min_length=1)
    """Every bundle of the group, in order (all services sharing it list the same)."""
    bundle_offset: int = Field(0, ge=0)
    """Index of this service's first bundle."""
    strategy: PlacementStrategy = "PACK"
    """How Ray places the bundles over the pool's nodes."""
    label_selector: dict[str, str] = Field(default_factory=dict)
    """Ray node labels every bundle's node must carry (the pool's nodes)."""
    timeout_s: float = Field(60.0, gt=0)
    """Longest wait for resources held by other work before giving up."""

    @field_validator("bundles")
    @classmethod
    def _bundles_ask_for_something(cls, bundles: list[dict[str, float]]) -> list:
        for index, bundle in enumerate(bundles):
            if not any(amount > 0 for amount in bundle.values()):
                raise ValueError(f"bundle {index} asks for nothing; give it e.g. {{CPU: 1}}")
            negative = {name: amount for name, amount in bundle.items() if amount < 0}
            if negative:
                raise ValueError(f"bundle {index} has negative amounts {negative}")
        return bundles

    def require_room_for(self, workers: int, field: str = "workers") -> None:
        """ConfigError unless the group has a bundle for every worker."""
        room = len(self.bundles) - self.bundle_offset
        if room < workers:
            raise ConfigError(
                field,
                f"{workers} workers need {workers} bundles from placement.bundle_offset "
                f"{self.bundle_offset}, but placement group {self.group_name!r} has "
                f"{len(self.bundles)} bundles; add bundles or lower {field}",
            )
