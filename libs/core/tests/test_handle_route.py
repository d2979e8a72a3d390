"""The handle route (ServiceEndpoint.call_api in rlserve.core.serving) on the session's
real Ray cluster and Serve: a request of the plain API (rlserve.core.api) handed to a
replica through a DeploymentHandle answers what gRPC answers, with the same statuses,
token check and deadline, and the same handler never knows which way it came; it is
reachable from no gRPC port; and a client falls back to gRPC where an app has no such
route."""

import asyncio
import time

import grpc
import pytest
import torch
from ray import serve

from rlserve.core import api
from rlserve.core.batch import Batch
from rlserve.core.rpc import (
    HANDLE_ROUTE_MIN_BYTES,
    ServiceClient,
    call_metadata,
    direct_grpc_target,
    open_channel,
)
from rlserve.core.serving import (
    Answer,
    Call,
    ServiceEndpoint,
    batch_rpc,
    deadline_metadata,
    invalid_argument,
)
from rlserve.v1 import reference_pb2, reference_pb2_grpc

APP = "handle-route-probe"
PLAIN_APP = "handle-route-plain"
HANG_S = 3.0


class Doubler:
    """ComputeRefLogProb answering 2 x input_ids as `ref_log_probs`, the request's
    non-tensors and meta echoed; meta 'mode' asks for an error, a deadline check or a
    hang."""

    @batch_rpc(api.ComputeRefLogProbRequest)
    async def ComputeRefLogProb(self, request: api.ComputeRefLogProbRequest, call: Call):
        batch = request.batch
        mode = batch.meta.get("mode")
        if mode == "invalid":
            raise invalid_argument("batch.tensors['input_ids']", "must be int64")
        if mode == "deadline":
            call.deadline.check("probe")
        if mode == "hang":
            await asyncio.sleep(HANG_S)
        doubled = Batch(
            tensors={"ref_log_probs": batch["input_ids"].float() * 2},
            non_tensors=batch.non_tensors,
            meta={"weights_version": 7},
        )
        return api.BatchAnswer(doubled, {"rows": len(batch)})


@serve.deployment(ray_actor_options={"num_cpus": 0})
class RoutedProbe(Doubler, ServiceEndpoint):
    pass


@serve.deployment(ray_actor_options={"num_cpus": 0})
class GrpcOnlyProbe(Doubler):
    """The same service without the handle route (not a ServiceEndpoint)."""


@pytest.fixture(scope="module")
def apps(serve_cluster):
    serve.run(RoutedProbe.bind(), name=APP, route_prefix=f"/{APP}")
    serve.run(GrpcOnlyProbe.bind(), name=PLAIN_APP, route_prefix=f"/{PLAIN_APP}")
    # Serve publishes a replica's direct-ingress port a controller loop or two after the
    # app is running; the route assertions below are about a client that knows it.
    deadline_s = time.monotonic() + 30
    while not all(direct_grpc_target(app) for app in (APP, PLAIN_APP)):
        assert time.monotonic() < deadline_s, "Serve published no direct route in 30 s"
        time.sleep(0.2)
    yield serve_cluster
    serve.delete(APP)
    serve.delete(PLAIN_APP)


def _batch(rows: int = 5, **meta) -> Batch:
    return Batch(
        tensors={"input_ids": torch.arange(rows * 3, dtype=torch.int64).reshape(rows, 3)},
        non_tensors={"text": [f"row {i}" for i in range(rows)]},
        meta=meta,
    )


async def _call(address: str, app: str, batch: Batch, timeout_s: float = 30.0, **options):
    channel = open_channel(address)
    client = ServiceClient(
        channel,
        reference_pb2_grpc.ReferenceServiceStub,
        app,
        timeout_s,
        handle_min_bytes=0,  # these small batches take the handle route too
        **options,
    )
    try:
        answer = await client.call_api(api.ComputeRefLogProbRequest(batch))
        return answer, client.last_route
    finally:
        await client.close()
        await channel.close()


def test_the_handle_route_answers_what_grpc_answers(apps):
    batch = _batch()
    by_handle = asyncio.run(_call(apps.grpc_address, APP, batch))
    by_grpc = asyncio.run(_call(apps.grpc_address, APP, batch, handle=False))
    assert by_handle[1] == "handle" and by_grpc[1] == "direct"
    for answer, _ in (by_handle, by_grpc):
        assert answer.metrics["rows"] == 5
        assert torch.equal(answer.batch["ref_log_probs"], batch["input_ids"].float() * 2)
        assert answer.batch["text"] == batch["text"]
        assert answer.batch.meta["weights_version"] == 7


def test_a_service_error_keeps_its_status_and_message(apps):
    with pytest.raises(grpc.aio.AioRpcError) as invalid:
        asyncio.run(_call(apps.grpc_address, APP, _batch(mode="invalid")))
    assert invalid.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert invalid.value.details() == "batch.tensors['input_ids']: must be int64"


def test_a_dtype_grpc_could_not_carry_is_invalid_argument_naming_the_tensor(apps):
    odd = Batch(tensors={"input_ids": torch.zeros(2, 3, dtype=torch.float64)})
    with pytest.raises(grpc.aio.AioRpcError) as error:
        asyncio.run(_call(apps.grpc_address, APP, odd))
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    # the message gRPC's codec gives for a tensor it cannot carry
    assert error.value.details().startswith("tensors['input_ids']: dtype torch.float64 is not")


def test_a_call_that_outlives_its_timeout_is_deadline_exceeded_naming_the_app(apps):
    with pytest.raises(grpc.aio.AioRpcError) as error:
        asyncio.run(_call(apps.grpc_address, APP, _batch(mode="hang"), timeout_s=0.5))
    assert error.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert f"on app '{APP}': no answer within 0.5 s" in error.value.details()


def test_the_route_checks_token_deadline_and_what_it_is_handed(apps):
    handle = serve.get_app_handle(APP)
    metadata = tuple(call_metadata(APP))
    no_token: Answer = handle.call_api.remote(
        api.ComputeRefLogProbRequest(_batch()), (("application", APP),)
    ).result()
    assert no_token.code_name == "UNAUTHENTICATED" and no_token.response is None

    past = call_metadata(APP, deadline_metadata(-1.0))  # the token, and a deadline passed
    expired = handle.call_api.remote(
        api.ComputeRefLogProbRequest(_batch(mode="deadline")), tuple(past)
    ).result()
    assert expired.code_name == "DEADLINE_EXCEEDED"
    assert expired.details == "caller's deadline passed during probe"

    not_a_batch = handle.call_api.remote(
        api.ComputeRefLogProbRequest({"input_ids": [1, 2]}), metadata
    ).result()
    assert not_a_batch.code_name == "INVALID_ARGUMENT"
    assert "expected an rlserve Batch, got dict" in not_a_batch.details

    # requests of RPCs this app does not serve, and objects that are no request at all
    others = [api.ComputeValuesRequest(_batch()), api.UpdateCriticRequest(0, _batch())]
    for request in (*others, reference_pb2.ComputeRefLogProbRequest(), "GetInfo", 7):
        refused = handle.call_api.remote(request, metadata).result()
        assert refused.code_name == "UNIMPLEMENTED", request


def test_no_grpc_port_reaches_the_route(apps):
    """The servicers register the proto's RPCs only: the proxy and the replica's own port
    answer UNIMPLEMENTED for call_api, whatever the bytes."""
    targets = [apps.grpc_address, direct_grpc_target(APP)]
    assert targets[1] is not None
    for target in targets:
        with grpc.insecure_channel(target) as channel:
            call = channel.unary_unary("/rlserve.v1.ReferenceService/call_api")
            with pytest.raises(grpc.RpcError) as error:
                call(b"\x80\x04K\x01.", metadata=(("application", APP),), timeout=30)
            assert error.value.code() == grpc.StatusCode.UNIMPLEMENTED, target


def test_a_small_batch_goes_by_grpc_and_a_large_one_by_the_handle(apps):
    async def routes() -> list[str]:
        channel = open_channel(apps.grpc_address)
        client = ServiceClient(channel, reference_pb2_grpc.ReferenceServiceStub, APP, 30.0)
        taken = []
        for rows in (4, HANDLE_ROUTE_MIN_BYTES["direct"] // (3 * 8) + 1):
            answer = await client.call_api(api.ComputeRefLogProbRequest(_batch(rows)))
            assert len(answer.batch) == rows
            taken.append(client.last_route)
        await client.close()
        await channel.close()
        return taken

    assert asyncio.run(routes()) == ["direct", "handle"]


def test_an_app_without_the_route_is_called_by_grpc(apps):
    answer, route = asyncio.run(_call(apps.grpc_address, PLAIN_APP, _batch(rows=2)))
    assert route == "direct"
    assert answer.metrics["rows"] == 2
    assert answer.batch["ref_log_probs"].shape == (2, 3)
