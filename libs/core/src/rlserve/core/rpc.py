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

Tracing: every attempt is its own client span `rpc.client/<Service>/<Rpc>` (attributes
role, attempt, gRPC status) whose W3C context travels in the call's metadata, so the
service's server span becomes its child; a failed attempt's span is marked ERROR, and a
retry shows as a second client span. With tracing off nothing is added to the call.
"""

import asyncio
import logging
from dataclasses import dataclass
from typing import Any

import grpc
from opentelemetry.trace import Status, StatusCode

from rlserve.core import auth, tracing
from rlserve.core.serving import deadline_metadata

logger = logging.getLogger(__name__)

MAX_MESSAGE_BYTES = 1 << 30
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


class ServiceClient:
    """Async client of one rlserve service (one Serve application) on a shared channel."""

    def __init__(
        self,
        channel: grpc.aio.Channel,
        stub_cls: type,
        application: str,
        timeout_s: float,
        policy: RetryPolicy = RetryPolicy(),
    ):
        self.stub = stub_cls(channel)
        # Generated stubs are named <Service>Stub: the gRPC service, for span names.
        self.service = stub_cls.__name__.removesuffix("Stub")
        self.application = application
        self.timeout_s = timeout_s
        self.policy = policy

    async def call(self, rpc: str, request: Any, timeout_s: float | None = None) -> Any:
        """Calls `rpc` with retries; raises the last grpc.aio.AioRpcError when out of tries."""
        timeout_s = timeout_s or self.timeout_s
        method = getattr(self.stub, rpc)
        backoff_s = self.policy.initial_backoff_s
        for attempt in range(self.policy.retries + 1):
            with tracing.rpc_client_span(
                self.service, rpc, role=self.application, attempt=attempt
            ) as span:
                metadata = call_metadata(self.application, deadline_metadata(timeout_s))
                if tracing.tracing_enabled():
                    metadata = tracing.inject_metadata(metadata)
                    if span.is_recording():
                        span.set_attribute("rlserve.request_bytes", request.ByteSize())
                try:
                    return await method(request, metadata=metadata, timeout=timeout_s)
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
