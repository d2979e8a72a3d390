"""The routes a ServiceClient call can take (rlserve.core.rpc), and which one it takes.

`choose_route` is the whole choice, a pure function of one try's facts (RouteFacts: a
batch or not and its tensor bytes, whether the handle route is on and a handle at hand,
whether a direct route is known, and the route the attempt just failed on). The client
gathers the facts (its lookups, its state) and runs the route chosen; when that route
fails without reaching the service it asks again with `failed` set, within the same
attempt.

Each route is a transport of one shape, `attempt(rpc, request, metadata, timeout_s) ->
answer`: GrpcRoute (a stub: the proxy's, or a replica's own port) and HandleRoute (a
Serve DeploymentHandle, served by rlserve.core.serving.ServiceEndpoint). A transport
raises grpc.aio.AioRpcError for a status of the service (or gRPC's own deadline), which
the client's retry policy judges, and RouteFailed when the route itself failed and said
nothing of the service (a direct port with no replica or another app's; Ray failing a
handle call), which the client answers by taking the next route at once.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

import grpc

Route = Literal["handle", "direct", "proxy"]
"""A call's route: a Serve DeploymentHandle, a replica's own gRPC port, Serve's proxy."""
FailedRoute = Literal["handle", "direct"]
"""The routes that can fail without reaching the service (the proxy's failures are the
service's: no replica, a replica restarting)."""

# A direct call failing so says nothing of the service: Serve answers NOT_FOUND on a
# replica's port for another app's call (the port was reused after a replacement), and
# CANCELLED when the replica, being replaced, cancels the call it was running (a call
# this client cancels raises asyncio.CancelledError, never a CANCELLED status).
STALE_ROUTE_CODES = frozenset(
    {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.NOT_FOUND, grpc.StatusCode.CANCELLED}
)
HANDLE_ROUTE_MIN_BYTES: dict[str, int] = {"direct": 2 * 2**20, "proxy": 64 * 2**10}
"""The request tensors' bytes from which `call_api` takes the handle route rather
than each gRPC route (benchmarks/bench_batch_transport.py, replica + 2 workers, in one
run: 12 KiB 4.7 ms direct, 7.7 handle, 7.9 proxy; 1 MiB 10.9, 12.3, 17.6; 4 MiB 24.9,
21.8, 36.3; 64 MiB 349, 75, 552)."""


@dataclass(frozen=True)
class RouteFacts:
    """What the route of one try of a call depends on."""

    has_batch: bool = False
    """The call is one of the plain API's (rlserve.core.api), which carry a Batch."""
    request_bytes: int = 0
    """The request Batch's tensor bytes."""
    response_bytes: int = 0
    """The caller's estimate of the response Batch's tensor bytes (0: no estimate)."""
    handle_enabled: bool = True
    """The client may take the handle route (ServiceClient's `handle`)."""
    handle_min_bytes: int | None = None
    """The client's own threshold for the handle route; None: HANDLE_ROUTE_MIN_BYTES of
    the gRPC route the call would take."""
    handle_available: bool = False
    """The client holds the app's DeploymentHandle, or may look it up now."""
    direct_known: bool = False
    """The client holds a direct route to the app's replica, and this call has not
    found it stale."""
    failed: FailedRoute | None = None
    """The route this attempt just failed on (RouteFailed): "direct" answered a stale
    route code, "handle" failed in Ray itself."""


def choose_route(facts: RouteFacts) -> Route:
    """The route to try: after a stale direct route the proxy, after a handle failure
    the gRPC route, else the handle route for a batch whose bytes (the request's, or the
    response's when estimated larger) reach the threshold of the gRPC route it would
    otherwise take, else that gRPC route (direct when known, else the proxy)."""
    if facts.failed == "direct":
        return "proxy"  # the replica is gone or its port is another app's
    grpc_route: Route = "direct" if facts.direct_known else "proxy"
    if facts.failed == "handle":
        return grpc_route  # at once, without looking the handle up again
    if facts.has_batch and facts.handle_enabled and facts.handle_available:
        min_bytes = facts.handle_min_bytes
        if min_bytes is None:
            min_bytes = HANDLE_ROUTE_MIN_BYTES[grpc_route]
        if max(facts.request_bytes, facts.response_bytes) >= min_bytes:
            return "handle"
    return grpc_route


class RouteFailed(Exception):
    """The route failed without reaching the service: take the next one at once."""


@dataclass
class Outgoing:
    """One call's request: a protobuf message (an RPC without a batch), or a request of
    the plain API (rlserve.core.api), which carries a Batch."""

    request: Any
    _wire: Any = field(default=None, repr=False)

    @property
    def carries_batch(self) -> bool:
        return hasattr(type(self.request), "RESPONSE_PROTO")

    def wire(self) -> Any:
        """The message gRPC sends, the Batch encoded into it (once a call, however many
        attempts)."""
        if not self.carries_batch:
            return self.request
        if self._wire is None:
            self._wire = self.request.to_proto()
        return self._wire

    def from_wire(self, response: Any) -> Any:
        """A gRPC response as the caller gets it: the plain API's answer (its Batch
        decoded) for a request of that API, else the message itself."""
        return type(self.request).Response.from_proto(response) if self.carries_batch else response

    def size_bytes(self) -> int:
        """For the call's span: the Batch's tensor bytes, or the message's size."""
        return self.batch_bytes() if self.carries_batch else self.request.ByteSize()

    def batch_bytes(self) -> int:
        """The Batch's tensor bytes (0 without one)."""
        if not self.carries_batch:
            return 0
        return sum(t.nbytes for t in self.request.batch.tensors.values())


class Transport(Protocol):
    """One route's attempt at a call: its answer (`Outgoing.from_wire`'s form);
    AioRpcError for the service's status, RouteFailed when the route failed."""

    async def attempt(
        self, rpc: str, request: Outgoing, metadata: Sequence[tuple[str, str]], timeout_s: float
    ) -> Any: ...


class GrpcRoute:
    """A call by gRPC on `stub`; a status of `stale_codes` (the direct route's
    STALE_ROUTE_CODES) raises RouteFailed."""

    def __init__(self, stub: Any, stale_codes: frozenset[grpc.StatusCode] = frozenset()):
        self.stub = stub
        self.stale_codes = stale_codes

    async def attempt(
        self, rpc: str, request: Outgoing, metadata: Sequence[tuple[str, str]], timeout_s: float
    ) -> Any:
        try:
            response = await getattr(self.stub, rpc)(
                request.wire(), metadata=metadata, timeout=timeout_s
            )
        except grpc.aio.AioRpcError as error:
            if error.code() in self.stale_codes:
                raise RouteFailed(str(error)) from error
            raise
        return request.from_wire(response)


class HandleRoute:
    """A call by the app's Serve DeploymentHandle (`handle`): the plain API's request
    dataclass, tensors and all, through Ray's object store, answered by the deployment's
    `ServiceEndpoint.call_api` with the response dataclass."""

    def __init__(self, handle: Any):
        self.handle = handle

    async def attempt(
        self, rpc: str, request: Outgoing, metadata: Sequence[tuple[str, str]], timeout_s: float
    ) -> Any:
        assert request.carries_batch, "the handle route carries the plain API's requests only"
        call = self.handle.call_api.remote(request.request, tuple(metadata))
        try:
            answer = await asyncio.wait_for(_resolved(call), timeout_s)
        except TimeoutError:
            call.cancel()
            raise grpc.aio.AioRpcError(
                grpc.StatusCode.DEADLINE_EXCEEDED,
                grpc.aio.Metadata(),
                grpc.aio.Metadata(),
                "Deadline Exceeded",
            ) from None
        except Exception as error:  # Ray's: no such method, the replica died
            raise RouteFailed(f"{type(error).__name__}: {error}") from error
        code = grpc.StatusCode[answer.code_name]
        if code != grpc.StatusCode.OK:
            raise grpc.aio.AioRpcError(
                code, grpc.aio.Metadata(), grpc.aio.Metadata(), answer.details
            )
        return answer.response


async def _resolved(call: Any) -> Any:
    """Awaits a DeploymentResponse (a coroutine, so asyncio.wait_for can time it)."""
    return await call
