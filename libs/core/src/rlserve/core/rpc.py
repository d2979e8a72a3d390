"""Calling rlserve services: the one retry policy and deadline handling for every client.

Each call carries the Serve `application` metadata key (which app on the shared proxy),
the cluster's token (`rlserve-token`, see rlserve.core.auth) when one is set, a gRPC
deadline, and the same deadline as metadata so the service can stop work the
caller will no longer wait for (Serve's proxy does not pass gRPC deadlines through).
Retries cover transient failures only — UNAVAILABLE (no replica yet, proxy restarting)
and INTERNAL from a replica that died (Serve restarts it in ≈ 3 s) — and never an
INVALID_ARGUMENT or FAILED_PRECONDITION, which would fail again. Updates are safe to
retry because they carry their step number and services apply a step once. A call that
times out (DEADLINE_EXCEEDED, never retried) is raised with details naming the service,
RPC, app and the replica(s) that could have held it.

Route: a client on the Ray cluster (the trainer) calls an app's replica directly when
Serve's direct ingress gives it a gRPC port of its own (rlserve.core.cluster turns it on)
and the app has one replica: ≈ 3 ms per small call instead of ≈ 11-14 ms through the
proxy, and a large batch crosses one hop instead of two. Otherwise calls go through the
proxy. A direct call that finds no replica (UNAVAILABLE) or another app's (NOT_FOUND:
Serve checks the `application` metadata, so a port reused after a replacement never
reaches the wrong service) goes to the proxy at once, as do that call's retries, without
spending an attempt; the client asks Serve for the route again after
DIRECT_LOOKUP_INTERVAL_S.

Large batches on the cluster: `call_with_batch` sends a request whose batch field is a
Batch. A client on the Ray cluster hands a large one to the replica through a Serve
DeploymentHandle (rlserve.core.handle_route: Ray's object store, one copy each way,
instead of protobuf's several) and gets the response's Batch back the same way; the
same handler runs, with the same token, deadline, statuses and trace context. A handle
call costs a few ms more than a direct gRPC call, so small batches go by gRPC:
HANDLE_ROUTE_MIN_BYTES says from which size of the request's tensors the handle wins
over each gRPC route. Without a handle (off the cluster, the app gone, a deployment
without the route) the call goes by gRPC as above; a handle call that fails in Ray
itself (the replica died) goes to gRPC at once and the handle is looked up again after
DIRECT_LOOKUP_INTERVAL_S.

Tracing: every attempt is its own client span `rpc.client/<Service>/<Rpc>` (attributes
role, attempt, route, gRPC status) whose W3C context travels in the call's metadata, so the
service's server span becomes its child; a failed attempt's span is marked ERROR, and a
retry shows as a second client span. With tracing off nothing is added to the call.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections import Counter
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import grpc
from google.protobuf import message_factory
from opentelemetry.trace import Status, StatusCode

from rlserve.core import auth, tracing
from rlserve.core.lease import run_id_metadata
from rlserve.core.serving import deadline_metadata

# Batches need torch; a client that sends none (GetInfo, a health probe, a torch-free
# node's calls) never loads it.
if TYPE_CHECKING:
    from rlserve.core.batch import Batch

logger = logging.getLogger(__name__)

MAX_MESSAGE_BYTES = 1 << 30
# A direct call failing so says nothing of the service: Serve answers NOT_FOUND on a
# replica's port for another app's call (the port was reused after a replacement).
STALE_ROUTE_CODES = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.NOT_FOUND})
DIRECT_LOOKUP_INTERVAL_S = 10.0
"""How often a client without a direct route asks Serve for one again."""
HANDLE_ROUTE_MIN_BYTES = {"direct": 2 * 2**20, "proxy": 64 * 2**10}
"""The request tensors' bytes from which `call_with_batch` takes the handle route rather
than each gRPC route (benchmarks/bench_batch_transport.py, replica + 2 workers, in one
run: 12 KiB 4.7 ms direct, 7.7 handle, 7.9 proxy; 1 MiB 10.9, 12.3, 17.6; 4 MiB 24.9,
21.8, 36.3; 64 MiB 349, 75, 552)."""
CHANNEL_OPTIONS = (
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
)


def call_metadata(application: str | None, *extra: tuple[str, str]) -> list[tuple[str, str]]:
    """The metadata of a call to an rlserve service: the Serve `application` (None for
    the trainer's control service, which is no Serve app), the token when one is set,
    then `extra` entries (e.g. `deadline_metadata(...)`). Every caller builds its
    metadata here, so none forgets the token."""
    routing = [] if application is None else [("application", application)]
    return [*routing, *auth.token_metadata(), *extra]


@dataclass(frozen=True)
class RetryPolicy:
    retries: int = 2
    """Extra attempts after the first (0 = try once)."""
    initial_backoff_s: float = 0.5
    """Wait before the first retry; doubles each retry."""
    max_backoff_s: float = 8.0
    """Longest wait between attempts."""
    retryable: frozenset[grpc.StatusCode] = frozenset(
        {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.INTERNAL}
    )
    """Statuses worth another attempt."""


def direct_grpc_target(app: str) -> str | None:
    """The address ("host:port") where `app`'s replica answers gRPC itself (Serve's
    direct ingress), or None: this process is not on a Ray cluster with Serve (a Ray
    Client connection is not: the nodes' addresses may be unreachable from here), direct
    ingress is off, or the app has no running replica or several (the proxy balances
    those)."""
    import ray
    import ray.util.client

    if not ray.is_initialized() or ray.util.client.ray.is_connected():
        return None
    from rlserve.core.placement import serve_details

    try:
        details = serve_details()
    except Exception as error:  # no Serve, or unreachable: the proxy route still stands
        logger.debug("no direct route to %s: %s", app, error)
        return None
    targets = [
        target
        for group in details.get("target_groups") or []
        if group.get("app_name") == app and group.get("protocol") == "gRPC"
        for target in group.get("targets") or []
    ]
    if len(targets) != 1:
        return None
    return f"{targets[0]['ip']}:{targets[0]['port']}"


def app_handle(app: str) -> Any | None:
    """A Serve DeploymentHandle of `app`'s ingress deployment, or None: this process is
    not on a Ray cluster with Serve (a Ray Client connection is not) or there is no
    such app."""
    import ray
    import ray.util.client

    if not ray.is_initialized() or ray.util.client.ray.is_connected():
        return None
    from ray import serve

    try:
        return serve.get_app_handle(app)
    except Exception as error:  # no Serve, or no such app: gRPC still stands
        logger.debug("no handle route to %s: %s", app, error)
        return None


class _HandleRouteFailed(Exception):
    """The handle route failed in Ray itself, not in the service: use gRPC instead."""


class ServiceClient:
    """Async client of one rlserve service (one Serve application) on a shared channel
    to the proxy, and its own channel to the app's replica when `direct` (default: on a
    Ray cluster) finds one; with `handle` (default), `call_with_batch` on a Ray cluster
    hands a batch of `handle_min_bytes` or more (default HANDLE_ROUTE_MIN_BYTES of the
    gRPC route it would take) to the app's DeploymentHandle (see the module docstring)."""

    def __init__(
        self,
        channel: grpc.aio.Channel,
        stub_cls: type,
        application: str,
        timeout_s: float,
        policy: RetryPolicy = RetryPolicy(),
        direct: bool = True,
        handle: bool = True,
        handle_min_bytes: int | None = None,
        run_id: str = "",
    ):
        self.stub = stub_cls(channel)
        # the run a stateful service's lease names (rlserve.core.lease)
        self.run_metadata = (run_id_metadata(run_id),) if run_id else ()
        self.stub_cls = stub_cls
        # Generated stubs are named <Service>Stub: the gRPC service, for span names.
        self.service = stub_cls.__name__.removesuffix("Stub")
        self.application = application
        self.timeout_s = timeout_s
        self.policy = policy
        self.direct = direct
        self._direct_channel: grpc.aio.Channel | None = None
        self._direct_stub: Any = None
        self._retired_channels: list[grpc.aio.Channel] = []
        self._looked_up_at = -math.inf
        self.handle = handle
        self.handle_min_bytes = handle_min_bytes
        self.last_route: str | None = None
        """The route of the last call answered ("handle", "direct" or "proxy")."""
        self.calls_by_route: Counter[str] = Counter()
        """Calls answered, by route (a call answered after retries counts once)."""
        self._handle: Any = None
        self._handle_looked_up_at = -math.inf

    async def _route(self, direct_allowed: bool) -> tuple[str, Any]:
        """("direct", the replica's stub) when there is a direct route, else ("proxy",
        the proxy's stub). Looked up at most every DIRECT_LOOKUP_INTERVAL_S."""
        if not (self.direct and direct_allowed):
            return "proxy", self.stub
        now = time.monotonic()
        if self._direct_stub is None and now - self._looked_up_at >= DIRECT_LOOKUP_INTERVAL_S:
            self._looked_up_at = now
            target = await asyncio.to_thread(direct_grpc_target, self.application)
            if target is not None:
                # created here, inside the event loop that uses it (grpc.aio's rule)
                self._direct_channel = open_channel(target)
                self._direct_stub = self.stub_cls(self._direct_channel)
        if self._direct_stub is None:
            return "proxy", self.stub
        return "direct", self._direct_stub

    def _forget_direct_route(self) -> None:
        """Stops using the direct channel; it stays open until `close` (closing it now
        would cancel this client's other calls still running on it)."""
        if self._direct_channel is not None:
            self._retired_channels.append(self._direct_channel)
        self._direct_channel = self._direct_stub = None

    async def close(self) -> None:
        """Closes the direct channels (the proxy channel belongs to whoever passed it)."""
        self._forget_direct_route()
        channels, self._retired_channels = self._retired_channels, []
        for channel in channels:
            await channel.close()

    def _answered_by(self, route: str) -> None:
        self.last_route = route
        self.calls_by_route[route] += 1

    def _handle_pays(self, grpc_route: str, batch: Batch, response_bytes: int) -> bool:
        """Whether the call moves enough bytes (the request's batch, or the response's
        when estimated larger) for the handle route to beat `grpc_route`."""
        if not self.handle:
            return False
        min_bytes = self.handle_min_bytes
        if min_bytes is None:
            min_bytes = HANDLE_ROUTE_MIN_BYTES[grpc_route]
        request_bytes = sum(t.nbytes for t in batch.tensors.values())
        return max(request_bytes, response_bytes) >= min_bytes

    async def _app_handle(self) -> Any | None:
        """The app's DeploymentHandle, looked up at most every DIRECT_LOOKUP_INTERVAL_S."""
        now = time.monotonic()
        if self._handle is None and now - self._handle_looked_up_at >= DIRECT_LOOKUP_INTERVAL_S:
            self._handle_looked_up_at = now
            self._handle = await asyncio.to_thread(app_handle, self.application)
        return self._handle

    async def call(self, rpc: str, request: Any, timeout_s: float | None = None) -> Any:
        """Calls `rpc` with retries; raises the last grpc.aio.AioRpcError when out of tries."""
        response, _ = await self._call(rpc, request, None, timeout_s)
        return response

    async def call_with_batch(
        self,
        rpc: str,
        request: Any,
        batch: Batch,
        field: str = "batch",
        timeout_s: float | None = None,
        response_bytes: int = 0,
    ) -> tuple[Any, Batch | None]:
        """Calls `rpc` with `batch` as the request's `field` (left empty in `request`);
        returns the response and its batch field decoded (None when the response has
        none). A large batch by the handle route on a Ray cluster, else by gRPC; retries as
        `call`. `response_bytes`: the caller's estimate of the response batch's tensor
        bytes when it may outgrow the request's (a generation), so that the route suits
        the larger of the two."""
        return await self._call(rpc, request, (field, batch), timeout_s, response_bytes)

    async def _call(
        self,
        rpc: str,
        request: Any,
        batch: tuple[str, Batch] | None,
        timeout_s: float | None,
        response_bytes: int = 0,
    ) -> tuple[Any, Batch | None]:
        timeout_s = timeout_s or self.timeout_s
        backoff_s = self.policy.initial_backoff_s
        direct_allowed = True
        wire_request = request if batch is None else None
        for attempt in range(self.policy.retries + 1):
            route, stub = await self._route(direct_allowed)
            handle = None
            if batch is not None and self._handle_pays(route, batch[1], response_bytes):
                handle = await self._app_handle()
                if handle is not None:
                    grpc_route, route = route, "handle"
            with tracing.rpc_client_span(
                self.service, rpc, role=self.application, attempt=attempt
            ) as span:
                metadata = call_metadata(
                    self.application, deadline_metadata(timeout_s), *self.run_metadata
                )
                if tracing.tracing_enabled():
                    metadata = tracing.inject_metadata(metadata)
                    if span.is_recording():
                        span.set_attribute("rlserve.request_bytes", request.ByteSize())
                        span.set_attribute("rlserve.route", route)
                try:
                    if handle is not None:
                        try:
                            answer = await self._handle_call(
                                handle, rpc, request, batch, metadata, timeout_s
                            )
                            self._answered_by(route)
                            return answer
                        except _HandleRouteFailed as error:
                            logger.info("%s: handle route failed (%s)", self.application, error)
                            self._handle = handle = None
                            route = grpc_route
                            if span.is_recording():
                                span.set_attribute("rlserve.route", route)
                    if wire_request is None:
                        wire_request = _with_batch(request, *batch)
                    try:
                        response = await getattr(stub, rpc)(
                            wire_request, metadata=metadata, timeout=timeout_s
                        )
                    except grpc.aio.AioRpcError as error:
                        if route != "direct" or error.code() not in STALE_ROUTE_CODES:
                            raise
                        # The replica is gone, or its port now serves another app: the
                        # proxy at once, for every retry too, and a new lookup later.
                        logger.info("%s: direct route failed (%s)", self.application, error)
                        direct_allowed = False
                        self._forget_direct_route()
                        if span.is_recording():
                            span.set_attribute("rlserve.route", "proxy")
                        route = "proxy"
                        response = await getattr(self.stub, rpc)(
                            wire_request, metadata=metadata, timeout=timeout_s
                        )
                    self._answered_by(route)
                    return response, None if batch is None else _response_batch(response)
                except grpc.aio.AioRpcError as error:
                    failure = error
                    if span.is_recording():
                        span.set_attribute("rpc.grpc.status_code", error.code().value[0])
                        span.set_status(Status(StatusCode.ERROR, error.code().name))
                    if error.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                        raise self._timed_out(rpc, timeout_s, error) from None
                    if attempt == self.policy.retries or error.code() not in self.policy.retryable:
                        raise
            # The backoff lies between two attempt spans, in the caller's span.
            logger.warning(
                "%s.%s failed with %s (%s); retry %d/%d in %.1f s",
                self.application,
                rpc,
                failure.code().name,
                failure.details(),
                attempt + 1,
                self.policy.retries,
                backoff_s,
            )
            await asyncio.sleep(backoff_s)
            backoff_s = min(backoff_s * 2, self.policy.max_backoff_s)
        raise AssertionError("unreachable")

    async def _handle_call(
        self,
        handle: Any,
        rpc: str,
        request: Any,
        batch: tuple[str, Batch],
        metadata: list[tuple[str, str]],
        timeout_s: float,
    ) -> tuple[Any, Batch | None]:
        """One call by the handle route; a service's status raises as AioRpcError, a
        failure of Ray's (no such method, the replica died) as _HandleRouteFailed."""
        call = handle.call_with_batch.remote(
            rpc, request.SerializeToString(), batch[1], tuple(metadata)
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
        except Exception as error:
            raise _HandleRouteFailed(f"{type(error).__name__}: {error}") from error
        code = grpc.StatusCode[result.code_name]
        if code != grpc.StatusCode.OK:
            raise grpc.aio.AioRpcError(
                code, grpc.aio.Metadata(), grpc.aio.Metadata(), result.details
            )
        response = _response_class(request, self.service, rpc).FromString(result.response)
        # a handler that encoded its batch itself rather than through response_batch
        return response, _response_batch(response) if result.batch is None else result.batch

    def _timed_out(
        self, rpc: str, timeout_s: float, error: grpc.aio.AioRpcError
    ) -> grpc.aio.AioRpcError:
        """The DEADLINE_EXCEEDED `error` again, its details naming the service, the RPC,
        the app and the replicas that could have held the call."""
        details = (
            f"{self.service}.{rpc} on app {self.application!r}: no answer within "
            f"{timeout_s:g} s ({error.details()}); {_replicas_of(self.application)}"
        )
        return grpc.aio.AioRpcError(
            error.code(), error.initial_metadata(), error.trailing_metadata(), details
        )


def _replicas_of(app: str) -> str:
    """The app's running replicas (id, node, pid), as Serve reports them: the proxy does
    not tell a client which replica took its call, but a stateful service has one."""
    import ray

    if not ray.is_initialized():
        return "its replicas are unknown here (this process is not on the Ray cluster)"
    from rlserve.core.placement import serve_replicas

    try:
        replicas = serve_replicas(app)
    except Exception as error:  # Serve itself unreachable: the call's error still stands
        return f"its replicas are unknown ({type(error).__name__}: {error})"
    if not replicas:
        return "it has no running replica"
    names = ", ".join(
        f"{r['replica_id']} (node {r['node_id'][:8]}, pid {r['pid']})" for r in replicas
    )
    return f"held by replica {names}" if len(replicas) == 1 else f"one of replicas {names}"


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


def open_channel(address: str) -> grpc.aio.Channel:
    """An insecure channel to Serve's gRPC proxy with large message limits."""
    return grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS)
