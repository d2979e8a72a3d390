"""What the cluster cannot place right now: resource demand no alive node has free.

Ray leaves an actor or placement group whose resources are taken pending forever and
names it only in `ray status`. `resource_shortfall` reads the same state from the GCS
(the raylets' pending requests and every node's free and total resources), so a deploy
can say within seconds what is waiting, what each node offers, and what to change.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass

import ray


# Ray's bookkeeping: per-node markers, and the per-group names a placed group's actors
# ask for (the group itself is a pending request of its own while it is not placed).
def _bookkeeping(name: str) -> bool:
    return name.startswith("node:") or "_group_" in name


# Amounts every node has plenty of, that would only clutter the per-node lines.
_UNLISTED = ("memory", "object_store_memory")


def _offered(resources: Mapping[str, float]) -> dict[str, float]:
    return {
        name: amount
        for name, amount in resources.items()
        if not _bookkeeping(name) and name not in _UNLISTED
    }


def _fits(need: Mapping[str, float], have: Mapping[str, float]) -> bool:
    return all(have.get(name, 0) + 1e-9 >= amount for name, amount in need.items())


def _shape(resources: Mapping[str, float]) -> str:
    amounts = ", ".join(f"{name}: {amount:g}" for name, amount in sorted(resources.items()))
    return "{" + amounts + "}"


@dataclass(frozen=True)
class Shortfall:
    """Pending requests no node can take now, and what the nodes offer."""

    waiting: tuple[str, ...]
    """One line per pending shape: count × resources, and whether any node could ever
    hold it (its totals) or other work holds what it needs."""
    actors: tuple[str, ...]
    """Class names of the actors waiting to be created (Serve replicas, workers)."""
    nodes: tuple[str, ...]
    """One line per alive node: address, then free/total of each resource."""
    never_fits: bool
    """Some request is larger than every node: no amount of waiting places it."""
    gpus: bool = False
    """Some waiting request asks for GPUs: the fix then is about GPUs, not CPUs."""

    def describe(self) -> str:
        lines = ["waiting for resources no node has free:"]
        lines += [f"  {line}" for line in self.waiting]
        if self.actors:
            lines.append(f"  pending actors: {', '.join(self.actors)}")
        lines.append("what the nodes offer (free/total):")
        lines += [f"  {line}" for line in self.nodes]
        if self.gpus:
            lines.append(
                "fix for GPUs: share them (a placement bundle such as {CPU: 1, GPU: 0.5}, "
                "or the service's gpus_per_worker below 1; the trainer shares them itself "
                "when no placement is set), set the role's device: cpu, or add GPUs"
            )
        if self.never_fits:
            lines.append(
                "fix: lower the per-replica or per-worker resources (num_cpus_per_replica, "
                "num_cpus_per_worker, placement bundles) or add a node that large"
            )
        else:
            lines.append(
                "fix: free the resources other work holds (`rlserve service status` lists "
                "the services deployed; remove unused ones), deploy fewer replicas or "
                "workers, or add nodes"
            )
        return "\n".join(lines)


def _node_lines(node_states) -> list[str]:
    lines = []
    for node in node_states:
        free = _offered(node.available_resources)
        total = _offered(node.total_resources)
        offered = ", ".join(
            f"{name} {free.get(name, 0):g}/{amount:g}" for name, amount in sorted(total.items())
        )
        lines.append(f"{node.node_ip_address or node.node_id.hex()[:12]}: {offered or 'nothing'}")
    return lines


def _pending_actors(serve_apps: Collection[str] | None) -> list[str]:
    """Class names of the actors waiting to be created: with `serve_apps`, only those
    apps' replicas and the actors their replicas created (their workers)."""
    from ray._private.state import state

    actors = list(state.actor_table(None).values())
    pending = [actor for actor in actors if actor["State"] == "PENDING_CREATION"]
    if serve_apps is None:
        return sorted({actor["ActorClassName"] for actor in pending})
    prefixes = tuple(f"ServeReplica:{app}:" for app in serve_apps)
    replicas = {
        (actor["Address"]["IPAddress"], actor["Address"]["Port"])
        for actor in actors
        if actor["State"] == "ALIVE" and actor["ActorClassName"].startswith(prefixes)
    }
    return sorted(
        {
            actor["ActorClassName"]
            for actor in pending
            if actor["ActorClassName"].startswith(prefixes)
            or (actor["OwnerAddress"]["IPAddress"], actor["OwnerAddress"]["Port"]) in replicas
        }
    )


def resource_shortfall(serve_apps: Collection[str] | None = None) -> Shortfall | None:
    """The demand Ray is holding back for lack of free resources, or None.

    A pending request that fits some node's free resources is being scheduled, not
    short of anything, and is left out. With `serve_apps`, a shortfall counts only while
    one of those apps' replicas or workers is among the actors waiting: on a shared
    cluster another job's pending work is not this deploy's problem.
    """
    from ray._raylet import GcsClient
    from ray.autoscaler.v2.sdk import get_cluster_resource_state
    from ray.core.generated import autoscaler_pb2

    cluster = get_cluster_resource_state(GcsClient(address=ray.get_runtime_context().gcs_address))
    # Dead nodes stay in the table; draining ones take no new work.
    nodes = [
        node
        for node in cluster.node_states
        if node.status in (autoscaler_pb2.NodeStatus.RUNNING, autoscaler_pb2.NodeStatus.IDLE)
    ]
    requests = [
        (dict(request.request.resources_bundle), request.count)
        for request in cluster.pending_resource_requests
    ]
    for gang in cluster.pending_gang_resource_requests:
        requests += [(dict(bundle.resources_bundle), 1) for bundle in gang.requests]
    waiting = []
    never_fits = gpus = False
    for request, count in requests:
        need = {name: amount for name, amount in request.items() if not _bookkeeping(name)}
        if not need or any(_fits(need, node.available_resources) for node in nodes):
            continue
        larger_than_every_node = not any(_fits(need, node.total_resources) for node in nodes)
        never_fits = never_fits or larger_than_every_node
        gpus = gpus or need.get("GPU", 0) > 0
        why = "larger than every node" if larger_than_every_node else "other work holds it"
        waiting.append(f"{count} × {_shape(need)} ({why})")
    if not waiting:
        return None
    actors = _pending_actors(serve_apps)
    if serve_apps is not None and not actors:
        return None
    return Shortfall(
        waiting=tuple(waiting),
        actors=tuple(actors),
        nodes=tuple(_node_lines(nodes)),
        never_fits=never_fits,
        gpus=gpus,
    )
