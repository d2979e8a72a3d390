"""The environment service scaled out on the simulated cheap pool: four replicas of one
CPU each fill both cheap nodes (and no other), and 64 concurrent clients through Serve's
gRPC proxy all get their answers."""

import json
from concurrent.futures import ThreadPoolExecutor

import grpc
from ray import serve

from integration_tests.multinode.conftest import POOL_LABEL
from rlserve.core.placement import serve_replicas
from rlserve.core.rpc import call_metadata
from rlserve.environment.app import build_app
from rlserve.v1 import environment_pb2, environment_pb2_grpc

APP = "environment"


def test_replicas_fill_the_cheap_pool_and_serve_64_clients(pool_cluster):
    serve.run(
        build_app(
            {
                "num_replicas": 4,
                "num_cpus_per_replica": 1.0,
                "placement": {"label_selector": {POOL_LABEL: "cheap"}},
            }
        ),
        name=APP,
        route_prefix=f"/{APP}",
    )
    try:
        replicas = serve_replicas(APP)
        assert len(replicas) == 4
        assert {replica["node_id"] for replica in replicas} == pool_cluster.nodes_in("cheap")
        assert all(replica["required_resources"].get("GPU", 0) == 0 for replica in replicas)

        with grpc.insecure_channel(pool_cluster.grpc_address) as channel:
            stub = environment_pb2_grpc.EnvironmentServiceStub(channel)

            def client(index: int) -> list[bool]:
                answers = []
                for k in range(8):
                    request = environment_pb2.CallToolRequest(
                        session_id=f"c{index}",
                        tool_name="calculator",
                        arguments_json=json.dumps({"expression": f"{index}*{k}-1"}),
                    )
                    answer = stub.CallTool(request, metadata=call_metadata(APP), timeout=60)
                    answers.append(answer.observation == str(index * k - 1))
                return answers

            with ThreadPoolExecutor(64) as pool:
                results = [ok for answers in pool.map(client, range(64)) for ok in answers]
        assert len(results) == 512 and all(results)
    finally:
        serve.delete(APP)
