"""How every rlserve service answers gRPC inside a Ray Serve deployment.

One place decides: the status a failure becomes, the message a caller sees, and the
caller's deadline.

- `RpcError` carries a gRPC status and a message naming the field; `invalid_argument`,
  `failed_precondition` and friends build them. A `CodecError` (malformed tensor) is an
  INVALID_ARGUMENT too.
- A handler is `async def Rpc(self, request, call: Call)`: `call` holds the caller's
  metadata and deadline, and nothing of the route the call came by.
  `@rpc_method(ResponseType)` wraps one whose request and answer are protobuf messages;
  `@batch_rpc(api.Request)` one of an RPC that carries a batch, whose request and
  answer are the plain API's dataclasses (rlserve.core.api), decoded from and encoded to
  protobuf on gRPC and handed through as they are on the in-cluster handle route
  (`ServiceEndpoint.call_api`). Every call, by either route, goes through one policy
  (`_served`): an RpcError becomes that status and message; any other exception becomes
  INTERNAL with a one-line message (Serve's default would send the whole traceback,
  leaking internals and, with non-ASCII text, overflowing a default client's metadata
  limit), and the traceback goes to the log. The replica keeps serving either way.
- Authentication: before anything else, every call's token is checked
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
- Tracing: every call opens the server span `rpc.server/<Service>/<Rpc>`, continuing
  the caller's trace from the incoming metadata (Serve passes it through); the work
  spans a service opens inside become its children. A failed call's span carries the
  gRPC status and ERROR. Each replica calls `setup_replica_tracing(role, config.tracing)`
  first thing, so its spans name the service (`rlserve-<role>`), replica and node. With
  tracing off the wrapper costs one no-op context manager per call.
"""

import functools
import logging
import time
from collections.abc import Awaitable, Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

import grpc
from opentelemetry.trace import Status, StatusCode

from rlserve.core import auth, tracing
from rlserve.core.tracing_config import TracingConfig
from rlserve.core.wire import CodecError

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


@dataclass(frozen=True)
class Call:
    """What a handler knows of the call that reached it, by whatever route it came: the
    caller's metadata (Serve's `application`, the token, the deadline, the run id, the
    trace context)."""

    metadata: tuple[tuple[str, str], ...]

    @property
    def deadline(self) -> Deadline:
        return Deadline.from_metadata(self.metadata)


@dataclass(frozen=True)
class Answer:
    """A call's outcome as the handle route returns it: the gRPC status name, its
    details, and the response dataclass (None unless OK)."""

    code_name: str
    details: str
    response: Any = None


class _Failed(Exception):
    """A call's failure, turned into its gRPC status by `_served`."""

    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(code, message)
        self.code = code
        self.message = message


async def _served(
    service: str,
    rpc: str,
    metadata: tuple[tuple[str, str], ...],
    run: Callable[[Call], Awaitable[Response]],
    describe: Callable[[Response | None], dict[str, Any]],
) -> Response:
    """The one policy of every call, whatever its route: the server span, the token
    check, then `run`; a failure raises _Failed with its status and a clipped message
    (the traceback of an unexpected one goes to the log). `describe(response)` gives
    the span's attributes."""
    with tracing.rpc_server_span(service, rpc, metadata) as span:
        try:
            refused = auth.rejection(metadata)
            if refused is not None:
                raise RpcError(grpc.StatusCode.UNAUTHENTICATED, refused)
            response = await run(Call(metadata))
            if span.is_recording():
                span.set_attributes(_call_attributes(metadata, describe(response)))
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
            span.set_attributes(_call_attributes(metadata, describe(None)))
            span.set_attribute("rpc.grpc.status_code", code.value[0])
            span.set_status(Status(StatusCode.ERROR, f"{code.name}: {message[:500]}"))
    # raised outside the span, whose status is the call's, not this exception's
    raise _Failed(code, message)


def rpc_method(
    response_type: Callable[[], Response],
) -> Callable[[Callable[..., Awaitable[Response]]], Callable[..., Awaitable[Response]]]:
    """Wraps `async def Rpc(self, request, call: Call)` of a Serve gRPC deployment: the
    request and the response are the RPC's protobuf messages (RPCs without a batch;
    those with one are `batch_rpc`s)."""

    def decorate(method: Callable[..., Awaitable[Response]]) -> Callable[..., Awaitable[Response]]:
        rpc = method.__name__
        service = _service_name(response_type, rpc)

        @functools.wraps(method)
        async def wrapper(self: Any, request: Any, grpc_context: Any) -> Response:
            return await _answered_by_grpc(
                grpc_context,
                service,
                rpc,
                request,
                lambda call: method(self, request, call),
                response_type,
            )

        return _served_by_grpc(wrapper)

    return decorate


def batch_rpc(request_type: type) -> Callable[[Callable[..., Awaitable[Any]]], Any]:
    """Wraps `async def Rpc(self, request, call: Call) -> Response` where `request` is
    the plain API's dataclass `request_type` (rlserve.core.api) and the answer its
    `Response`. The wrapper Serve calls by gRPC decodes the protobuf request
    (`request_type.from_proto`; with `reads_tensors` from the deployment's attribute of
    that name, default True) and encodes the answer; the handle route calls the same
    handler through `ServiceEndpoint.call_api` with the dataclasses themselves."""

    def decorate(method: Callable[..., Awaitable[Any]]) -> Any:
        rpc = request_type.RPC
        if method.__name__ != rpc:
            raise TypeError(f"{method.__name__} serves {rpc}: Serve routes by the RPC's name")

        @functools.wraps(method)
        async def wrapper(self: Any, request: Any, grpc_context: Any) -> Any:
            reads_tensors = getattr(self, "reads_tensors", True)

            async def run(call: Call) -> Any:
                plain = request_type.from_proto(request, reads_tensors)
                return (await method(self, plain, call)).to_proto(request_type.RESPONSE_PROTO)

            return await _answered_by_grpc(
                grpc_context, request_type.SERVICE, rpc, request, run, request_type.RESPONSE_PROTO
            )

        wrapper.plain_api = (request_type, method)  # type: ignore[attr-defined]
        return _served_by_grpc(wrapper)

    return decorate


async def _answered_by_grpc(
    grpc_context: Any,
    service: str,
    rpc: str,
    request: Any,
    run: Callable[[Call], Awaitable[Any]],
    response_type: Callable[[], Any],
) -> Any:
    """A gRPC call (protobuf `request`) through `_served`: a failure's status and
    message go on the context, and Serve is handed an empty `response_type()` it drops."""
    metadata = tuple(grpc_context.invocation_metadata())
    try:
        return await _served(
            service, rpc, metadata, run, functools.partial(_proto_attributes, request)
        )
    except _Failed as failure:
        grpc_context.set_code(failure.code)
        grpc_context.set_details(failure.message)
        return response_type()


def _served_by_grpc(wrapper: Any) -> Any:
    """`wrapper` with its own signature: Serve hands a method the gRPC context only when
    its signature names `grpc_context`, and functools.wraps would show the handler's
    (request, call) instead."""
    del wrapper.__wrapped__
    return wrapper


class ServiceEndpoint:
    """Mixin of every service deployment: its `batch_rpc`s, callable by the in-cluster
    handle route with the plain API's dataclasses.

    Why this is no hole in "never unpickle what a caller could have written": the handle
    route exists only inside the Ray cluster, whose members can already run any code on
    it (that is what a Ray driver does); nothing on a gRPC port unpickles. `call_api` is
    no gRPC method (the servicers register only the proto's RPCs, so the proxy and a
    replica's own port answer UNIMPLEMENTED for it), and it still checks what it is
    given: a request of the RPC's own dataclass, whose tensors are ones the codec could
    have carried.
    """

    async def call_api(self, request: Any, metadata: tuple[tuple[str, str], ...]) -> Answer:
        rpc = getattr(type(request), "RPC", None)
        method = getattr(type(self), rpc, None) if isinstance(rpc, str) else None
        plain_api = getattr(method, "plain_api", None)
        if plain_api is None or not isinstance(request, plain_api[0]):
            return Answer(
                "UNIMPLEMENTED",
                f"{type(request).__name__} is no request of this service's plain API",
            )
        request_type, handler = plain_api

        async def run(call: Call) -> Any:
            check_handed_batch(request.batch)
            return await handler(self, request, call)

        def describe(response: Any) -> dict[str, Any]:
            return {"rlserve.route": "handle", **_plain_attributes(request, response)}

        try:
            metadata = tuple((str(key), str(value)) for key, value in metadata)
            response = await _served(request_type.SERVICE, rpc, metadata, run, describe)
        except _Failed as failure:
            return Answer(failure.code.name, failure.message)
        return Answer("OK", "", response)


def check_handed_batch(batch: Any) -> None:
    """CodecError unless `batch` is a Batch the codec could have carried (its dtypes,
    on the CPU): the handle route accepts no more than gRPC does."""
    from rlserve.core.batch import Batch
    from rlserve.core.codec import check_wire_dtype

    if not isinstance(batch, Batch):
        raise CodecError(f"batch: expected an rlserve Batch, got {type(batch).__name__}")
    for key, tensor in batch.tensors.items():
        check_wire_dtype(tensor, f"tensors[{key!r}]")
        if tensor.device.type != "cpu":
            raise CodecError(f"tensors[{key!r}]: must be on the CPU, is on {tensor.device}")


def _service_name(response_type: Any, rpc: str) -> str:
    """The gRPC service that answers `rpc` with `response_type` (from the proto
    descriptors), e.g. "RolloutService"; the proto package when none matches."""
    descriptor = getattr(response_type, "DESCRIPTOR", None)
    if descriptor is None:
        return "unknown"
    for service in descriptor.file.services_by_name.values():
        method = service.methods_by_name.get(rpc)
        if method is not None and method.output_type is descriptor:
            return service.name
    return descriptor.file.package


def _call_attributes(
    metadata: Iterable[tuple[str, Any]], attributes: dict[str, Any]
) -> dict[str, Any]:
    """`attributes` and the role (the Serve application the call named)."""
    for key, value in metadata:
        if key == "application":
            return {"rlserve.role": value, **attributes}
    return attributes


def _proto_attributes(request: Any, response: Any) -> dict[str, Any]:
    """Attributes worth filtering on, read from any rlserve protobuf request/response:
    step, batch size, tokens, weights version, message sizes."""
    attributes: dict[str, Any] = {"rlserve.request_bytes": request.ByteSize()}
    fields = request.DESCRIPTOR.fields_by_name
    if "step" in fields:
        # requests number steps from 0; traces, like metrics and checkpoints, from 1
        attributes["rlserve.step"] = request.step + 1
    rows = _batch_rows(request, "batch") or _batch_rows(request, "prompts")
    if rows is not None:
        attributes["rlserve.batch_size"] = rows
    if response is not None:
        attributes["rlserve.response_bytes"] = response.ByteSize()
        fields = response.DESCRIPTOR.fields_by_name
        if "weights_version" in fields:
            attributes["rlserve.weights_version"] = response.weights_version
        elif "batch" in fields and response.batch.HasField("meta"):
            attributes["rlserve.weights_version"] = response.batch.meta.weights_version
        if "metrics" in fields:
            attributes.update(_token_attributes(response.metrics))
    return attributes


def _plain_attributes(request: Any, response: Any) -> dict[str, Any]:
    """`_proto_attributes` for a call of the plain API (rlserve.core.api)."""
    attributes: dict[str, Any] = {"rlserve.batch_size": len(request.batch)}
    step = getattr(request, "step", None)
    if step is not None:
        attributes["rlserve.step"] = step + 1
    if response is not None:
        version = getattr(response, "weights_version", None)
        batch = getattr(response, "batch", None)
        if version is None and batch is not None:
            version = batch.meta.get("weights_version")
        if isinstance(version, int):
            attributes["rlserve.weights_version"] = version
        attributes.update(_token_attributes(response.metrics))
    return attributes


def _token_attributes(metrics: Mapping[str, float]) -> dict[str, int]:
    attributes = {}
    for name in ("tokens", "generated_tokens"):  # a generation's count wins
        if name in metrics:
            attributes["rlserve.tokens"] = int(metrics[name])
    return attributes


def _batch_rows(message: Any, field: str) -> int | None:
    """Rows of the rlserve.v1.Batch in `message.<field>` (its first tensor's first dim)."""
    if field not in message.DESCRIPTOR.fields_by_name or not message.HasField(field):
        return None
    for tensor in getattr(message, field).tensors.values():
        return int(tensor.shape[0]) if tensor.shape else None
    return None


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
