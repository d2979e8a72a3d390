"""A service fails closed: without a token in its environment it refuses to start,
unless its config says `auth: none`; GetInfo says which mode it runs in.

The replicas here are real Serve replicas whose environment has the token variables
emptied (a node that joined without the token file), on the session's cluster.
"""

import time

import grpc
import pytest
from ray import serve

from rlserve.core import auth
from rlserve.core.config import validate_config
from rlserve.core.rpc import call_metadata
from rlserve.reward.app import deployment_options
from rlserve.reward.config import RewardServiceConfig
from rlserve.reward.deployment import RewardDeployment
from rlserve.v1 import reward_pb2, reward_pb2_grpc

RULE = {"rule": {"rule_name": "arithmetic_exact_match"}}
NO_TOKEN = {auth.TOKEN_ENV: "", auth.TOKEN_FILE_ENV: ""}


def _start(name: str, env_vars: dict[str, str] | None, **fields) -> None:
    """Starts the reward app `name` without waiting for it (its replica may never start)."""
    config = validate_config(RewardServiceConfig, {"kinds": RULE, **fields})
    options = deployment_options(config)
    if env_vars is not None:
        actor = options["ray_actor_options"]
        options["ray_actor_options"] = {**actor, "runtime_env": {"env_vars": env_vars}}
    app = RewardDeployment.options(**options).bind(config.model_dump())
    serve._run(app, name=name, route_prefix=f"/{name}", _blocking=False)


def _wait_for(name: str, states: set[str], timeout_s: float = 120.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        status = serve.status().applications.get(name)
        if status is not None and status.status in states:
            return status
        time.sleep(0.5)
    raise AssertionError(f"{name} not in {states} after {timeout_s} s")


def _info(serve_cluster, name: str, metadata) -> reward_pb2.RewardServiceGetInfoResponse:
    with serve_cluster.channel() as channel:
        stub = reward_pb2_grpc.RewardServiceStub(channel)
        return stub.GetInfo(reward_pb2.RewardServiceGetInfoRequest(), metadata=metadata, timeout=30)


def test_a_service_without_a_token_refuses_to_start(serve_cluster):
    name = "reward-auth-missing"
    _start(name, NO_TOKEN)
    try:
        status = _wait_for(name, {"DEPLOY_FAILED", "RUNNING"})
        assert status.status == "DEPLOY_FAILED"
        messages = [status.message] + [d.message for d in status.deployments.values()]
        assert any("the reward service has no token" in m for m in messages), messages
        assert any("auth: none" in m for m in messages)
    finally:
        serve.delete(name)


def test_auth_none_answers_anyone_and_says_so(serve_cluster):
    name = "reward-auth-none"
    _start(name, NO_TOKEN, auth="none")
    try:
        _wait_for(name, {"RUNNING"})
        info = _info(serve_cluster, name, [("application", name)])  # no token sent
        assert info.info.auth_mode == "none"
    finally:
        serve.delete(name)


def test_a_service_with_a_token_says_token_and_refuses_callers_without_it(serve_cluster):
    name = "reward-auth-token"
    _start(name, None, auth="none")  # a token in its environment is still required
    try:
        _wait_for(name, {"RUNNING"})
        info = _info(serve_cluster, name, call_metadata(name))
        assert info.info.auth_mode == "token"
        with pytest.raises(grpc.RpcError) as refused:
            _info(serve_cluster, name, [("application", name)])
        assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
    finally:
        serve.delete(name)
