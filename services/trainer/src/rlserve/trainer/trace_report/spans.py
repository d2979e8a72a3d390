"""Spans from OTLP/JSON and Jaeger JSON, normalised to one `Span` model (see the
package docstring for the formats)."""

import base64
import binascii
import json
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

STEP_SPAN_NAME = "ppo.step"
STEP_ATTRIBUTE = "rlserve.step"
RPC_CLIENT_PREFIX = "rpc.client/"
RPC_SERVER_PREFIX = "rpc.server/"
# OTLP's SpanKind enum (opentelemetry/proto/trace/v1/trace.proto).
_OTLP_KINDS = {
    0: "unspecified",
    1: "internal",
    2: "server",
    3: "client",
    4: "producer",
    5: "consumer",
}
_HEX = re.compile(r"[0-9a-fA-F]+")


class TraceFormatError(ValueError):
    """A file that is neither OTLP/JSON nor Jaeger JSON, or a malformed span in it."""


@dataclass(frozen=True)
class Span:
    """One span, whatever format it came from. Ids are lower-case hex."""

    trace_id: str
    span_id: str
    parent_id: str | None
    name: str
    service: str
    start_ns: int
    end_ns: int
    attributes: dict[str, Any] = field(default_factory=dict, hash=False, compare=False)
    kind: str = "internal"
    """client, server, internal, producer, consumer or unspecified."""

    @property
    def duration_ns(self) -> int:
        return self.end_ns - self.start_ns

    @property
    def is_rpc_client(self) -> bool:
        return self.name.startswith(RPC_CLIENT_PREFIX) or self.kind == "client"

    @property
    def is_rpc_server(self) -> bool:
        return self.name.startswith(RPC_SERVER_PREFIX) or self.kind == "server"


def _hex_id(value: Any, hex_length: int, what: str) -> str | None:
    """An id as hex: OTLP/JSON uses hex, protobuf's plain JSON mapping base64."""
    if value in (None, ""):
        return None
    if not isinstance(value, str):
        raise TraceFormatError(f"{what}: expected a string, got {value!r}")
    if len(value) <= hex_length and _HEX.fullmatch(value):
        # Jaeger formats ids with %x: leading zeros (a 64-bit trace id's zero high half)
        # are dropped. Base64 ids of 8 or 16 bytes always end in '=', so never match.
        return value.lower().rjust(hex_length, "0")
    try:
        raw = base64.b64decode(value, validate=True)
    except binascii.Error:
        raise TraceFormatError(f"{what}: neither hex nor base64: {value!r}") from None
    return raw.hex() if raw.strip(b"\0") else None


def _otlp_value(value: dict[str, Any]) -> Any:
    if "stringValue" in value:
        return value["stringValue"]
    if "intValue" in value:
        return int(value["intValue"])
    if "doubleValue" in value:
        return float(value["doubleValue"])
    if "boolValue" in value:
        return bool(value["boolValue"])
    if "arrayValue" in value:
        return [_otlp_value(v) for v in value["arrayValue"].get("values", [])]
    if "kvlistValue" in value:
        return _otlp_attributes(value["kvlistValue"].get("values", []))
    if "bytesValue" in value:
        return value["bytesValue"]
    return None


def _otlp_attributes(attributes: Iterable[dict[str, Any]]) -> dict[str, Any]:
    return {a["key"]: _otlp_value(a.get("value", {})) for a in attributes}


def spans_from_otlp_json(request: dict[str, Any]) -> list[Span]:
    """Spans of one OTLP/JSON ExportTraceServiceRequest (or TracesData) object."""
    if "result" in request and isinstance(request["result"], dict):
        request = request["result"]  # Jaeger's /api/v3/traces wraps it
    spans = []
    for resource_spans in request.get("resourceSpans", []):
        resource = _otlp_attributes(resource_spans.get("resource", {}).get("attributes", []))
        service = str(resource.get("service.name", "unknown"))
        scopes = resource_spans.get("scopeSpans") or resource_spans.get(
            "instrumentationLibrarySpans", []
        )
        for scope_spans in scopes:
            for raw in scope_spans.get("spans", []):
                name = raw.get("name", "")
                trace_id = _hex_id(raw.get("traceId"), 32, f"span {name!r} traceId")
                span_id = _hex_id(raw.get("spanId"), 16, f"span {name!r} spanId")
                if trace_id is None or span_id is None:
                    raise TraceFormatError(f"span {name!r}: missing traceId or spanId")
                kind = raw.get("kind", 1)
                if isinstance(kind, str):  # enum by name: SPAN_KIND_CLIENT
                    kind = kind.removeprefix("SPAN_KIND_").lower()
                else:
                    kind = _OTLP_KINDS.get(int(kind), "unspecified")
                spans.append(
                    Span(
                        trace_id=trace_id,
                        span_id=span_id,
                        parent_id=_hex_id(raw.get("parentSpanId"), 16, f"span {name!r} parent"),
                        name=name,
                        service=service,
                        start_ns=int(raw["startTimeUnixNano"]),
                        end_ns=int(raw["endTimeUnixNano"]),
                        attributes=_otlp_attributes(raw.get("attributes", [])),
                        kind=kind,
                    )
                )
    return spans


def _jaeger_tags(tags: Iterable[dict[str, Any]]) -> dict[str, Any]:
    return {tag["key"]: tag.get("value") for tag in tags}


def spans_from_jaeger_json(document: dict[str, Any] | list[Any]) -> list[Span]:
    """Spans of Jaeger's trace JSON: {"data": [trace, ...]}, [trace, ...] or one trace."""
    traces = document.get("data", [document]) if isinstance(document, dict) else document
    spans = []
    for jaeger_trace in traces:
        processes = jaeger_trace.get("processes", {})
        for raw in jaeger_trace.get("spans", []):
            name = raw.get("operationName", "")
            parent = next(
                (
                    ref["spanID"]
                    for ref in raw.get("references", [])
                    if ref.get("refType") == "CHILD_OF"
                ),
                None,
            )
            process = raw.get("process") or processes.get(raw.get("processID"), {})
            tags = _jaeger_tags(raw.get("tags", []))
            start_ns = int(raw["startTime"]) * 1000  # Jaeger's unit is the microsecond
            spans.append(
                Span(
                    trace_id=_hex_id(raw["traceID"], 32, f"span {name!r} traceID") or "",
                    span_id=_hex_id(raw["spanID"], 16, f"span {name!r} spanID") or "",
                    parent_id=_hex_id(parent, 16, f"span {name!r} reference"),
                    name=name,
                    service=str(process.get("serviceName", "unknown")),
                    start_ns=start_ns,
                    end_ns=start_ns + int(raw["duration"]) * 1000,
                    attributes={
                        k: v
                        for k, v in tags.items()
                        if k not in ("span.kind", "internal.span.format")
                    },
                    kind=str(tags.get("span.kind", "internal")),
                )
            )
    return spans


def _documents(text: str, path: str) -> list[Any]:
    """One JSON document, or one per line (the file exporter's OTLP/JSON lines)."""
    try:
        return [json.loads(text)]
    except json.JSONDecodeError:
        pass
    documents = []
    for number, line in enumerate(text.splitlines(), 1):
        if line.strip():
            try:
                documents.append(json.loads(line))
            except json.JSONDecodeError as error:
                raise TraceFormatError(f"{path}:{number}: not JSON ({error.msg})") from None
    return documents


def _looks_like_jaeger(document: Any) -> bool:
    if isinstance(document, list):
        return bool(document) and isinstance(document[0], dict) and "spans" in document[0]
    return isinstance(document, dict) and ("data" in document or "processes" in document)


def read_spans(path: str | Path, fmt: str = "auto") -> list[Span]:
    """Every span in `path`; `fmt` is "otlp", "jaeger" or "auto" (decided per document)."""
    text = Path(path).read_text()
    spans = []
    for document in _documents(text, str(path)):
        jaeger = _looks_like_jaeger(document) if fmt == "auto" else fmt == "jaeger"
        if jaeger:
            spans += spans_from_jaeger_json(document)
        elif isinstance(document, dict) and ("resourceSpans" in document or "result" in document):
            spans += spans_from_otlp_json(document)
        else:
            raise TraceFormatError(f"{path}: neither OTLP/JSON nor Jaeger trace JSON")
    return spans
