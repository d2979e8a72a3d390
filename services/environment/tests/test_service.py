"""The environment service through Serve's gRPC proxy, with a plain grpc client.

Two apps on the shared Serve instance:
- APP_SCALED: the calculator on 2 replicas, called by 64 concurrent clients;
- APP_TOOLS: one replica with the sample user tools (sample_tools.py, on the replica's
  PYTHONPATH as a user's package would be installed), for sessions, timeouts, errors.
"""

import json
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest
from ray import serve

from rlserve.core.placement import serve_details, serve_replicas
from rlserve.core.rpc import call_metadata
from rlserve.environment.app import build_app, deployment_options
from rlserve.environment.config import EnvironmentServiceConfig
from rlserve.environment.deployment import EnvironmentDeployment
from rlserve.v1 import environment_pb2, environment_pb2_grpc

TESTS_DIR = str(Path(__file__).resolve().parent)  # sample_tools.py
APP_SCALED = "environment-test-scaled"
APP_TOOLS = "environment-test-tools"
TIMEOUT_S = 60.0
TOOLS = {
    "calculator": {"tool": "calculator"},
    "counter": {"tool": "sample_tools:Counter", "kwargs": {"stop": 2}},
    "sleeper": {"tool": "sample_tools:Sleeper", "timeout_s": 0.5},
    "raiser": {"tool": "sample_tools:Raiser"},
    "python": {"tool": "python"},
}


@pytest.fixture(scope="module")
def stub(serve_cluster):
    serve.run(
        build_app({"num_replicas": 2, "num_cpus_per_replica": 0.5}),
        name=APP_SCALED,
        route_prefix=f"/{APP_SCALED}",
    )
    config = EnvironmentServiceConfig.model_validate({"tools": TOOLS, "num_cpus_per_replica": 0.5})
    options = deployment_options(config)
    options["ray_actor_options"]["runtime_env"]["env_vars"]["PYTHONPATH"] = TESTS_DIR
    serve.run(
        EnvironmentDeployment.options(**options).bind(config.model_dump()),
        name=APP_TOOLS,
        route_prefix=f"/{APP_TOOLS}",
    )
    channel = serve_cluster.channel()
    yield environment_pb2_grpc.EnvironmentServiceStub(channel)
    channel.close()
    serve.delete(APP_SCALED)
    serve.delete(APP_TOOLS)


def _call(stub, tool, arguments, session="s-1", app=APP_TOOLS, row="", metadata=None):
    request = environment_pb2.CallToolRequest(
        session_id=session,
        tool_name=tool,
        arguments_json=json.dumps(arguments),
        tools_kwargs_json=row,
    )
    return stub.CallTool(
        request,
        metadata=call_metadata(app) if metadata is None else metadata,
        timeout=TIMEOUT_S,
    )


def test_64_concurrent_clients_on_two_replicas_all_get_their_answer(stub):
    def client(index: int) -> list[bool]:
        return [
            _call(
                stub, "calculator", {"expression": f"{index}*{k}+1"}, f"c{index}", APP_SCALED
            ).observation
            == str(index * k + 1)
            for k in range(10)
        ]

    with ThreadPoolExecutor(64) as pool:
        results = [ok for answers in pool.map(client, range(64)) for ok in answers]
    assert len(results) == 640 and all(results)
    # both replicas run and answer, each on its own port (Serve's direct ingress)
    replicas = {replica["pid"] for replica in serve_replicas(APP_SCALED)}
    assert len(replicas) == 2
    answered = set()
    for target in _direct_targets(APP_SCALED, 2):
        with grpc.insecure_channel(target) as channel:
            info = environment_pb2_grpc.EnvironmentServiceStub(channel).GetInfo(
                environment_pb2.EnvironmentServiceGetInfoRequest(),
                metadata=call_metadata(APP_SCALED),
                timeout=TIMEOUT_S,
            )
        answered.add(info.info.workers[0].pid)
    assert answered == replicas


def _direct_targets(app: str, count: int) -> list[str]:
    """Each replica's own gRPC address, once Serve publishes them all (a controller loop
    or two after the app runs)."""
    deadline_s = time.monotonic() + 30
    while True:
        targets = [
            f"{target['ip']}:{target['port']}"
            for group in serve_details().get("target_groups") or []
            if group.get("app_name") == app and group.get("protocol") == "gRPC"
            for target in group.get("targets") or []
        ]
        if len(targets) == count:
            return targets
        assert time.monotonic() < deadline_s, f"Serve published {targets} for {app} in 30 s"
        time.sleep(0.2)


def test_a_session_keeps_the_user_tools_state(stub):
    row = json.dumps({"counter": {"start": 5}})
    first = _call(stub, "counter", {}, "state-1", row=row)
    second = _call(stub, "counter", {}, "state-1", row=row)
    assert (first.observation, first.done, second.observation, second.done) == (
        "6",
        True,
        "7",
        True,
    )
    assert first.metrics["counted"] == 1.0 and first.metrics["tool_s"] >= 0
    closed = stub.CloseSession(
        environment_pb2.CloseSessionRequest(session_id="state-1"),
        metadata=call_metadata(APP_TOOLS),
        timeout=TIMEOUT_S,
    )
    assert closed.closed
    assert _call(stub, "counter", {}, "state-1").observation == "1"


def test_tool_failures_are_answers_and_the_replica_keeps_serving(stub):
    assert _call(stub, "sleeper", {"seconds": 30}).error == "timeout"
    failed = _call(stub, "raiser", {})
    assert failed.error == "tool_error" and "the backend is down" in failed.observation
    assert _call(stub, "nope", {}).error == "unknown_tool"
    assert _call(stub, "calculator", {"expression": "6*7"}).observation == "42"


def test_a_malformed_request_is_invalid_argument_and_a_stranger_is_refused(stub):
    with pytest.raises(grpc.RpcError) as bad:
        _call(stub, "calculator", {}, session="../etc")
    assert bad.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert bad.value.details().startswith("session_id: ")
    with pytest.raises(grpc.RpcError) as stranger:
        _call(stub, "calculator", {}, metadata=(("application", APP_TOOLS),))
    assert stranger.value.code() == grpc.StatusCode.UNAUTHENTICATED


def test_get_info_lists_the_tools_schemas(stub):
    info = stub.GetInfo(
        environment_pb2.EnvironmentServiceGetInfoRequest(),
        metadata=call_metadata(APP_TOOLS),
        timeout=TIMEOUT_S,
    )
    assert info.info.role == "environment" and info.info.auth_mode == "token"
    assert set(info.tool_schemas_json) == set(TOOLS)
    schema = json.loads(info.tool_schemas_json["calculator"])
    assert schema["function"]["name"] == "calculator"


def test_the_python_tool_runs_in_the_replicas_sandbox(stub):
    answer = _call(stub, "python", {"code": "import socket\nprint(sum(range(10)))"})
    assert (answer.observation, answer.error) == ("45\n", "")
    refused = _call(
        stub,
        "python",
        {"code": "import urllib.request\nurllib.request.urlopen('http://1.1.1.1', timeout=2)"},
    )
    assert "exit status 1" in refused.observation and refused.error == ""
