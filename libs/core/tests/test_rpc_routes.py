"""ServiceClient's routes without a cluster: choose_route's table (facts -> route, one row
per branch), then the client's retry loop over fake transports (stubs and a Serve
handle that answer as scripted): stale direct routes and Ray-failed handles fall back
within the attempt, service statuses are retried or raised per the policy, and each
call is counted once by the route that answered it."""

import asyncio
from typing import Any

import grpc
import pytest
import torch

from rlserve.core import api, rpc
from rlserve.core.batch import Batch
from rlserve.core.rpc import HANDLE_ROUTE_MIN_BYTES, RetryPolicy, ServiceClient
from rlserve.core.rpc_routes import RouteFacts, choose_route
from rlserve.core.serving import Answer
from rlserve.v1 import reference_pb2

DIRECT = HANDLE_ROUTE_MIN_BYTES["direct"]
PROXY = HANDLE_ROUTE_MIN_BYTES["proxy"]
MIB = 2**20

# (facts, route): every branch of choose_route
ROUTE_TABLE = [
    # no batch: a gRPC route, direct when known, whatever the handle and the sizes
    (RouteFacts(), "proxy"),
    (RouteFacts(direct_known=True), "direct"),
    (RouteFacts(direct_known=True, handle_available=True, response_bytes=64 * MIB), "direct"),
    (RouteFacts(handle_available=True, response_bytes=64 * MIB), "proxy"),
    # a batch: the handle from the threshold of the gRPC route it would take
    (RouteFacts(has_batch=True, request_bytes=1024, direct_known=True), "direct"),
    (RouteFacts(True, 1024, direct_known=True, handle_available=True), "direct"),
    (RouteFacts(True, DIRECT - 1, direct_known=True, handle_available=True), "direct"),
    (RouteFacts(True, DIRECT, direct_known=True, handle_available=True), "handle"),
    (RouteFacts(True, 1 * MIB, direct_known=True, handle_available=True), "direct"),
    (RouteFacts(True, 1 * MIB, handle_available=True), "handle"),
    (RouteFacts(True, PROXY - 1, handle_available=True), "proxy"),
    (RouteFacts(True, PROXY, handle_available=True), "handle"),
    # ... or the response's estimated bytes when larger
    (RouteFacts(True, 1024, DIRECT - 1, direct_known=True, handle_available=True), "direct"),
    (RouteFacts(True, 1024, DIRECT, direct_known=True, handle_available=True), "handle"),
    (RouteFacts(True, 0, PROXY, handle_available=True), "handle"),
    # no handle at hand, or the handle route off: gRPC however large
    (RouteFacts(True, 64 * MIB, direct_known=True), "direct"),
    (RouteFacts(True, 64 * MIB), "proxy"),
    (RouteFacts(True, 64 * MIB, handle_enabled=False, handle_available=True), "proxy"),
    (
        RouteFacts(True, 64 * MIB, handle_enabled=False, handle_available=True, direct_known=True),
        "direct",
    ),
    # the client's own threshold in place of HANDLE_ROUTE_MIN_BYTES
    (RouteFacts(True, 0, handle_min_bytes=0, handle_available=True, direct_known=True), "handle"),
    (RouteFacts(True, 4 * MIB, handle_min_bytes=8 * MIB, handle_available=True), "proxy"),
    (RouteFacts(True, 8 * MIB, handle_min_bytes=8 * MIB, handle_available=True), "handle"),
    # the attempt's route just failed: a stale direct route -> the proxy, even for a
    # batch the handle would take; a Ray-failed handle -> its gRPC route at once
    (RouteFacts(failed="direct", direct_known=True), "proxy"),
    (RouteFacts(True, 64 * MIB, handle_available=True, failed="direct"), "proxy"),
    (
        RouteFacts(True, 64 * MIB, handle_available=True, direct_known=True, failed="handle"),
        "direct",
    ),
    (RouteFacts(True, 64 * MIB, handle_available=True, failed="handle"), "proxy"),
]


@pytest.mark.parametrize(("facts", "route"), ROUTE_TABLE)
def test_route_table(facts: RouteFacts, route: str):
    assert choose_route(facts) == route


# --- the client over fake transports ---------------------------------------------------

PROXY_CHANNEL = object()
RPC = "ComputeRefLogProb"


def _status(code: grpc.StatusCode, details: str = "scripted") -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details)


class Script:
    """What each route answers, in order (an AioRpcError raises, a Ray failure is any
    other exception on the handle, anything else answers), and what was asked."""

    def __init__(self, **answers: list[Any]):
        self.answers = {route: list(items) for route, items in answers.items()}
        self.tried: list[str] = []
        self.lookups = {"direct": 0, "handle": 0}

    def answer(self, route: str) -> Any:
        self.tried.append(route)
        outcome = self.answers[route].pop(0)
        if isinstance(outcome, BaseException):
            raise outcome
        return outcome


def _stub_cls(script: Script) -> type:
    class ReferenceServiceStub:  # the name says the service (responses, span names)
        def __init__(self, channel):
            self.route = "proxy" if channel is PROXY_CHANNEL else "direct"

        async def ComputeRefLogProb(self, request, metadata, timeout):
            return script.answer(self.route)

        async def GenerateSequences(self, request, metadata, timeout):
            return script.answer(self.route)

    return ReferenceServiceStub


class _Pending:
    """A DeploymentResponse's part the client uses: awaitable, cancellable."""

    def __init__(self, script: Script, batch: Batch):
        self.script, self.batch = script, batch

    def __await__(self):
        return self._result().__await__()

    async def _result(self) -> Answer:
        outcome = self.script.answer("handle")
        if isinstance(outcome, Answer):
            return outcome
        return Answer("OK", "", api.BatchAnswer(self.batch, dict(outcome.metrics)))

    def cancel(self) -> None:
        pass


class FakeHandle:
    def __init__(self, script: Script):
        self.script = script
        self.call_api = self

    def remote(self, request, metadata):
        assert isinstance(request, api.BATCH_REQUESTS)
        assert {key for key, _ in metadata} >= {"application"}
        return _Pending(self.script, request.batch)


@pytest.fixture
def script(monkeypatch) -> Script:
    script = Script()

    def direct_grpc_target(app: str) -> str | None:
        script.lookups["direct"] += 1
        return "127.0.0.1:1" if "direct" in script.answers else None

    def app_handle(app: str) -> FakeHandle | None:
        script.lookups["handle"] += 1
        return FakeHandle(script) if "handle" in script.answers else None

    monkeypatch.setattr(rpc, "direct_grpc_target", direct_grpc_target)
    monkeypatch.setattr(rpc, "app_handle", app_handle)
    return script


def _ok() -> reference_pb2.ComputeRefLogProbResponse:
    return reference_pb2.ComputeRefLogProbResponse(metrics={"rows": 1.0})


def _batch(nbytes: int = 1024) -> Batch:
    return Batch(tensors={"input_ids": torch.zeros(nbytes // 8, dtype=torch.int64)})


async def _run(
    script: Script, calls: list[Batch | None], retries: int = 0, timeout_s: float = 5.0, **options
) -> tuple[ServiceClient, list[Any]]:
    client = ServiceClient(
        PROXY_CHANNEL,
        _stub_cls(script),
        "reference",
        timeout_s,
        RetryPolicy(retries=retries, initial_backoff_s=0.001),
        **options,
    )
    outcomes: list[Any] = []
    try:
        for batch in calls:
            try:
                if batch is None:
                    outcomes.append(
                        await client.call(RPC, reference_pb2.ComputeRefLogProbRequest())
                    )
                else:
                    outcomes.append(await client.call_api(api.ComputeRefLogProbRequest(batch)))
            except grpc.aio.AioRpcError as error:
                outcomes.append(error)
    finally:
        await client.close()
    return client, outcomes


@pytest.mark.parametrize(
    "code", [grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.NOT_FOUND, grpc.StatusCode.CANCELLED]
)
def test_a_stale_direct_route_goes_to_the_proxy_within_the_attempt(script, code):
    script.answers = {"direct": [_status(code)], "proxy": [_ok(), _ok()]}
    client, outcomes = asyncio.run(_run(script, [None, None], retries=0))
    assert [o.metrics["rows"] for o in outcomes] == [1.0, 1.0]
    # the next call too by the proxy, the route looked up again only after the interval
    assert script.tried == ["direct", "proxy", "proxy"]
    assert script.lookups["direct"] == 1
    assert client.last_route == "proxy" and client.calls_by_route == {"proxy": 2}


def test_a_direct_route_that_answers_is_kept(script):
    script.answers = {"direct": [_ok(), _ok()], "proxy": []}
    client, _ = asyncio.run(_run(script, [None, None]))
    assert script.tried == ["direct", "direct"] and script.lookups["direct"] == 1
    assert client.last_route == "direct" and client.calls_by_route == {"direct": 2}


def test_a_service_status_on_the_direct_route_is_the_services(script):
    """INTERNAL (a replica that died) is retried, by the direct route again."""
    script.answers = {"direct": [_status(grpc.StatusCode.INTERNAL), _ok()], "proxy": []}
    client, outcomes = asyncio.run(_run(script, [None], retries=1))
    assert outcomes[0].metrics["rows"] == 1.0
    assert script.tried == ["direct", "direct"]
    assert client.calls_by_route == {"direct": 1}  # answered after a retry: counted once


def test_a_call_that_found_its_direct_route_stale_retries_by_the_proxy(script, monkeypatch):
    monkeypatch.setattr(rpc, "DIRECT_LOOKUP_INTERVAL_S", 0.0)  # a lookup every attempt
    script.answers = {
        "direct": [_status(grpc.StatusCode.NOT_FOUND), _ok()],
        "proxy": [_status(grpc.StatusCode.UNAVAILABLE), _ok()],
    }
    client, outcomes = asyncio.run(_run(script, [None, None], retries=1))
    assert all(o.metrics["rows"] == 1.0 for o in outcomes)
    # first call: direct (stale) + proxy in attempt 0, proxy in attempt 1 (no lookup);
    # second call: a new lookup, direct again
    assert script.tried == ["direct", "proxy", "proxy", "direct"]
    assert script.lookups["direct"] == 2
    assert client.calls_by_route == {"proxy": 1, "direct": 1}


def test_retries_run_out_on_the_last_status(script):
    script.answers = {"proxy": [_status(grpc.StatusCode.UNAVAILABLE, f"try {i}") for i in range(3)]}
    client, (error,) = asyncio.run(_run(script, [None], retries=2, direct=False))
    assert error.code() == grpc.StatusCode.UNAVAILABLE and error.details() == "try 2"
    assert script.tried == ["proxy"] * 3 and script.lookups["direct"] == 0
    assert client.last_route is None and not client.calls_by_route


def test_a_status_not_worth_retrying_raises_at_once(script):
    script.answers = {"proxy": [_status(grpc.StatusCode.INVALID_ARGUMENT)]}
    _, (error,) = asyncio.run(_run(script, [None], retries=2))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and script.tried == ["proxy"]


def test_a_deadline_is_never_retried_and_names_the_call(script):
    script.answers = {"proxy": [_status(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded")]}
    _, (error,) = asyncio.run(_run(script, [None], retries=2, timeout_s=0.5))
    assert error.code() == grpc.StatusCode.DEADLINE_EXCEEDED and script.tried == ["proxy"]
    assert error.details().startswith(
        "ReferenceService.ComputeRefLogProb on app 'reference': no answer within 0.5 s"
    )


def test_a_large_batch_goes_by_the_handle_and_a_small_one_by_grpc(script):
    script.answers = {"direct": [_ok()], "handle": [_ok()], "proxy": []}
    big, small = _batch(DIRECT), _batch(1024)
    client, outcomes = asyncio.run(_run(script, [small, big]))
    assert script.tried == ["direct", "handle"]
    assert script.lookups["handle"] == 1  # looked up only when it would be taken
    assert not outcomes[0].batch.tensors  # the scripted gRPC response carries an empty batch
    assert outcomes[1].batch is big  # the Batch itself came back by the handle
    assert client.calls_by_route == {"direct": 1, "handle": 1}


def test_no_handle_found_means_grpc_and_a_lookup_later(script):
    script.answers = {"proxy": [_ok(), _ok()]}  # no "handle": app_handle finds none
    client, _ = asyncio.run(_run(script, [_batch(DIRECT), _batch(DIRECT)]))
    assert script.tried == ["proxy", "proxy"] and script.lookups["handle"] == 1
    assert client.last_route == "proxy"


def test_a_handle_failing_in_ray_goes_by_grpc_at_once(script):
    script.answers = {"direct": [_ok(), _ok()], "handle": [RuntimeError("replica died")]}
    client, outcomes = asyncio.run(_run(script, [_batch(DIRECT), _batch(DIRECT)], retries=0))
    assert all(answer.metrics["rows"] == 1.0 for answer in outcomes)
    # within the attempt, and the next call too by gRPC: the handle is looked up again
    # only after the interval
    assert script.tried == ["handle", "direct", "direct"]
    assert script.lookups["handle"] == 1
    assert client.calls_by_route == {"direct": 2}


def test_a_failed_handle_then_a_stale_direct_route_ends_at_the_proxy(script):
    script.answers = {
        "handle": [RuntimeError("replica died")],
        "direct": [_status(grpc.StatusCode.UNAVAILABLE)],
        "proxy": [_ok()],
    }
    client, _ = asyncio.run(_run(script, [_batch(DIRECT)], retries=0))
    assert script.tried == ["handle", "direct", "proxy"]
    assert client.last_route == "proxy" and client.calls_by_route == {"proxy": 1}


def test_a_service_status_by_the_handle_is_the_services(script):
    invalid = Answer("INVALID_ARGUMENT", "batch: bad")
    unavailable = Answer("UNAVAILABLE", "starting")
    script.answers = {"handle": [invalid, unavailable, _ok()], "proxy": []}
    client, (error, response) = asyncio.run(
        _run(script, [_batch(), _batch()], retries=1, handle_min_bytes=0)
    )
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and error.details() == "batch: bad"
    assert response.metrics["rows"] == 1.0  # UNAVAILABLE retried, by the handle again
    assert script.tried == ["handle"] * 3
    assert client.calls_by_route == {"handle": 1}


def test_the_handle_route_off_keeps_every_batch_on_grpc(script):
    script.answers = {"direct": [_ok()], "handle": []}
    client, _ = asyncio.run(_run(script, [_batch(DIRECT)], handle=False))
    assert script.tried == ["direct"] and script.lookups["handle"] == 0
    assert client.last_route == "direct"


def _generation(prompts: int, max_new_tokens: int) -> api.GenerateSequencesRequest:
    ids = torch.zeros(prompts, 4, dtype=torch.int64)
    batch = Batch(tensors={"input_ids": ids, "attention_mask": ids})
    return api.GenerateSequencesRequest(batch, api.Sampling(1.0, max_new_tokens))


def test_a_small_request_expecting_a_large_answer_goes_by_the_handle(script):
    """A generation's prompts are small, its answer is not (`response_bytes`): the
    route suits the answer."""
    small, large = _generation(2, 4), _generation(2, DIRECT)
    assert small.response_bytes() == 4 * 2 * (4 + 4) * 8 < DIRECT <= large.response_bytes()
    script.answers = {"direct": [_ok()], "handle": [_ok()], "proxy": []}

    async def routes() -> list[str]:
        client = ServiceClient(PROXY_CHANNEL, _stub_cls(script), "rollout", 5.0)
        taken = []
        for request in (small, large):
            await client.call_api(request)
            taken.append(client.last_route)
        await client.close()
        return taken

    assert asyncio.run(routes()) == ["direct", "handle"]
