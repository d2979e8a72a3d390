"""The routes a ServiceClient call can take (rlserve.core.rpc), and which one it takes.

`choose_route` is the whole choice, a pure function of one try's facts (RouteFacts: a
batch or not and its tensor bytes, whether the handle route is on and a handle at hand,
whether a direct route is known, and the route the attempt just failed on). The client
gathers the facts (its lookups, its state) and runs the route chosen; when that route
fails without reaching the service it asks again with `failed` set, within the same
attempt.

Each route is a transport of one shape, `attempt(rpc, request, metadata, timeout_s) ->
(response, batch)`: GrpcRoute (a stub: the proxy's, or a replica's own port) and
HandleRoute (a Serve DeploymentHandle, served by rlserve.core.handle_route). A transport
raises grpc.aio.AioRpcError for a status of the service (or gRPC's own deadline), which
the client's retry policy judges, and RouteFailed when the route itself failed and said
nothing of the service (a direct port with no replica or another app's; Ray failing a
handle call), which the client answers by taking the next route at once.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, Protocol

import grpc
from google.protobuf import message_factory

# Batches need torch; a client that sends none never loads it.
if TYPE_CHECKING:
    from rlserve.core.batch import Batch

Route = Literal["handle", "direct", "proxy"]
"""A call's route: a Serve DeploymentHandle, a replica's own gRPC port, Serve's proxy."""
FailedRoute = Literal["handle", "direct"]
"""The routes that can fail without reaching the service (the proxy's failures are the
service's: no replica, a replica restarting)."""

# A direct call failing so says nothing of the service: Serve answers NOT_FOUND on a
# replica's port for another app's call (the port was reused after a replacement).
STALE_ROUTE_CODES = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.NOT_FOUND})
HANDLE_ROUTE_MIN_BYTES: dict[str, int] = {"direct": 2 * 2**20, "proxy": 64 * 2**10}
"""The request tensors' bytes from which `call_with_batch` takes the handle route rather
than each gRPC route (benchmarks/bench_batch_transport.py, replica + 2 workers, in one
run: 12 KiB 4.7 ms direct, 7.7 handle, 7.9 proxy; 1 MiB 10.9, 12.3, 17.6; 4 MiB 24.9,
21.8, 36.3; 64 MiB 349, 75, 552)."""


@dataclass(frozen=True)
class RouteFacts:
    """What the route of one try of a call depends on."""

    has_batch: bool = False
    """The call carries a Batch beside its message (`call_with_batch`)."""
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
    """One call's request: the message (its batch field left empty when a Batch goes
    beside it) and the Batch with the name of its field."""

    message: Any
    batch: tuple[str, Batch] | None = None
    _wire: Any = field(default=None, repr=False)

    def wire(self) -> Any:
        """The message as gRPC sends it, the Batch encoded into its field (once a call,
        however many attempts)."""
        if self.batch is None:
            return self.message
        if self._wire is None:
            self._wire = _with_batch(self.message, *self.batch)
        return self._wire

    def batch_bytes(self) -> int:
        """The Batch's tensor bytes (0 without one)."""
        if self.batch is None:
            return 0
        return sum(t.nbytes for t in self.batch[1].tensors.values())


class Transport(Protocol):
    """One route's attempt at a call: the response, and its batch decoded (None for a
    call without a Batch, or a response without one); AioRpcError for the service's
    status, RouteFailed when the route failed."""

    async def attempt(
        self, rpc: str, request: Outgoing, metadata: Sequence[tuple[str, str]], timeout_s: float
    ) -> tuple[Any, Batch | None]: ...


class GrpcRoute:
    """A call by gRPC on `stub`; a status of `stale_codes` (the direct route's
    STALE_ROUTE_CODES) raises RouteFailed."""

    def __init__(self, stub: Any, stale_codes: frozenset[grpc.StatusCode] = frozenset()):
        self.stub = stub
        self.stale_codes = stale_codes

    async def attempt(
        self, rpc: str, request: Outgoing, metadata: Sequence[tuple[str, str]], timeout_s: float
    ) -> tuple[Any, Batch | None]:
        try:
            response = await getattr(self.stub, rpc)(
                request.wire(), metadata=metadata, timeout=timeout_s
            )
        except grpc.aio.AioRpcError as error:
            if error.code() in self.stale_codes:
                raise RouteFailed(str(error)) from error
            raise
        return response, None if request.batch is None else _response_batch(response)


class HandleRoute:
    """A call by the app's Serve DeploymentHandle (`handle`, of gRPC service `service`):
    the message as protobuf bytes and the Batch beside it, through Ray's object store."""

    def __init__(self, handle: Any, service: str):
        self.handle = handle
        self.service = service

    async def attempt(
        self, rpc: str, request: Outgoing, metadata: Sequence[tuple[str, str]], timeout_s: float
    ) -> tuple[Any, Batch | None]:
        assert request.batch is not None, "the handle route carries batches only"
        message = request.message
        call = self.handle.call_with_batch.remote(
            rpc, message.SerializeToString(), request.batch[1], tuple(metadata)
        )
        try:
            result = await asyncio.wait_for(_resolved(call), timeout_s)
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
        code = grpc.StatusCode[result.code_name]
        if code != grpc.StatusCode.OK:
            raise grpc.aio.AioRpcError(
                code, grpc.aio.Metadata(), grpc.aio.Metadata(), result.details
            )
        response = _response_class(message, self.service, rpc).FromString(result.response)
        # a handler that encoded its batch itself rather than through response_batch
        return response, _response_batch(response) if result.batch is None else result.batch


async def _resolved(call: Any) -> Any:
    """Awaits a DeploymentResponse (a coroutine, so asyncio.wait_for can time it)."""
    return await call


def _with_batch(request: Any, field: str, batch: Batch) -> Any:
    """A copy of `request` with `batch` encoded into its (empty) field `field`."""
    wire_request = type(request)()
    wire_request.CopyFrom(request)
    from rlserve.core.codec import batch_to_proto

    batch_to_proto(batch, into=getattr(wire_request, field))
    return wire_request


def _response_batch(response: Any) -> Batch | None:
    """The response's batch field decoded, None when it has none."""
    if "batch" not in response.DESCRIPTOR.fields_by_name or not response.HasField("batch"):
        return None
    from rlserve.core.codec import batch_from_proto

    return batch_from_proto(response.batch)


def _response_class(request: Any, service: str, rpc: str) -> type:
    """The response message class of `service`.`rpc`, from the proto descriptors."""
    file = request.DESCRIPTOR.file
    method = file.pool.FindServiceByName(f"{file.package}.{service}").methods_by_name[rpc]
    return message_factory.GetMessageClass(method.output_type)
