"""Resource pools on a simulated multi-node cluster: every role lands where its pool
says, reading where the replicas and workers actually run; impossible pools fail fast."""

import asyncio
import time

import grpc
import pytest
import ray

from integration_tests.multinode.conftest import FAKE_GPUS_PER_NODE, POOL_LABEL
from integration_tests.support import run_inputs, tiny_run_config
from rlserve.core.placement import PlacementError, release_placement_group, serve_replicas
from rlserve.core.rpc import call_metadata
from rlserve.trainer.deploy import (
    deploy_applications,
    deploy_services,
    remove_application,
    reserve_placement_groups,
    service_args,
    verify_placement,
)
from rlserve.trainer.run import train_on_services
from rlserve.v1 import (
    critic_pb2,
    critic_pb2_grpc,
    reference_pb2,
    reference_pb2_grpc,
    rollout_pb2,
    rollout_pb2_grpc,
)

GPU_WORKER = {"CPU": 1, "fake_gpu": 1}


def _pools(gpu_strategy: str = "STRICT_PACK") -> dict:
    return {
        "pools": {
            "global_pool": {"label_selector": {POOL_LABEL: "gpu"}, "strategy": gpu_strategy},
            "reward_pool": {"label_selector": {POOL_LABEL: "cheap"}},
        },
        "roles": {
            "rollout": {"pool": "global_pool", "worker_resources": GPU_WORKER},
            "critic": {"pool": "global_pool", "worker_resources": GPU_WORKER},
            "reference": {"pool": "global_pool", "worker_resources": GPU_WORKER},
            "reward": {"pool": "reward_pool", "worker_resources": {"CPU": 0.5}},
        },
        "timeout_s": 20,
    }


def _workers(stub, request, metadata):
    response = stub.GetInfo(request, metadata=metadata, timeout=60)
    return [(worker.node_id, worker.pid) for worker in response.info.workers]


def test_every_role_runs_in_its_pool_and_a_step_trains(pool_cluster, embedded, tmp_path):
    config = tiny_run_config(
        tmp_path,
        actor={"workers": 2, "micro_batch_samples": 4},
        reward={"num_replicas": 2},
        trainer={"total_steps": 1},
        placement=_pools(),
    )
    inputs = run_inputs(embedded)
    apps = service_args(config, inputs.model_dir)
    reserve_placement_groups(apps)
    deploy_services(apps, timeout_s=300, replace_different=True)
    where = verify_placement(config, apps)

    gpu_nodes, cheap_nodes = pool_cluster.nodes_in("gpu"), pool_cluster.nodes_in("cheap")
    channel = grpc.insecure_channel(pool_cluster.grpc_address)
    rollout = _workers(
        rollout_pb2_grpc.RolloutServiceStub(channel),
        rollout_pb2.RolloutServiceGetInfoRequest(),
        call_metadata("rollout"),
    )
    critic = _workers(
        critic_pb2_grpc.CriticServiceStub(channel),
        critic_pb2.CriticServiceGetInfoRequest(),
        call_metadata("critic"),
    )
    reference = _workers(
        reference_pb2_grpc.ReferenceServiceStub(channel),
        reference_pb2.ReferenceServiceGetInfoRequest(),
        call_metadata("reference"),
    )
    # STRICT_PACK: actor (training + generation in one process per rank), critic and
    # reference all on one GPU-pool node.
    worker_nodes = {node for node, _ in rollout + critic + reference}
    assert len(rollout) == 2 and len(worker_nodes) == 1 and worker_nodes <= gpu_nodes
    assert {node for node, _ in rollout} == set(where["rollout"])
    # Four workers, one bundle of one fake GPU each, and nothing else holds one.
    assert len(rollout + critic + reference) == 4
    in_use = 2 * FAKE_GPUS_PER_NODE - ray.available_resources().get("fake_gpu", 0)
    assert in_use == 4

    replicas = serve_replicas("reward")
    assert len(replicas) == 2
    assert {replica["node_id"] for replica in replicas} <= cheap_nodes
    assert all(replica["required_resources"].get("fake_gpu", 0) == 0 for replica in replicas)
    assert all(replica["required_resources"].get("GPU", 0) == 0 for replica in replicas)

    summary = asyncio.run(
        train_on_services(config, inputs, tmp_path, pool_cluster.grpc_address, show_progress=False)
    )
    assert summary.steps == 1
    for role in ("rollout", "critic", "reference", "reward"):
        remove_application(role, timeout_s=120)
    assert release_placement_group("rlserve-global_pool")


@pytest.mark.parametrize(
    ("placement", "expected"),
    [
        (
            {"pools": {"p": {"label_selector": {POOL_LABEL: "tpu"}}}},
            r"pool 'p': no alive node carries the labels \{'rlserve.io/pool': 'tpu'\}",
        ),
        (
            {"pools": {"p": {"label_selector": {POOL_LABEL: "gpu"}}}, "worker": {"fake_gpu": 8}},
            r"pool 'p': bundle 0 \{'fake_gpu': 8\.0\} fits on none of its 2 node\(s\); missing "
            r"on the closest node: \{'fake_gpu': 'need 8, have 4'\}",
        ),
        (
            {"pools": {"p": {"label_selector": {POOL_LABEL: "gpu"}, "strategy": "STRICT_PACK"}}},
            r"pool 'p': STRICT_PACK puts all 6 bundles .* on one node, but no node of the pool",
        ),
        (
            {"pools": {"p": {"label_selector": {POOL_LABEL: "cheap"}}}, "worker": {"CPU": 1}},
            r"pool 'p': its 2 node\(s\) together lack \{'CPU': 'need 6, have 4'\}",
        ),
    ],
    ids=[
        "no_node_has_the_label",
        "bundle_bigger_than_any_node",
        "strict_pack_too_big",
        "pool_too_small",
    ],
)
def test_impossible_placement_fails_at_once_naming_pool_and_shortfall(
    pool_cluster, embedded, tmp_path, placement, expected
):
    worker = placement.pop("worker", GPU_WORKER)
    config = tiny_run_config(
        tmp_path,
        actor={"workers": 6, "micro_batch_samples": 1, "ppo_mini_batch_prompts": 6},
        trainer={"prompts_per_step": 24},
        placement={**placement, "roles": {"rollout": {"pool": "p", "worker_resources": worker}}},
    )
    apps = service_args(config, run_inputs(embedded).model_dir)
    started = time.monotonic()
    with pytest.raises(PlacementError, match=expected):
        reserve_placement_groups(apps)
    assert time.monotonic() - started < 5


def test_a_service_deployed_alone_fails_its_deployment_with_the_reason(pool_cluster, embedded):
    # No trainer reserved the group: the replica checks the pool itself, and Serve reports
    # the failed deployment instead of leaving workers pending forever.
    args = {
        "model_path": str(embedded.model_dir),
        "placement": {
            "group_name": "rlserve-alone",
            "pool": "nowhere",
            "bundles": [GPU_WORKER],
            "label_selector": {POOL_LABEL: "nowhere"},
        },
    }
    app = {
        "name": "reference",
        "route_prefix": "/reference",
        "import_path": "rlserve.reference.app:build_app",
        "args": args,
    }
    with pytest.raises(RuntimeError, match=r"pool 'nowhere': no alive node carries the labels"):
        deploy_applications([app], timeout_s=120)
    remove_application("reference", timeout_s=60)


def test_resources_held_by_other_work_time_out_with_what_is_free(pool_cluster, embedded, tmp_path):
    hog = ray.util.placement_group(
        [{"fake_gpu": FAKE_GPUS_PER_NODE}] * 2, strategy="SPREAD", name="hog"
    )
    assert hog.wait(30)
    config = tiny_run_config(
        tmp_path,
        placement={
            "pools": {"p": {"label_selector": {POOL_LABEL: "gpu"}}},
            "roles": {"rollout": {"pool": "p", "worker_resources": GPU_WORKER}},
            "timeout_s": 2,
        },
    )
    apps = service_args(config, run_inputs(embedded).model_dir)
    try:
        with pytest.raises(PlacementError, match=r"not placed within 2 s: .* other work holds"):
            reserve_placement_groups(apps)
        assert not release_placement_group("rlserve-p")  # the failed group was removed
    finally:
        ray.util.remove_placement_group(hog)


def test_critic_spread_onto_another_node_than_the_actor(pool_cluster, embedded, tmp_path):
    config = tiny_run_config(
        tmp_path,
        algorithm={"kl_ctrl": {"kl_coef": 0.0}},  # no reference: actor and critic only
        placement={
            "pools": {"gpu": {"label_selector": {POOL_LABEL: "gpu"}, "strategy": "STRICT_SPREAD"}},
            "roles": {
                "rollout": {"pool": "gpu", "worker_resources": GPU_WORKER},
                "critic": {"pool": "gpu", "worker_resources": GPU_WORKER},
            },
        },
    )
    apps = service_args(config, run_inputs(embedded).model_dir)
    assert set(apps) == {"rollout", "critic", "reward"}
    reserve_placement_groups(apps)
    deploy_services(apps, timeout_s=300, replace_different=True)
    where = verify_placement(config, apps)
    channel = grpc.insecure_channel(pool_cluster.grpc_address)
    actor_nodes = {
        node
        for node, _ in _workers(
            rollout_pb2_grpc.RolloutServiceStub(channel),
            rollout_pb2.RolloutServiceGetInfoRequest(),
            call_metadata("rollout"),
        )
    }
    critic_nodes = {
        node
        for node, _ in _workers(
            critic_pb2_grpc.CriticServiceStub(channel),
            critic_pb2.CriticServiceGetInfoRequest(),
            call_metadata("critic"),
        )
    }
    assert actor_nodes == set(where["rollout"]) and critic_nodes == set(where["critic"])
    assert actor_nodes | critic_nodes <= pool_cluster.nodes_in("gpu")
    assert not actor_nodes & critic_nodes
    for role in ("rollout", "critic", "reward"):
        remove_application(role, timeout_s=120)
    assert release_placement_group("rlserve-gpu")
