"""A local run's Ray cluster refuses callers without its token.

Ray binds its processes' gRPC ports on every interface; `rlserve train` without
trainer.ray_address therefore starts its cluster with Ray's token auth on and a token of
the run's own (rlserve.trainer.run.close_local_ray_ports). Checked from outside: raw
gRPC calls to the GCS and the raylet of a cluster started as a run starts it, with no
token, get UNAUTHENTICATED; the same call to this test session's cluster (auth off, as
the test fixtures run it) gets past authentication, so the probe can tell the two apart.
"""

import json
import os
import subprocess
import sys

import grpc
import pytest
import ray

pytestmark = pytest.mark.slow

STARTS_A_RUNS_CLUSTER = """
import json, sys
from pathlib import Path
import ray
from rlserve.core.config import validate_config
from rlserve.core.run_config import RunConfig
from rlserve.trainer.run import start_ray

start_ray(validate_config(RunConfig, {}), Path(sys.argv[1]))
node = ray.nodes()[0]
print(json.dumps({"gcs": ray.get_runtime_context().gcs_address,
                  "raylet": f"{node['NodeManagerAddress']}:{node['NodeManagerPort']}"}),
      flush=True)
sys.stdin.read()  # keeps the cluster up until the test closes stdin
ray.shutdown()
"""
# Any method: authentication runs before the request is parsed.
PROBES = {
    "gcs": "/ray.rpc.NodeInfoGcsService/GetAllNodeInfo",
    "raylet": "/ray.rpc.NodeManagerService/GetNodeStats",
}


def _status_without_token(address: str, method: str) -> grpc.StatusCode:
    with grpc.insecure_channel(address) as channel:
        call = channel.unary_unary(method)
        try:
            call(b"", timeout=10)
        except grpc.RpcError as error:
            return error.code()
    return grpc.StatusCode.OK


def test_a_local_runs_cluster_refuses_calls_without_its_token(serve_cluster, tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN")}
    run = subprocess.Popen(
        [sys.executable, "-c", STARTS_A_RUNS_CLUSTER, str(tmp_path / "run")],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env,
    )  # fmt: skip
    try:
        addresses = json.loads(run.stdout.readline())
        for process, method in PROBES.items():
            assert _status_without_token(addresses[process], method) == (
                grpc.StatusCode.UNAUTHENTICATED
            ), process
    finally:
        run.stdin.close()
        run.wait(timeout=60)
    # the control: the same probe gets past a cluster without token auth
    gcs = ray.get_runtime_context().gcs_address
    assert _status_without_token(gcs, PROBES["gcs"]) != grpc.StatusCode.UNAUTHENTICATED
