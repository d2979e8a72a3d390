"""rpc_method and Deadline through a real Serve gRPC proxy (ReferenceService contract)."""

import asyncio
import time

import grpc
import pytest
from ray import serve

from rlserve.core import rpc
from rlserve.core.batch import Batch
from rlserve.core.cluster import DIRECT_GRPC_PORTS, free_port
from rlserve.core.codec import batch_from_proto, batch_to_proto
from rlserve.core.placement import serve_replicas
from rlserve.core.rpc import (
    RetryPolicy,
    ServiceClient,
    call_metadata,
    direct_grpc_target,
    open_channel,
)
from rlserve.core.serving import (
    Deadline,
    RpcError,
    deadline_metadata,
    invalid_argument,
    rpc_method,
    until_deadline,
)
from rlserve.v1 import reference_pb2, reference_pb2_grpc

APP = "serving-probe"
HANG_S = 3.0


@serve.deployment
class ProbeDeployment:
    """Answers ComputeRefLogProb according to the batch's meta 'mode'; metrics["rows"] =
    the batch's rows + `rows_offset` (which app answered)."""

    def __init__(self, rows_offset: int = 0):
        self.rows_offset = rows_offset

    @rpc_method(reference_pb2.ComputeRefLogProbResponse)
    async def ComputeRefLogProb(self, request, call):
        batch: Batch = batch_from_proto(request.batch)
        mode = batch.meta.get("mode")
        if mode == "invalid":
            raise invalid_argument("batch.tensors['input_ids']", "must be int64")
        if mode == "crash":
            raise RuntimeError("überraschung " + "ß" * 20000)
        if mode == "deadline":
            call.deadline.check("probe")
        if mode == "hang":
            await asyncio.sleep(HANG_S)
        return reference_pb2.ComputeRefLogProbResponse(
            metrics={"rows": len(batch) + self.rows_offset}
        )


@pytest.fixture(scope="module")
def stub(serve_cluster):
    serve.run(ProbeDeployment.bind(), name=APP, route_prefix=f"/{APP}")
    channel = serve_cluster.channel()
    yield reference_pb2_grpc.ReferenceServiceStub(channel)
    serve.delete(APP)
    channel.close()


def _call(stub, mode=None, timeout_s=30.0, extra_metadata=()):
    from rlserve.core.codec import batch_to_proto

    meta = {"mode": mode} if mode else {}
    request = reference_pb2.ComputeRefLogProbRequest(batch=batch_to_proto(Batch(meta=meta)))
    return stub.ComputeRefLogProb(
        request, metadata=call_metadata(APP, *extra_metadata), timeout=timeout_s
    )


def test_ok_then_errors_then_ok(stub):
    assert _call(stub).metrics["rows"] == 0
    with pytest.raises(grpc.RpcError) as invalid:
        _call(stub, "invalid")
    assert invalid.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert invalid.value.details() == "batch.tensors['input_ids']: must be int64"

    with pytest.raises(grpc.RpcError) as crash:
        _call(stub, "crash")
    assert crash.value.code() == grpc.StatusCode.INTERNAL
    assert crash.value.details().startswith("ComputeRefLogProb failed: RuntimeError: überraschung")
    assert "Traceback" not in crash.value.details()
    assert crash.value.details().endswith("...")
    assert _call(stub).metrics["rows"] == 0  # the replica keeps serving


def test_malformed_tensor_is_invalid_argument(stub):
    from rlserve.v1 import common_pb2

    request = reference_pb2.ComputeRefLogProbRequest()
    request.batch.tensors["x"].CopyFrom(
        common_pb2.Tensor(dtype=common_pb2.DTYPE_FLOAT32, shape=[3], data=b"\0" * 5)
    )
    with pytest.raises(grpc.RpcError) as error:
        stub.ComputeRefLogProb(request, metadata=call_metadata(APP), timeout=30)
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "tensors['x'].data" in error.value.details()


def test_caller_deadline_reaches_the_replica(stub):
    assert _call(stub, "deadline", extra_metadata=(deadline_metadata(30.0),)).metrics["rows"] == 0
    with pytest.raises(grpc.RpcError) as error:
        _call(stub, "deadline", extra_metadata=(deadline_metadata(-1.0),))
    assert error.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert "deadline passed during probe" in error.value.details()


def test_a_call_that_times_out_names_service_rpc_app_and_replica(stub, serve_cluster):
    async def hang() -> grpc.aio.AioRpcError:
        channel = open_channel(serve_cluster.grpc_address)
        client = ServiceClient(
            channel, reference_pb2_grpc.ReferenceServiceStub, APP, 0.5, RetryPolicy(retries=5)
        )
        request = reference_pb2.ComputeRefLogProbRequest(
            batch=batch_to_proto(Batch(meta={"mode": "hang"}))
        )
        started = time.monotonic()
        with pytest.raises(grpc.aio.AioRpcError) as error:
            await client.call("ComputeRefLogProb", request)
        assert time.monotonic() - started < HANG_S  # within its deadline, and not retried
        await channel.close()
        return error.value

    error = asyncio.run(hang())
    (replica,) = serve_replicas(APP)
    assert error.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    details = error.details()
    assert details.startswith(
        f"ReferenceService.ComputeRefLogProb on app '{APP}': no answer within 0.5 s"
    )
    assert f"held by replica {replica['replica_id']}" in details
    assert f"pid {replica['pid']}" in details
    assert _call(stub).metrics["rows"] == 0  # the replica serves on


def _probe_request() -> reference_pb2.ComputeRefLogProbRequest:
    return reference_pb2.ComputeRefLogProbRequest(batch=batch_to_proto(Batch()))


async def _client_call(proxy_address: str, retries: int):
    channel = open_channel(proxy_address)
    client = ServiceClient(
        channel,
        reference_pb2_grpc.ReferenceServiceStub,
        APP,
        10.0,
        RetryPolicy(retries=retries, initial_backoff_s=0.01),
    )
    try:
        return await client.call("ComputeRefLogProb", _probe_request())
    finally:
        await client.close()
        await channel.close()


def test_a_client_on_the_cluster_calls_the_replica_directly(stub):
    target = direct_grpc_target(APP)
    assert target is not None
    assert int(target.rsplit(":", 1)[1]) in DIRECT_GRPC_PORTS
    # No proxy listens at this address: the call can only have taken the direct route.
    no_proxy = f"127.0.0.1:{free_port()}"
    assert asyncio.run(_client_call(no_proxy, retries=0)).metrics["rows"] == 0


@pytest.fixture
def other_app(serve_cluster):
    app = "serving-probe-other"
    serve.run(ProbeDeployment.bind(rows_offset=100), name=app, route_prefix=f"/{app}")
    yield app
    serve.delete(app)


def test_a_dead_direct_route_falls_back_to_the_proxy(stub, serve_cluster, monkeypatch):
    dead = f"127.0.0.1:{free_port()}"
    monkeypatch.setattr(rpc, "direct_grpc_target", lambda app: dead)
    # retries=0: the proxy answers within the first attempt
    assert asyncio.run(_client_call(serve_cluster.grpc_address, retries=0)).metrics["rows"] == 0


def test_a_route_to_another_apps_replica_falls_back_to_the_proxy(
    stub, serve_cluster, other_app, monkeypatch
):
    """A port Serve gave to another app's replica after a replacement: Serve's own check
    answers NOT_FOUND there, and the call goes through the proxy to its own app."""
    other = direct_grpc_target(other_app)
    assert other is not None and other != direct_grpc_target(APP)
    monkeypatch.setattr(rpc, "direct_grpc_target", lambda app: other)
    # 0 rows: answered by APP (the other app would add 100)
    assert asyncio.run(_client_call(serve_cluster.grpc_address, retries=0)).metrics["rows"] == 0


def test_an_app_with_several_replicas_has_no_direct_route(serve_cluster):
    app = "serving-probe-pair"
    serve.run(
        ProbeDeployment.options(num_replicas=2, ray_actor_options={"num_cpus": 0}).bind(),
        name=app,
        route_prefix=f"/{app}",
    )
    try:
        assert len(serve_replicas(app)) == 2
        assert direct_grpc_target(app) is None  # the proxy balances them
    finally:
        serve.delete(app)


def test_unparsable_deadline_is_invalid_argument():
    with pytest.raises(Exception, match="rlserve-deadline-unix-s: not a number"):
        Deadline.from_metadata([("rlserve-deadline-unix-s", "soon")])
    assert Deadline.from_metadata([]).remaining_s() == float("inf")


def test_until_deadline_stops_before_the_next_item_once_the_deadline_has_passed():
    assert list(until_deadline(range(3), None, "work")) == [0, 1, 2]
    assert list(until_deadline(range(3), time.time() + 60, "work")) == [0, 1, 2]
    done = []
    with pytest.raises(RpcError) as error:
        for item in until_deadline(range(10), time.time() + 0.05, "ComputeValues"):
            done.append(item)
            time.sleep(0.03)
    assert error.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
    assert error.value.message == "caller's deadline passed during ComputeValues"
    assert 1 <= len(done) <= 3  # stopped between items, well before all ten
