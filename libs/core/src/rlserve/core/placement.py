"""Where a service's workers run: named Ray placement groups on a resource pool's nodes.

A pool is a set of nodes picked by Ray node labels (`ray start --labels=...`); a placement
group on it holds one bundle per worker. Services that share a pool share one group
(named, detached, so it outlives whichever replica created it): with STRICT_PACK their
workers are colocated on one node, with PACK Ray keeps them together where it can, with
SPREAD it spreads them. A worker asks for exactly its bundle's resources, so `GPU` or a
fractional custom resource (e.g. `GPU_group: 0.5`) in a bundle reaches the worker.

Ray leaves a group that cannot be placed pending forever. `ensure_placement_group`
first checks the request against the nodes' total resources and labels (impossible
→ PlacementError at once, naming the pool and what is missing), then waits at most
`timeout_s` for resources that other work holds (→ PlacementError with what is free).
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import Any

import ray
from ray.util.placement_group import (
    PlacementGroup,
    get_placement_group,
    placement_group,
    placement_group_table,
    remove_placement_group,
)

from rlserve.core.placement_config import PlacementStrategy, WorkerPlacementConfig

# Ray's per-node bookkeeping resources ("node:10.0.0.1", "memory", ...) say nothing
# about what a pool offers and would only clutter error messages.
_HIDDEN_RESOURCES = ("node:", "memory", "object_store_memory")


class PlacementError(RuntimeError):
    """A placement group cannot be placed; the message names the pool and the shortfall."""


def actor_resource_options(bundle: Mapping[str, float]) -> dict[str, Any]:
    """Ray actor options asking for exactly `bundle` (CPU/GPU as num_cpus/num_gpus)."""
    custom = {name: amount for name, amount in bundle.items() if name not in ("CPU", "GPU")}
    options: dict[str, Any] = {
        "num_cpus": bundle.get("CPU", 0),
        "num_gpus": bundle.get("GPU", 0),
    }
    if custom:
        options["resources"] = custom
    return options


def _visible(resources: Mapping[str, float]) -> dict[str, float]:
    return {
        name: amount for name, amount in resources.items() if not name.startswith(_HIDDEN_RESOURCES)
    }


def alive_nodes() -> list[dict[str, Any]]:
    """Alive nodes as {node_id, labels, resources (totals)}."""
    return [
        {
            "node_id": node["NodeID"],
            "labels": dict(node.get("Labels") or {}),
            "resources": _visible(node["Resources"]),
        }
        for node in ray.nodes()
        if node["Alive"]
    ]


def nodes_matching(nodes: Sequence[dict[str, Any]], label_selector: Mapping[str, str]) -> list:
    return [
        node
        for node in nodes
        if all(node["labels"].get(key) == value for key, value in label_selector.items())
    ]


def _fits(need: Mapping[str, float], have: Mapping[str, float]) -> bool:
    return all(have.get(name, 0) + 1e-9 >= amount for name, amount in need.items())


def _shortfall(need: Mapping[str, float], have: Mapping[str, float]) -> dict[str, str]:
    return {
        name: f"need {amount:g}, have {have.get(name, 0):g}"
        for name, amount in need.items()
        if have.get(name, 0) + 1e-9 < amount
    }


def _total(bundles: Sequence[Mapping[str, float]]) -> dict[str, float]:
    total: dict[str, float] = {}
    for bundle in bundles:
        for name, amount in bundle.items():
            total[name] = total.get(name, 0) + amount
    return total


def check_feasible(
    pool: str,
    bundles: Sequence[Mapping[str, float]],
    strategy: PlacementStrategy,
    label_selector: Mapping[str, str],
    nodes: Sequence[dict[str, Any]],
) -> None:
    """PlacementError if no amount of waiting could place the group on these nodes."""
    where = f"pool {pool!r}" if pool else "placement group"
    matching = nodes_matching(nodes, label_selector)
    if not matching:
        labels = sorted(
            {
                f"{key}={value}"
                for node in nodes
                for key, value in node["labels"].items()
                if not key.startswith("ray.io/")  # Ray's own per-node labels
            }
        )
        raise PlacementError(
            f"{where}: no alive node carries the labels {dict(label_selector)}; labels on "
            f"the cluster's nodes: {labels or 'none'}. Start the pool's nodes with "
            f"`ray start --labels=...` or fix the pool's label_selector"
        )
    for index, bundle in enumerate(bundles):
        if not any(_fits(bundle, node["resources"]) for node in matching):
            closest = min(matching, key=lambda node: len(_shortfall(bundle, node["resources"])))
            raise PlacementError(
                f"{where}: bundle {index} {dict(bundle)} fits on none of its "
                f"{len(matching)} node(s); missing on the closest node: "
                f"{_shortfall(bundle, closest['resources'])}. Lower the per-worker resources "
                "or add a bigger node to the pool"
            )
    if strategy == "STRICT_PACK":
        total = _total(bundles)
        if not any(_fits(total, node["resources"]) for node in matching):
            raise PlacementError(
                f"{where}: STRICT_PACK puts all {len(bundles)} bundles ({total}) on one node, "
                f"but no node of the pool has that much; missing on each: "
                f"{[_shortfall(total, node['resources']) for node in matching]}. Use fewer "
                "workers, strategy PACK, or a bigger node"
            )
    elif strategy == "STRICT_SPREAD" and len(matching) < len(bundles):
        raise PlacementError(
            f"{where}: STRICT_SPREAD needs {len(bundles)} nodes, the pool has {len(matching)}"
        )
    else:
        capacity = _total([node["resources"] for node in matching])
        missing = _shortfall(_total(bundles), capacity)
        if missing:
            raise PlacementError(
                f"{where}: its {len(matching)} node(s) together lack {missing} for "
                f"{len(bundles)} bundles; add nodes to the pool or use fewer workers"
            )


def _existing_group(name: str) -> PlacementGroup | None:
    try:
        return get_placement_group(name)
    except ValueError:
        return None


def _group_bundles(group: PlacementGroup) -> list[dict[str, float]]:
    table = placement_group_table(group)["bundles"]
    return [dict(table[index]) for index in sorted(table)]


def ensure_placement_group(placement: WorkerPlacementConfig) -> PlacementGroup:
    """The named group of `placement`, created (detached) if missing, once it is placed."""
    group = _existing_group(placement.group_name)
    if group is not None:
        existing = _group_bundles(group)
        if existing != [dict(bundle) for bundle in placement.bundles]:
            raise PlacementError(
                f"placement group {placement.group_name!r} exists with bundles {existing}, "
                f"not the requested {placement.bundles}; remove it first "
                f"(`rlserve service release-placement {placement.group_name}`) or use "
                "another group_name"
            )
    else:
        check_feasible(
            placement.pool,
            placement.bundles,
            placement.strategy,
            placement.label_selector,
            alive_nodes(),
        )
        selectors = (
            [dict(placement.label_selector) for _ in placement.bundles]
            if placement.label_selector
            else None
        )
        group = placement_group(
            [dict(bundle) for bundle in placement.bundles],
            strategy=placement.strategy,
            name=placement.group_name,
            lifetime="detached",
            bundle_label_selector=selectors,
        )
    _wait_placed(group, placement)
    return group


def _wait_placed(group: PlacementGroup, placement: WorkerPlacementConfig) -> None:
    deadline = time.monotonic() + placement.timeout_s
    while not group.wait(timeout_seconds=min(5.0, placement.timeout_s)):
        if time.monotonic() >= deadline:
            free = _visible(ray.available_resources())
            remove_placement_group(group)
            raise PlacementError(
                f"pool {placement.pool!r}: placement group {placement.group_name!r} "
                f"({len(placement.bundles)} bundles, {placement.strategy}) was not placed "
                f"within {placement.timeout_s:g} s: the pool's nodes are big enough but other "
                f"work holds the resources (cluster free now: {free}). Free them, add nodes "
                "or raise placement.timeout_s"
            )


def release_placement_group(name: str) -> bool:
    """Removes the named group (its workers die with it); False if there was none."""
    group = _existing_group(name)
    if group is None:
        return False
    remove_placement_group(group)
    return True


def group_bundle_nodes(name: str) -> list[str]:
    """Node id of each bundle of the named group, in bundle order (where Ray put it)."""
    group = _existing_group(name)
    if group is None:
        raise PlacementError(f"placement group {name!r} does not exist")
    table = placement_group_table(group)
    by_index = table.get("bundles_to_node_id") or {}
    return [by_index.get(index, "") for index in sorted(table["bundles"])]


def serve_details() -> dict[str, Any]:
    """What the Serve controller reports (ServeInstanceDetails as a dict: applications,
    target_groups, ...); raises when no Serve runs on this cluster."""
    from ray.serve.context import _get_global_client

    return _get_global_client().get_serve_details()


def serve_replicas(app: str) -> list[dict[str, Any]]:
    """Running replicas of a Serve app, as the Serve controller sees them:
    {deployment, replica_id, node_id, pid, required_resources}."""
    details = serve_details()
    application = (details.get("applications") or {}).get(app) or {}
    return [
        {
            "deployment": name,
            "replica_id": replica["replica_id"],
            "node_id": replica["node_id"],
            "pid": replica["pid"],
            "required_resources": dict(deployment.get("required_resources") or {}),
        }
        for name, deployment in (application.get("deployments") or {}).items()
        for replica in deployment.get("replicas") or []
        if replica.get("state") == "RUNNING"
    ]
