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

Large batches on the cluster: `call_api` sends a request of the plain API
(rlserve.core.api), which carries a Batch. A client on the Ray cluster hands a large one
to the replica through a Serve DeploymentHandle (ServiceEndpoint.call_api in
rlserve.core.serving: the dataclass itself through Ray's object store, one copy each way,
instead of protobuf's several) and gets the response dataclass back the same way; the
same handler runs, with the same token, deadline, statuses and trace context. A handle
call costs a few ms more than a direct gRPC call, so small batches go by gRPC:
HANDLE_ROUTE_MIN_BYTES says from which size of the request's tensors the handle wins
over each gRPC route. Without a handle (off the cluster, the app gone, a deployment
without the route) the call goes by gRPC as above; a handle call that fails in Ray
itself (the replica died) goes to gRPC at once and the handle is looked up again after
DIRECT_LOOKUP_INTERVAL_S.

The choice of route is one pure function, rlserve.core.rpc_routes.choose_route, and each
route one transport there: the retry loop here retries attempts whatever route each
took, and an attempt whose route fails without reaching the service takes the next one.

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
from dataclasses import dataclass, replace
from typing import Any

import grpc
from opentelemetry.trace import Status, StatusCode

from rlserve.core import auth, tracing
from rlserve.core.lease import run_id_metadata
from rlserve.core.rpc_routes import HANDLE_ROUTE_MIN_BYTES as HANDLE_ROUTE_MIN_BYTES
from rlserve.core.rpc_routes import STALE_ROUTE_CODES as STALE_ROUTE_CODES
from rlserve.core.rpc_routes import (
    GrpcRoute,
    HandleRoute,
    Outgoing,
    Route,
    RouteFacts,
    RouteFailed,
    Transport,
    choose_route,
)
from rlserve.core.serving import deadline_metadata

logger = logging.getLogger(__name__)

MAX_MESSAGE_BYTES = 1 << 30
DIRECT_LOOKUP_INTERVAL_S = 10.0
"""How often a client without a direct route (or handle) asks Serve for one again."""
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


@dataclass
class _Call:
    """One call, across its attempts."""

    rpc: str
    request: Outgoing
    timeout_s: float
    response_bytes: int
    direct_allowed: bool = True
    """False once a direct try of this call found the route stale: the proxy for its
    retries too."""


@dataclass(frozen=True)
class _Attempt:
    """One attempt's facts, its first route and the transports it may take."""

    facts: RouteFacts
    route: Route
    transports: dict[Route, Transport]


class ServiceClient:
    """Async client of one rlserve service (one Serve application) on a shared channel
    to the proxy, and its own channel to the app's replica when `direct` (default: on a
    Ray cluster) finds one; with `handle` (default), `call_api` on a Ray cluster
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
        self._proxy = GrpcRoute(self.stub)
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
        self._direct: GrpcRoute | None = None
        self._retired_channels: list[grpc.aio.Channel] = []
        self._looked_up_at = -math.inf
        self.handle = handle
        self.handle_min_bytes = handle_min_bytes
        self.last_route: str | None = None
        """The route of the last call answered ("handle", "direct" or "proxy")."""
        self.calls_by_route: Counter[str] = Counter()
        """Calls answered, by route (a call answered after retries counts once)."""
        self._handle: HandleRoute | None = None
        self._handle_looked_up_at = -math.inf

    async def _direct_route(self, call: _Call) -> GrpcRoute | None:
        """The route to the app's replica when there is one and `call` may take it.
        Looked up at most every DIRECT_LOOKUP_INTERVAL_S."""
        if not (self.direct and call.direct_allowed):
            return None
        now = time.monotonic()
        if self._direct is None and now - self._looked_up_at >= DIRECT_LOOKUP_INTERVAL_S:
            self._looked_up_at = now
            target = await asyncio.to_thread(direct_grpc_target, self.application)
            if target is not None:
                # created here, inside the event loop that uses it (grpc.aio's rule)
                self._direct_channel = open_channel(target)
                self._direct = GrpcRoute(self.stub_cls(self._direct_channel), STALE_ROUTE_CODES)
        return self._direct

    def _handle_lookup_due(self) -> bool:
        return time.monotonic() - self._handle_looked_up_at >= DIRECT_LOOKUP_INTERVAL_S

    async def _handle_route(self) -> HandleRoute | None:
        """The route by the app's DeploymentHandle, looked up at most every
        DIRECT_LOOKUP_INTERVAL_S."""
        if self._handle is None and self._handle_lookup_due():
            self._handle_looked_up_at = time.monotonic()
            handle = await asyncio.to_thread(app_handle, self.application)
            self._handle = None if handle is None else HandleRoute(handle)
        return self._handle

    def _forget_direct_route(self) -> None:
        """Stops using the direct channel; it stays open until `close` (closing it now
        would cancel this client's other calls still running on it)."""
        if self._direct_channel is not None:
            self._retired_channels.append(self._direct_channel)
        self._direct_channel = self._direct = None

    def _forget_route(self, route: Route, call: _Call) -> None:
        """After `route` failed (RouteFailed): a stale direct route is dropped (looked
        up again later, never by this call), a failed handle too (looked up again
        after DIRECT_LOOKUP_INTERVAL_S)."""
        if route == "direct":
            call.direct_allowed = False
            self._forget_direct_route()
        elif route == "handle":
            self._handle = None

    async def close(self) -> None:
        """Closes the direct channels (the proxy channel belongs to whoever passed it)."""
        self._forget_direct_route()
        channels, self._retired_channels = self._retired_channels, []
        for channel in channels:
            await channel.close()

    def _answered_by(self, route: str) -> None:
        self.last_route = route
        self.calls_by_route[route] += 1

    async def call(self, rpc: str, request: Any, timeout_s: float | None = None) -> Any:
        """Calls `rpc` with the protobuf `request` (an RPC without a batch) and retries;
        raises the last grpc.aio.AioRpcError when out of tries."""
        return await self._call(rpc, request, timeout_s)

    async def call_api(self, request: Any, timeout_s: float | None = None) -> Any:
        """Calls the RPC of `request`, a request of the plain API (rlserve.core.api),
        and returns its response dataclass: by the handle route on a Ray cluster when
        its batch (or the answer the request expects, `response_bytes()`) is large, else
        by gRPC; retries as `call`."""
        return await self._call(request.RPC, request, timeout_s, request.response_bytes())

    async def _call(
        self, rpc: str, request: Any, timeout_s: float | None, response_bytes: int = 0
    ) -> Any:
        """The retry policy around attempts, whatever route each takes."""
        call = _Call(rpc, Outgoing(request), timeout_s or self.timeout_s, response_bytes)
        backoff_s = self.policy.initial_backoff_s
        for attempt in range(self.policy.retries + 1):
            plan = await self._plan(call)  # its lookups lie before the attempt's span
            with tracing.rpc_client_span(
                self.service, rpc, role=self.application, attempt=attempt
            ) as span:
                try:
                    return await self._attempt(call, plan, span)
                except grpc.aio.AioRpcError as error:
                    failure = error
                    if span.is_recording():
                        span.set_attribute("rpc.grpc.status_code", error.code().value[0])
                        span.set_status(Status(StatusCode.ERROR, error.code().name))
                    if error.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                        raise self._timed_out(rpc, call.timeout_s, error) from None
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

    async def _plan(self, call: _Call) -> _Attempt:
        """The next attempt's facts, first route and transports: the direct route looked
        up when due, and the handle when the call would take it."""
        direct = await self._direct_route(call)
        facts = RouteFacts(
            has_batch=call.request.carries_batch,
            request_bytes=call.request.batch_bytes(),
            response_bytes=call.response_bytes,
            handle_enabled=self.handle,
            handle_min_bytes=self.handle_min_bytes,
            handle_available=self._handle is not None or self._handle_lookup_due(),
            direct_known=direct is not None,
        )
        route = choose_route(facts)
        handle = None
        if route == "handle":
            handle = await self._handle_route()
            if handle is None:  # none found: the gRPC route
                facts = replace(facts, handle_available=False)
                route = choose_route(facts)
        transports: dict[Route, Transport] = {"proxy": self._proxy}
        if direct is not None:
            transports["direct"] = direct
        if handle is not None:
            transports["handle"] = handle
        return _Attempt(facts, route, transports)

    async def _attempt(self, call: _Call, plan: _Attempt, span: Any) -> Any:
        """One attempt: its first route, and the next at once each time a route fails
        without reaching the service (RouteFailed); a service's status raises."""
        metadata = call_metadata(
            self.application, deadline_metadata(call.timeout_s), *self.run_metadata
        )
        if tracing.tracing_enabled():
            metadata = tracing.inject_metadata(metadata)
            if span.is_recording():
                span.set_attribute("rlserve.request_bytes", call.request.size_bytes())
                span.set_attribute("rlserve.route", plan.route)
        facts, route = plan.facts, plan.route
        while True:  # ends: a proxy call raises no RouteFailed
            transport = plan.transports[route]
            try:
                answer = await transport.attempt(call.rpc, call.request, metadata, call.timeout_s)
            except RouteFailed as error:
                logger.info("%s: %s route failed (%s)", self.application, route, error)
                self._forget_route(route, call)
                facts = replace(facts, failed=route)
                route = choose_route(facts)
                if span.is_recording():
                    span.set_attribute("rlserve.route", route)
                continue
            self._answered_by(route)
            return answer

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


def open_channel(address: str) -> grpc.aio.Channel:
    """An insecure channel to Serve's gRPC proxy with large message limits."""
    return grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS)
