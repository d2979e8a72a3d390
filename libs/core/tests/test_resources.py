"""Resident memory of a replica and the workers it created, and the object store's use,
read from a real Serve app on the session's cluster."""

import os
import time

import pytest
import ray
from ray import serve

from rlserve.core.resources import object_store_use, resource_metrics, service_memory

APP = "resources-probe"
HELD_BYTES = 96 * 2**20


@ray.remote(num_cpus=0)
class BufferHolder:
    """A worker holding HELD_BYTES of touched memory."""

    def __init__(self):
        self.buffer = bytearray(os.urandom(1024)) * (HELD_BYTES // 1024)

    def pid(self) -> int:
        return os.getpid()


@serve.deployment(ray_actor_options={"num_cpus": 0})
class ProbeDeployment:
    def __init__(self):
        self.holder = BufferHolder.remote()

    async def pids(self) -> tuple[int, int]:
        return os.getpid(), await self.holder.pid.remote()


@pytest.fixture(scope="module")
def probe_pids(serve_cluster):
    handle = serve.run(ProbeDeployment.bind(), name=APP, route_prefix=None)
    yield handle.pids.remote().result()
    serve.delete(APP)


def test_a_replica_and_its_worker_are_found_with_their_memory(probe_pids):
    replica_pid, worker_pid = probe_pids
    rows = [row for row in service_memory() if row.app == APP]
    assert [(row.kind, row.pid) for row in rows] == [
        ("replica", replica_pid),
        ("BufferHolder", worker_pid),
    ]
    replica, worker = rows
    assert worker.resident_bytes >= HELD_BYTES
    assert replica.resident_bytes > 0
    assert worker.node_id == ray.get_runtime_context().get_node_id()


def test_resource_metrics_sum_an_apps_processes(probe_pids):
    metrics = resource_metrics()
    assert metrics[f"resources/{APP}_mib"] >= HELD_BYTES / 2**20
    assert metrics["resources/trainer_mib"] > 0


def test_object_store_use_follows_what_is_held(serve_cluster):
    before = object_store_use()
    held = ray.put(b"x" * (32 * 2**20))
    during = object_store_use()
    # earlier tests' small objects may be freed in between (a CI run saw 108 KiB go):
    # the growth is the 32 MiB object less at most 1 MiB of those
    assert during.used_bytes - before.used_bytes >= 31 * 2**20
    assert during.used_bytes >= 32 * 2**20 and during.objects >= 1
    assert during.capacity_bytes > during.used_bytes
    del held
    deadline = time.monotonic() + 10  # the store frees an object shortly after its last ref
    while object_store_use().used_bytes >= during.used_bytes:
        assert time.monotonic() < deadline, "the object store kept a released object"
        time.sleep(0.1)
