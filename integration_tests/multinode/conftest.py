"""A simulated multi-node cluster (ray.cluster_utils.Cluster) for placement tests.

Nodes: a head without a pool label (Serve's controller and proxy), two "GPU" nodes
labelled rlserve.io/pool=gpu that carry a custom `fake_gpu` resource standing in for
GPUs, and two cheap CPU nodes labelled rlserve.io/pool=cheap. Run with
`RLSERVE_MULTINODE_TESTS=1 pytest integration_tests/multinode` (a session of its own:
Ray allows one cluster per process, and the main session already holds one).
"""

import os
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass

import pytest

POOL_LABEL = "rlserve.io/pool"
FAKE_GPUS_PER_NODE = 4


@dataclass(frozen=True)
class PoolCluster:
    grpc_address: str
    labels_by_node: dict[str, dict[str, str]]
    raylet_pids: dict[str, int]
    """Each node's raylet process, by node id (to stall a node on purpose)."""

    def nodes_in(self, pool: str) -> set[str]:
        return {
            node for node, labels in self.labels_by_node.items() if labels.get(POOL_LABEL) == pool
        }


@pytest.fixture(scope="session")
def pool_cluster() -> Iterator[PoolCluster]:
    import ray
    from ray import serve
    from ray.cluster_utils import Cluster

    from rlserve.core import auth
    from rlserve.core.cluster import apply_ray_env_defaults, free_port, start_serve

    apply_ray_env_defaults()
    # Authentication on, as in the main session: every node inherits the token.
    if auth.expected_token() is None:
        os.environ[auth.TOKEN_ENV] = auth.generate_token()
    # Every node's files and Ray's "current cluster" address file go under a private
    # short directory (unix socket paths are limited), never /tmp/ray.
    os.environ["RAY_TMPDIR"] = tempfile.mkdtemp(prefix="rlmn")
    os.makedirs(os.path.join(os.environ["RAY_TMPDIR"], "ray"))
    small_store = 150 * 2**20
    cluster = Cluster(
        initialize_head=True,
        head_node_args={
            "num_cpus": 4,
            "object_store_memory": small_store,
            "include_dashboard": False,
        },
    )
    for _ in range(2):
        cluster.add_node(
            num_cpus=4,
            resources={"fake_gpu": FAKE_GPUS_PER_NODE},
            labels={POOL_LABEL: "gpu"},
            object_store_memory=small_store,
        )
    for _ in range(2):
        cluster.add_node(num_cpus=2, labels={POOL_LABEL: "cheap"}, object_store_memory=small_store)
    cluster.wait_for_nodes()
    ray.init(address=cluster.address)
    grpc_port = free_port()
    start_serve(grpc_port)
    labels = {
        node["NodeID"]: dict(node.get("Labels") or {}) for node in ray.nodes() if node["Alive"]
    }
    raylets = {
        node.node_id: node.all_processes["raylet"][0].process.pid
        for node in cluster.list_all_nodes()
    }
    yield PoolCluster(f"127.0.0.1:{grpc_port}", labels, raylets)
    serve.shutdown()
    ray.shutdown()
    cluster.shutdown()
