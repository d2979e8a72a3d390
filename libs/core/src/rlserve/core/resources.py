"""What the services hold: each Serve replica's and its workers' resident memory, and the
object store's use, read from outside the services.

Nothing here calls a service: the actor table comes from Ray's control store (GCS) and
resident memory from each process itself (psutil; a zero-CPU task pinned to the node for
processes on other nodes), so a replica busy with a long update, or one whose worker
hangs, is measured all the same. No dashboard needed (local clusters start without one).

A worker actor belongs to the replica that created it: Ray records each actor's owner
address, and a worker's owner address is its replica's own address.
"""

import logging
import os
from collections import defaultdict
from dataclasses import dataclass

import psutil
import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

_MIB = 1 << 20
MEASURE_TIMEOUT_S = 10.0
"""How long a node's memory reading may take before it is given up for this time."""
logger = logging.getLogger(__name__)
# Ray names a replica's actor class ServeReplica:<app>:<deployment>
REPLICA_CLASS_PREFIX = "ServeReplica:"


@dataclass(frozen=True)
class ProcessMemory:
    app: str
    """Serve application the process serves (e.g. "rollout")."""
    kind: str
    """"replica", or the worker's class (e.g. "ActorWorker")."""
    actor_id: str
    node_id: str
    pid: int
    resident_bytes: int
    """Resident set size; -1 when the process could not be read (it just exited)."""


@dataclass(frozen=True)
class ObjectStoreUse:
    used_bytes: int
    """Bytes held in the object stores of all nodes together."""
    capacity_bytes: int
    """Their combined capacity."""
    objects: int
    """Objects held."""


def _resident_bytes(pids: list[int]) -> list[int]:
    sizes = []
    for pid in pids:
        try:
            sizes.append(psutil.Process(pid).memory_info().rss)
        except psutil.Error:
            sizes.append(-1)
    return sizes


@ray.remote(num_cpus=0)
def _resident_bytes_on_node(pids: list[int]) -> list[int]:
    return _resident_bytes(pids)


def _address(entry: dict) -> tuple[str, int]:
    return entry["IPAddress"], int(entry["Port"])


def service_memory() -> list[ProcessMemory]:
    """Every live Serve replica and the worker actors it created, with resident memory;
    replicas first, by app. Needs a connected Ray driver."""
    actors = [actor for actor in ray._private.state.actors().values() if actor["State"] == "ALIVE"]
    replica_apps = {}
    for actor in actors:
        if actor["ActorClassName"].startswith(REPLICA_CLASS_PREFIX):
            replica_apps[_address(actor["Address"])] = actor["ActorClassName"].split(":")[1]
    found = []
    for actor in actors:
        is_replica = actor["ActorClassName"].startswith(REPLICA_CLASS_PREFIX)
        app = (
            replica_apps[_address(actor["Address"])]
            if is_replica
            else replica_apps.get(_address(actor["OwnerAddress"]))
        )
        if app is not None:
            kind = "replica" if is_replica else actor["ActorClassName"]
            found.append((app, kind, actor["ActorID"], actor["Address"]["NodeID"], actor["Pid"]))
    sizes = _measure({(node_id, pid) for _, _, _, node_id, pid in found})
    rows = [
        ProcessMemory(app, kind, actor_id, node_id, pid, sizes[node_id, pid])
        for app, kind, actor_id, node_id, pid in found
    ]
    return sorted(rows, key=lambda row: (row.app, row.kind != "replica", row.kind, row.pid))


def _measure(
    processes: set[tuple[str, int]], timeout_s: float = MEASURE_TIMEOUT_S
) -> dict[tuple[str, int], int]:
    """Resident bytes of each (node id, pid): this node's read here, others' by a task
    pinned to their node. A node whose task has not answered within `timeout_s` (it
    cannot start one: a stalled raylet, no worker process to be had) reads -1 for its
    processes and is logged by name, rather than stalling the caller."""
    by_node: dict[str, list[int]] = defaultdict(list)
    for node_id, pid in processes:
        by_node[node_id].append(pid)
    here = ray.get_runtime_context().get_node_id()
    pending = {}
    sizes = {}
    for node_id, pids in by_node.items():
        if node_id == here:
            sizes.update(zip(((node_id, pid) for pid in pids), _resident_bytes(pids), strict=True))
        else:
            strategy = NodeAffinitySchedulingStrategy(node_id, soft=False)
            pending[node_id] = _resident_bytes_on_node.options(scheduling_strategy=strategy).remote(
                pids
            )
    if pending:
        ready, _ = ray.wait(list(pending.values()), num_returns=len(pending), timeout=timeout_s)
        answered = {ref.hex() for ref in ready}
    for node_id, ref in pending.items():
        pids = by_node[node_id]
        if ref.hex() in answered:
            sizes.update(zip(((node_id, pid) for pid in pids), ray.get(ref), strict=True))
            continue
        logger.warning(
            "node %s did not report its processes' memory within %.0f s (it cannot start a "
            "task); its %d processes read as unmeasured",
            node_id,
            timeout_s,
            len(pids),
        )
        ray.cancel(ref, force=False)
        sizes.update(((node_id, pid), -1) for pid in pids)
    return sizes


def object_store_use() -> ObjectStoreUse:
    """The object stores' use across the cluster, as one raylet reports it for all."""
    from ray._private.internal_api import get_memory_info_reply, get_state_from_address

    state = get_state_from_address(ray.get_runtime_context().gcs_address)
    stats = get_memory_info_reply(state, timeout_seconds=30.0).store_stats
    return ObjectStoreUse(
        used_bytes=int(stats.object_store_bytes_used),
        capacity_bytes=int(stats.object_store_bytes_avail),
        objects=int(stats.num_local_objects),
    )


def resource_metrics() -> dict[str, float]:
    """Metrics of a run's resources, in MiB: `resources/object_store_mib`,
    `resources/<app>_mib` (its replicas and their workers together) and
    `resources/trainer_mib` (this process)."""
    metrics = {"resources/object_store_mib": object_store_use().used_bytes / _MIB}
    per_app: dict[str, int] = defaultdict(int)
    for process in service_memory():
        per_app[process.app] += max(process.resident_bytes, 0)
    for app, size in sorted(per_app.items()):
        metrics[f"resources/{app}_mib"] = size / _MIB
    metrics["resources/trainer_mib"] = _resident_bytes([os.getpid()])[0] / _MIB
    return metrics
