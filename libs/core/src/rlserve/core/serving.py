"""How every rlserve service answers gRPC inside a Ray Serve deployment.

One place decides: the status a failure becomes, the message a caller sees, and the
caller's deadline.

- `RpcError` carries a gRPC status and a message naming the field; `invalid_argument`,
  `failed_precondition` and friends build them. A `CodecError` (malformed tensor) is an
  INVALID_ARGUMENT too.
- `@rpc_method(ResponseType)` wraps a deployment method: an RpcError becomes that status
  and message; any other exception becomes INTERNAL with a one-line message (Serve's
  default would send the whole traceback, leaking internals and, with non-ASCII text,
  overflowing a default client's metadata limit), and the traceback goes to the log.
  The replica keeps serving either way.
- Authentication: before anything else, `rpc_method` checks the caller's token
  (metadata `rlserve-token`) against the replica's (`rlserve.core.auth`); a missing or
  wrong one is UNAUTHENTICATED, and a replica without a token accepts every call.
- Deadlines: gRPC does not hand the caller's deadline through Serve's proxy, so rlserve
  clients also send it as metadata (`DEADLINE_METADATA_KEY`, absolute Unix time in
  seconds); `Deadline.check(stage)` raises DEADLINE_EXCEEDED between units of work once
  it has passed. Controllers hand the plain Unix time (`Deadline.unix_s`) on to their
  workers' generation and forward passes, which stop between micro-batches
  (`until_deadline`) or tokens, so work nobody waits for any more does not hold the
  worker: the RpcError they raise crosses Ray as itself.
- Health: a deployment with workers passes HEALTH_CHECK_OPTIONS to @serve.deployment
  and defines `check_health` with `raise_if_unhealthy(problems)`: Serve replaces a
  replica whose check fails three times in a row (≈ 3 × HEALTH_CHECK_PERIOD_S), so a
  replica whose worker died is gone within seconds, not left answering INTERNAL. GetInfo
  answers UNAVAILABLE for such a replica meanwhile.
- Tracing: `rpc_method` opens the server span `rpc.server/<Service>/<Rpc>`, continuing
  the caller's trace from the incoming metadata (Serve passes it through); the work
  spans a service opens inside become its children. A failed call's span carries the
  gRPC status and ERROR. Each replica calls `setup_replica_tracing(role, config.tracing)`
  first thing, so its spans name the service (`rlserve-<role>`), replica and node. With
  tracing off the wrapper costs one no-op context manager per call.
"""

import functools
import logging
import time
from collections.abc import Awaitable, Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

import grpc
from google.protobuf import message_factory
from opentelemetry.trace import Span, Status, StatusCode

from rlserve.core import auth, tracing
from rlserve.core.handle_route import HandleCallContext
from rlserve.core.tracing_config import TracingConfig
from rlserve.core.wire import CodecError
from rlserve.v1.common_pb2 import Batch

logger = logging.getLogger(__name__)

DEADLINE_METADATA_KEY = "rlserve-deadline-unix-s"
# Status details travel percent-encoded in HTTP/2 trailers (a non-ASCII byte costs 3);
# gRPC clients warn past 8 KiB of metadata and fail the call past their limit.
_MAX_DETAILS_WIRE_BYTES = 4096

Response = TypeVar("Response")
Item = TypeVar("Item")


class RpcError(Exception):
    """A failure with the gRPC status the caller should see."""

    def __init__(self, code: grpc.StatusCode, message: str):
        # Both in args, so the error survives pickling (raised inside a Ray worker).
        super().__init__(code, message)
        self.code = code
        self.message = message

    def __str__(self) -> str:
        return self.message


def invalid_argument(field: str, problem: str) -> RpcError:
    """INVALID_ARGUMENT whose message starts with the offending field."""
    return RpcError(grpc.StatusCode.INVALID_ARGUMENT, f"{field}: {problem}")


def failed_precondition(message: str) -> RpcError:
    return RpcError(grpc.StatusCode.FAILED_PRECONDITION, message)


def resource_exhausted(field: str, problem: str) -> RpcError:
    return RpcError(grpc.StatusCode.RESOURCE_EXHAUSTED, f"{field}: {problem}")


def unavailable(message: str) -> RpcError:
    return RpcError(grpc.StatusCode.UNAVAILABLE, message)


HEALTH_CHECK_PERIOD_S = 2.0
# Generous: the check itself never waits, but a replica's event loop can be busy for a
# while decoding or encoding a large batch.
HEALTH_CHECK_TIMEOUT_S = 30.0
HEALTH_CHECK_OPTIONS = {
    "health_check_period_s": HEALTH_CHECK_PERIOD_S,
    "health_check_timeout_s": HEALTH_CHECK_TIMEOUT_S,
}


def raise_if_unhealthy(role: str, problems: list[str]) -> None:
    """UNAVAILABLE naming each problem (a dead worker, unusable state); Serve's health
    check treats it as a failure and replaces the replica."""
    if problems:
        raise unavailable(
            f"{role} replica is unhealthy ({'; '.join(problems)}); Serve replaces it within "
            f"about {3 * HEALTH_CHECK_PERIOD_S:.0f} s, with freshly loaded weights"
        )


@dataclass(frozen=True)
class Deadline:
    """The caller's deadline as absolute Unix time; None = the caller set none."""

    unix_s: float | None = None

    @classmethod
    def from_metadata(cls, metadata: Iterable[tuple[str, Any]]) -> "Deadline":
        for key, value in metadata:
            if key == DEADLINE_METADATA_KEY:
                try:
                    return cls(float(value))
                except ValueError:
                    raise invalid_argument(
                        f"metadata {DEADLINE_METADATA_KEY}", f"not a number: {value!r}"
                    ) from None
        return cls(None)

    def remaining_s(self) -> float:
        return float("inf") if self.unix_s is None else self.unix_s - time.time()

    def check(self, stage: str) -> None:
        """Raises DEADLINE_EXCEEDED when the caller's deadline has passed."""
        if self.remaining_s() <= 0:
            raise deadline_exceeded(stage)


def deadline_exceeded(stage: str) -> RpcError:
    """The DEADLINE_EXCEEDED every stage raises once the caller's deadline has passed."""
    return RpcError(grpc.StatusCode.DEADLINE_EXCEEDED, f"caller's deadline passed during {stage}")


def until_deadline(items: Iterable[Item], unix_s: float | None, stage: str) -> Iterator[Item]:
    """`items` one by one, raising DEADLINE_EXCEEDED instead of the next one once the
    deadline (absolute Unix seconds; None = none) has passed: a worker's loop over
    micro-batches stops between them."""
    deadline = Deadline(unix_s)
    for item in items:
        deadline.check(stage)
        yield item


def deadline_metadata(timeout_s: float) -> tuple[str, str]:
    """The metadata entry a client sends so the service can honour its deadline."""
    return (DEADLINE_METADATA_KEY, f"{time.time() + timeout_s:.6f}")


def _wire_bytes(char: str) -> int:
    return sum(1 if 0x20 <= byte <= 0x7E and byte != 0x25 else 3 for byte in char.encode())


def _clip(text: str) -> str:
    """Cuts `text` so its percent-encoded form stays under _MAX_DETAILS_WIRE_BYTES."""
    budget = _MAX_DETAILS_WIRE_BYTES - 3
    for index, char in enumerate(text):
        budget -= _wire_bytes(char)
        if budget < 0:
            return text[:index] + "..."
    return text


def rpc_method(
    response_type: Callable[[], Response],
) -> Callable[[Callable[..., Awaitable[Response]]], Callable[..., Awaitable[Response]]]:
    """Wraps `async def Rpc(self, request, grpc_context)` of a Serve gRPC deployment."""

    def decorate(method: Callable[..., Awaitable[Response]]) -> Callable[..., Awaitable[Response]]:
        rpc = method.__name__
        service = _service_name(response_type, rpc)
        batch_request_type = _batch_request_type(response_type, rpc)

        @functools.wraps(method)
        async def wrapper(self: Any, request: Any, grpc_context: Any) -> Response:
            metadata = grpc_context.invocation_metadata()
            with tracing.rpc_server_span(service, rpc, metadata) as span:
                try:
                    refused = auth.rejection(metadata)
                    if refused is not None:
                        raise RpcError(grpc.StatusCode.UNAUTHENTICATED, refused)
                    response = await method(self, request, grpc_context)
                    if span.is_recording():
                        _annotate(span, metadata, request, response, grpc_context)
                    return response
                except RpcError as error:
                    code, message = error.code, error.message
                except CodecError as error:
                    code, message = grpc.StatusCode.INVALID_ARGUMENT, str(error)
                except Exception as error:
                    logger.exception("%s failed", rpc)
                    code = grpc.StatusCode.INTERNAL
                    message = f"{rpc} failed: {type(error).__name__}: {error}"
                message = _clip(message)
                if span.is_recording():
                    _annotate(span, metadata, request, None, grpc_context)
                    span.set_attribute("rpc.grpc.status_code", code.value[0])
                    span.set_status(Status(StatusCode.ERROR, f"{code.name}: {message[:500]}"))
                grpc_context.set_code(code)
                grpc_context.set_details(message)
                return response_type()

        # the handle route (rlserve.core.handle_route) calls only RPCs that carry a batch
        wrapper.batch_request_type = batch_request_type  # type: ignore[attr-defined]
        return wrapper

    return decorate


def _method_descriptor(response_type: Any, rpc: str) -> Any | None:
    """The proto descriptor of the RPC `rpc` answered with `response_type`, or None."""
    descriptor = getattr(response_type, "DESCRIPTOR", None)
    if descriptor is None:
        return None
    for service in descriptor.file.services_by_name.values():
        method = service.methods_by_name.get(rpc)
        if method is not None and method.output_type is descriptor:
            return method
    return None


def _service_name(response_type: Any, rpc: str) -> str:
    """The gRPC service that answers `rpc` with `response_type` (from the proto
    descriptors), e.g. "RolloutService"; the proto package when none matches."""
    method = _method_descriptor(response_type, rpc)
    if method is not None:
        return method.containing_service.name
    descriptor = getattr(response_type, "DESCRIPTOR", None)
    return "unknown" if descriptor is None else descriptor.file.package


def _batch_request_type(response_type: Any, rpc: str) -> type | None:
    """The request class of `rpc` (answered with `response_type`) when that request has
    an rlserve.v1.Batch field, else None."""
    method = _method_descriptor(response_type, rpc)
    if method is None:
        return None
    request = method.input_type
    if any(field.message_type is Batch.DESCRIPTOR for field in request.fields):
        return message_factory.GetMessageClass(request)
    return None


def _batch_rows(message: Any, field: str) -> int | None:
    """Rows of the rlserve.v1.Batch in `message.<field>` (its first tensor's first dim)."""
    if field not in message.DESCRIPTOR.fields_by_name or not message.HasField(field):
        return None
    for tensor in getattr(message, field).tensors.values():
        return int(tensor.shape[0]) if tensor.shape else None
    return None


def _annotate(
    span: Span,
    metadata: Iterable[tuple[str, Any]],
    request: Any,
    response: Any,
    grpc_context: Any,
) -> None:
    """Attributes worth filtering on, read from any rlserve request/response: role
    (the Serve application), step, batch size, tokens, weights version, message sizes,
    and `rlserve.route` "handle" for a call that came by the handle route."""
    attributes: dict[str, Any] = {"rlserve.request_bytes": request.ByteSize()}
    for key, value in metadata:
        if key == "application":
            attributes["rlserve.role"] = value
    fields = request.DESCRIPTOR.fields_by_name
    if "step" in fields:
        # requests number steps from 0; traces, like metrics and checkpoints, from 1
        attributes["rlserve.step"] = request.step + 1
    rows = _batch_rows(request, "batch") or _batch_rows(request, "prompts")
    if isinstance(grpc_context, HandleCallContext):
        attributes["rlserve.route"] = "handle"
        rows = len(grpc_context.request_batch)
    if rows is not None:
        attributes["rlserve.batch_size"] = rows
    if response is not None:
        attributes["rlserve.response_bytes"] = response.ByteSize()
        fields = response.DESCRIPTOR.fields_by_name
        if "weights_version" in fields:
            attributes["rlserve.weights_version"] = response.weights_version
        elif (
            isinstance(grpc_context, HandleCallContext) and grpc_context.response_batch is not None
        ):
            version = grpc_context.response_batch.meta.get("weights_version")
            if isinstance(version, int):
                attributes["rlserve.weights_version"] = version
        elif "batch" in fields and response.batch.HasField("meta"):
            attributes["rlserve.weights_version"] = response.batch.meta.weights_version
        if "metrics" in fields:
            for name in ("tokens", "generated_tokens"):
                if name in response.metrics:
                    attributes["rlserve.tokens"] = int(response.metrics[name])
    span.set_attributes(attributes)


def setup_replica_tracing(role: str, settings: TracingConfig) -> None:
    """Tracing of a Serve replica of service `role` (call first in its __init__).

    service.name is `rlserve-<role>`; the resource also names the replica and the Ray
    node. Worker actors the replica then starts (rlserve.core.workers) inherit it.
    """
    if not settings.enabled:
        tracing.setup_tracing(f"rlserve-{role}", None, settings.sampling_ratio, False)
        return
    import ray
    from ray import serve

    try:
        replica = serve.get_replica_context().replica_tag
    except Exception:  # constructed outside Serve (a test): no replica to name
        replica = ""
    tracing.setup_tracing(
        f"rlserve-{role}",
        settings.otlp_endpoint,
        settings.sampling_ratio,
        True,
        settings.file_path,
        resource_attributes={
            "rlserve.role": role,
            "rlserve.replica": replica,
            "rlserve.node_id": ray.get_runtime_context().get_node_id(),
        },
    )
