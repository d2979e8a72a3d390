"""The one tracing set-up of every rlserve process (trainer, each service replica).

`setup_tracing(...)` is called once per process; `span(...)` opens spans; the trace
context crosses gRPC calls as W3C `traceparent`/`tracestate` metadata
(`inject_metadata` on the caller, `extract_context` in the deployment — Serve's proxy
passes incoming metadata through unchanged).

Design choices:
- **Off costs nothing.** When disabled no TracerProvider is built and `span()` hands back
  one shared do-nothing context manager (no OpenTelemetry call at all), so the
  instrumented code paths cost one function call per span (≈ 0.5 µs measured here).
- **Our own provider, not the process-global one.** rlserve spans come from the provider
  this module holds; `opentelemetry.trace.set_tracer_provider` is left alone, because it
  may be set only once per process (a re-set is ignored with a warning) and Ray Serve's
  own tracing may want it. This also lets a process call `setup_tracing` again (a
  replica reconfigured, a test) — the previous provider is flushed and shut down first.
- **Ids from the OS.** The SDK's default id generator draws from `random`, which the
  trainer and the training workers seed for reproducibility: two processes seeded alike
  would emit the same span and trace ids. `UrandomIdGenerator` uses `os.urandom`,
  which no seeding touches and which stays unique across fork.
- **Sampling is decided once per step.** ParentBased(TraceIdRatioBased(ratio)): the
  trainer's root span draws; every service follows the `sampled` flag it receives, so a
  step is traced whole or not at all.
- **Exporters.** OTLP over gRPC (Jaeger's collector takes it on port 4317; so does
  Phoenix, the backend of the tests) behind a BatchSpanProcessor, so export happens on a
  background thread, never on the request path, every EXPORT_DELAY_MS (1 s rather than
  the SDK's 5 s: a service's last spans must leave before a run tears its cluster
  down). Optionally also a file of OTLP/JSON lines (`OtlpJsonLinesExporter`) that
  `rlserve trace report` reads.
- **Ray workers inherit their controller's set-up.** `current_setup()` hands a process's
  settings to the worker actors it starts (rlserve.core.workers), and `trace_carrier()`
  the current context with each call, so a worker's spans join the caller's trace.
- **Every span names its service** in the span attribute `rlserve.service` too, not
  only in the resource's `service.name`: some backends drop resource attributes
  (Phoenix, the test backend, keeps none and files a whole trace under the project of
  its first span), and a span must still say where it ran. Costs ≈ 1 µs per span.
- **Attribute names.** rlserve's own attributes are `rlserve.<name>` (step, role,
  batch_size, tokens, weights_version, replica, node_id); `span()` takes them as keyword
  arguments without the prefix (`span("rollout.generate", tokens=n)` →
  `rlserve.tokens`), and fully named ones (`rpc.method`) in its `attributes` mapping.
"""

import base64
import contextlib
import json
import logging
import os
import socket
import threading
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from google.protobuf.json_format import MessageToDict
from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, Span, SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import (
    BatchSpanProcessor,
    SpanExporter,
    SpanExportResult,
)
from opentelemetry.sdk.trace.id_generator import IdGenerator
from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased
from opentelemetry.trace import SpanKind
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

logger = logging.getLogger(__name__)

ATTRIBUTE_PREFIX = "rlserve."
SERVICE_ATTRIBUTE = "rlserve.service"
TRACER_NAME = "rlserve"
# The W3C Trace Context headers: `traceparent` (trace id, parent span id, sampled flag)
# and `tracestate` (vendor data). gRPC metadata keys are lower case, as W3C asks.
_PROPAGATOR = TraceContextTextMapPropagator()
TRACE_METADATA_KEYS = frozenset(_PROPAGATOR.fields)
# How long shutdown / flush wait for exporters: an unreachable collector must not hang a
# process's exit (the SDK's own waits add up to tens of seconds: retries per batch).
FLUSH_TIMEOUT_S = 10.0
# Per export call to the OTLP collector, retries included.
OTLP_EXPORT_TIMEOUT_S = 10.0
# BatchSpanProcessor's export interval (the SDK's default is 5 s).
EXPORT_DELAY_MS = 1000

AttributeValue = str | bool | int | float | Sequence[str] | Sequence[bool] | Sequence[int]


class UrandomIdGenerator(IdGenerator):
    """Span and trace ids from os.urandom, untouched by `random.seed` / `torch.manual_seed`."""

    def generate_span_id(self) -> int:
        while True:
            span_id = int.from_bytes(os.urandom(8), "big")
            if span_id != trace.INVALID_SPAN_ID:
                return span_id

    def generate_trace_id(self) -> int:
        while True:
            trace_id = int.from_bytes(os.urandom(16), "big")
            if trace_id != trace.INVALID_TRACE_ID:
                return trace_id

    def is_trace_id_random(self) -> bool:
        # All 128 bits are random, so TraceIdRatioBased may sample on them.
        return True


def otlp_json(spans: Sequence[ReadableSpan]) -> dict[str, Any]:
    """`spans` as one OTLP/JSON ExportTraceServiceRequest object.

    The OTLP/JSON encoding of the OpenTelemetry protocol: protobuf's JSON mapping with
    lowerCamelCase names and enums as integers, except that trace and span ids are hex
    strings, not base64 (the OTLP spec's one deviation from the mapping). The
    collector's `otlpjsonfile` receiver and Jaeger's OTLP import read it.
    """
    request = MessageToDict(encode_spans(spans), use_integers_for_enums=True)
    for resource_spans in request.get("resourceSpans", []):
        for scope_spans in resource_spans.get("scopeSpans", []):
            for span_dict in scope_spans.get("spans", []):
                _ids_to_hex(span_dict)
                for link in span_dict.get("links", []):
                    _ids_to_hex(link)
    return request


def _ids_to_hex(message: dict[str, Any]) -> None:
    for key in ("traceId", "spanId", "parentSpanId"):
        if key in message:
            message[key] = base64.b64decode(message[key]).hex()


class _ServiceAttributeProcessor(SpanProcessor):
    """Stamps `rlserve.service` on every span as it starts (see the module docstring)."""

    def __init__(self, service_name: str):
        self.service_name = service_name

    def on_start(self, span: Span, parent_context: Context | None = None) -> None:
        span.set_attribute(SERVICE_ATTRIBUTE, self.service_name)


class OtlpJsonLinesExporter(SpanExporter):
    """Appends one OTLP/JSON ExportTraceServiceRequest line per exported batch to a file.

    Several processes may share one file: each batch is one `write` of one line to a
    file opened with O_APPEND, which Linux keeps whole on local file systems.
    """

    def __init__(self, path: str | os.PathLike[str]):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._fd: int | None = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        self._lock = threading.Lock()

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        line = (json.dumps(otlp_json(spans), separators=(",", ":")) + "\n").encode()
        with self._lock:
            if self._fd is None:
                return SpanExportResult.FAILURE
            os.write(self._fd, line)
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        with self._lock:
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None

    def force_flush(self, timeout_millis: int = 30_000) -> bool:
        return True


@dataclass(frozen=True)
class TracingSetup:
    """The arguments of this process's `setup_tracing` (picklable, for worker actors)."""

    service_name: str
    endpoint: str | None
    sampling_ratio: float
    file_path: str | None
    resource_attributes: dict[str, AttributeValue]


@dataclass
class _Tracing:
    provider: TracerProvider
    tracer: trace.Tracer
    setup: TracingSetup


_active: _Tracing | None = None
_active_lock = threading.Lock()


class _NoOpSpanContext:
    """The context manager `span()` returns while tracing is off: enters to INVALID_SPAN."""

    __slots__ = ()

    def __enter__(self) -> trace.Span:
        return trace.INVALID_SPAN

    def __exit__(self, *exc_info: object) -> None:
        return None


_NOOP_SPAN = _NoOpSpanContext()
_NOOP_TRACER = trace.NoOpTracer()


def setup_tracing(
    service_name: str,
    endpoint: str | None,
    sampling_ratio: float,
    enabled: bool,
    file_path: str | os.PathLike[str] | None = None,
    resource_attributes: Mapping[str, AttributeValue] | None = None,
) -> TracerProvider | None:
    """Configures this process's tracing; returns the provider, or None when disabled.

    Args:
        service_name: the `service.name` resource attribute (trainer, rollout, ...).
        endpoint: OTLP gRPC collector, e.g. "http://jaeger:4317"; None = no OTLP export.
        sampling_ratio: fraction of root traces (PPO steps) recorded, in [0, 1];
            processes that continue a caller's trace follow the caller's decision.
        enabled: False installs nothing and makes every rlserve span a no-op.
        file_path: also append OTLP/JSON lines to this file (for `rlserve trace report`).
        resource_attributes: more resource attributes, e.g. rlserve.replica,
            rlserve.node_id; host.name and process.pid are added.

    Calling it again replaces the previous set-up (which is flushed and shut down).
    """
    global _active
    if not 0.0 <= sampling_ratio <= 1.0:
        raise ValueError(f"sampling_ratio: must be in [0, 1], got {sampling_ratio}")
    if enabled and endpoint is None and file_path is None:
        raise ValueError("endpoint / file_path: tracing is enabled but neither is set")
    shutdown_tracing()
    if not enabled:
        return None
    resource = Resource.create(
        {
            "service.name": service_name,
            "host.name": socket.gethostname(),
            "process.pid": os.getpid(),
            **(resource_attributes or {}),
        }
    )
    provider = TracerProvider(
        resource=resource,
        sampler=ParentBased(TraceIdRatioBased(sampling_ratio)),
        id_generator=UrandomIdGenerator(),
    )
    provider.add_span_processor(_ServiceAttributeProcessor(service_name))
    if endpoint is not None:
        insecure = not endpoint.startswith("https://")
        exporter = OTLPSpanExporter(
            endpoint=endpoint, insecure=insecure, timeout=OTLP_EXPORT_TIMEOUT_S
        )
        provider.add_span_processor(
            BatchSpanProcessor(exporter, schedule_delay_millis=EXPORT_DELAY_MS)
        )
    if file_path is not None:
        provider.add_span_processor(
            BatchSpanProcessor(
                OtlpJsonLinesExporter(file_path), schedule_delay_millis=EXPORT_DELAY_MS
            )
        )
    setup = TracingSetup(
        service_name,
        endpoint,
        sampling_ratio,
        None if file_path is None else str(file_path),
        dict(resource_attributes or {}),
    )
    with _active_lock:
        _active = _Tracing(provider, provider.get_tracer(TRACER_NAME), setup)
    return provider


def shutdown_tracing(timeout_s: float = FLUSH_TIMEOUT_S) -> bool:
    """Exports what is pending, stops the exporters and turns tracing off.

    Waits at most `timeout_s` (spans still pending then are dropped, with a warning);
    returns True when everything was exported in time. A no-op when tracing is off.
    """
    global _active
    with _active_lock:
        active, _active = _active, None
    if active is None:
        return True
    return _within(active.provider.shutdown, timeout_s, "shutdown")


def flush_tracing(timeout_s: float = FLUSH_TIMEOUT_S) -> bool:
    """Exports every finished span now; True when all exporters finished in time."""
    active = _active
    if active is None:
        return True
    return _within(active.provider.force_flush, timeout_s, "flush")


def _within(call: Any, timeout_s: float, what: str) -> bool:
    """Runs `call` on a daemon thread and waits at most `timeout_s` for it.

    The SDK's BatchSpanProcessor ignores flush timeouts (opentelemetry-python #4568)
    and retries an unreachable collector per batch, so the bound is enforced here.
    """
    outcome: list[Any] = []
    worker = threading.Thread(
        target=lambda: outcome.append(call()), name=f"rlserve-tracing-{what}", daemon=True
    )
    worker.start()
    worker.join(timeout_s)
    if worker.is_alive():
        logger.warning(
            "tracing %s did not finish in %.0f s; pending spans dropped", what, timeout_s
        )
        return False
    return outcome[0] is not False


def tracing_enabled() -> bool:
    return _active is not None


def recording() -> bool:
    """Whether the current span records: tracing is on and this trace is sampled."""
    return _active is not None and trace.get_current_span().is_recording()


def current_setup() -> TracingSetup | None:
    """This process's tracing settings, or None while tracing is off."""
    active = _active
    return None if active is None else active.setup


def get_tracer() -> trace.Tracer:
    """rlserve's tracer: the configured one, or OpenTelemetry's no-op tracer when off."""
    active = _active
    return _NOOP_TRACER if active is None else active.tracer


def span(
    name: str,
    attributes: Mapping[str, AttributeValue] | None = None,
    *,
    kind: SpanKind = SpanKind.INTERNAL,
    context: Context | None = None,
    **rlserve_attributes: AttributeValue | None,
) -> contextlib.AbstractContextManager[trace.Span]:
    """A context manager opening span `name` as the current span (and closing it).

    `rlserve_attributes` are named without their `rlserve.` prefix (None values are
    dropped); `attributes` holds fully named ones. `context` parents the span on an
    extracted remote context instead of the current one. An exception leaving the block
    is recorded on the span, which is marked as an error. The span it enters to can take
    attributes known only later: `s.set_attribute("rlserve.tokens", n)`.
    """
    active = _active
    if active is None:
        return _NOOP_SPAN
    merged: dict[str, AttributeValue] = dict(attributes or {})
    for key, value in rlserve_attributes.items():
        if value is not None:
            merged[ATTRIBUTE_PREFIX + key] = value
    return active.tracer.start_as_current_span(name, context=context, kind=kind, attributes=merged)


def inject_metadata(metadata: Iterable[tuple[str, str]]) -> list[tuple[str, str]]:
    """`metadata` plus the W3C trace context of the current span, for an outgoing call.

    Without a current (sampled or not) span nothing is added, so this is free when
    tracing is off.
    """
    return [*metadata, *trace_carrier().items()]


def trace_carrier() -> dict[str, str]:
    """The current span's W3C trace context as a dict (`traceparent`, maybe
    `tracestate`); empty without a current span. Hand it to another process (a Ray
    worker) and continue there with `attached(extract_context(carrier.items()))`."""
    carrier: dict[str, str] = {}
    _PROPAGATOR.inject(carrier)
    return carrier


def extract_context(metadata: Iterable[tuple[str, Any]]) -> Context:
    """The caller's trace context from incoming gRPC metadata (an empty one if absent).

    Takes `grpc_context.invocation_metadata()` as it is; keys are matched in lower case.
    """
    carrier = {
        key.lower(): value
        for key, value in metadata
        if isinstance(value, str) and key.lower() in TRACE_METADATA_KEYS
    }
    return _PROPAGATOR.extract(carrier)


def rpc_client_span(
    service: str, method: str, **rlserve_attributes: AttributeValue | None
) -> contextlib.AbstractContextManager[trace.Span]:
    """The client span of one gRPC call: `rpc.client/<service>/<method>`.

    Open it around the call (retries included) and build the call's metadata inside it
    with `inject_metadata`, so the server span becomes its child.
    """
    return span(
        f"rpc.client/{service}/{method}",
        {"rpc.system": "grpc", "rpc.service": service, "rpc.method": method},
        kind=SpanKind.CLIENT,
        **rlserve_attributes,
    )


def rpc_server_span(
    service: str,
    method: str,
    invocation_metadata: Iterable[tuple[str, Any]],
    **rlserve_attributes: AttributeValue | None,
) -> contextlib.AbstractContextManager[trace.Span]:
    """The server span of one gRPC call, `rpc.server/<service>/<method>`, continuing the
    caller's trace from the incoming metadata."""
    if _active is None:
        return _NOOP_SPAN
    return span(
        f"rpc.server/{service}/{method}",
        {"rpc.system": "grpc", "rpc.service": service, "rpc.method": method},
        kind=SpanKind.SERVER,
        context=extract_context(invocation_metadata),
        **rlserve_attributes,
    )


def annotate(**rlserve_attributes: AttributeValue | None) -> None:
    """Sets `rlserve.<name>` attributes on the current span (None values skipped); free
    when the current span is not recording (tracing off, or the step not sampled)."""
    if _active is None:
        return
    current = trace.get_current_span()
    if current.is_recording():
        for key, value in rlserve_attributes.items():
            if value is not None:
                current.set_attribute(ATTRIBUTE_PREFIX + key, value)


def current_trace_ids() -> tuple[str, str] | None:
    """(trace id, span id) of the current span in hex, or None without one (for logs)."""
    span_context = trace.get_current_span().get_span_context()
    if not span_context.is_valid:
        return None
    return format(span_context.trace_id, "032x"), format(span_context.span_id, "016x")


@contextlib.contextmanager
def attached(context: Context) -> Iterator[None]:
    """Makes `context` current inside the block (e.g. in a worker thread or Ray task
    that continues a trace it received as metadata)."""
    token = otel_context.attach(context)
    try:
        yield
    finally:
        otel_context.detach(token)
