"""`rlserve trace report`: where the time of each PPO step went, from its trace.

Reads spans from OTLP/JSON (the lines `rlserve.core.tracing`'s file exporter writes, or
any ExportTraceServiceRequest-shaped JSON, e.g. Jaeger's /api/v3 answer) and from
Jaeger's trace JSON (the UI's "Download JSON" / `/api/traces` answer), normalises both to
one `Span` model, and reports each PPO step (a trace whose root span is `ppo.step`,
numbered by its `rlserve.step` attribute):

- **Critical path** — the chain of work that set the step's duration. Definition (the
  one Jaeger's UI uses): start at the root's end; take the child that ends last (before
  the current point); recurse into it; move the current point to that child's start and
  repeat with the children that end before it; time in a span not covered by the chosen
  children is that span's own ("self") time on the path. Children are clipped to their
  parent's interval (clock skew between hosts). The path's segments tile the root's
  interval exactly, so per-stage path time adds up to the step duration. Concurrent
  siblings that finished earlier are off the path: shortening them would not shorten
  the step.
- **Time per service and per stage** (stage = span name): wall time (the union of the
  spans' intervals) and self time (duration minus the union of its children), summed.
- **RPC overhead** — for each client span `rpc.client/<Service>/<Rpc>`: the time not
  covered by the server's work spans (the children of the matching
  `rpc.server/<Service>/<Rpc>` spans, i.e. those parented on the client span). Split
  into *transport* (client time outside every server span: Serve's proxy, network,
  queueing for a replica, client-side (de)serialisation) and *in-service* (server time
  outside its work spans: request decoding, validation, response encoding). A server
  span without child spans cannot be split, so its whole time counts as work and the
  call is marked `uninstrumented`; a client span without a server span (that service's
  tracing is off) is all transport and marked `unmatched`.

Each step's report opens with one `bottleneck:` line (the service holding most of the
critical path, its largest stage there, every service's share), and the summary of
several steps with each service's mean share.

Plus a PNG timeline of one step: one row per service, spans as bars (nested spans in
sub-lanes), the critical path marked under each row.
"""

import argparse
import base64
import binascii
import json
import re
import sys
from collections import defaultdict
from collections.abc import Iterable, Sequence
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
NS_PER_MS = 1_000_000


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


# --- reading --------------------------------------------------------------------------


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


# --- analysis -------------------------------------------------------------------------


@dataclass
class StepTrace:
    """The spans of one PPO step's trace."""

    step: int | None
    trace_id: str
    root: Span
    spans: list[Span]
    orphans: list[Span]
    """Spans whose parent is not in the trace (lost, unsampled or not yet exported)."""


def find_steps(spans: Iterable[Span]) -> list[StepTrace]:
    """The PPO steps among `spans` (traces rooted at `ppo.step`), in step order.

    The same span read twice (e.g. two files) is kept once.
    """
    by_trace: dict[str, dict[str, Span]] = defaultdict(dict)
    for span in spans:
        by_trace[span.trace_id][span.span_id] = span
    steps = []
    for trace_id, members in by_trace.items():
        roots = [s for s in members.values() if s.parent_id is None and s.name == STEP_SPAN_NAME]
        if not roots:
            continue
        root = min(roots, key=lambda s: s.start_ns)
        orphans = [
            s for s in members.values() if s.parent_id is not None and s.parent_id not in members
        ]
        step = root.attributes.get(STEP_ATTRIBUTE)
        steps.append(
            StepTrace(
                step=int(step) if step is not None else None,
                trace_id=trace_id,
                root=root,
                spans=sorted(members.values(), key=lambda s: (s.start_ns, -s.end_ns)),
                orphans=orphans,
            )
        )
    return sorted(steps, key=lambda t: (t.step is None, t.step or 0, t.root.start_ns))


def children_by_parent(spans: Iterable[Span]) -> dict[str, list[Span]]:
    children: dict[str, list[Span]] = defaultdict(list)
    for span in spans:
        if span.parent_id is not None:
            children[span.parent_id].append(span)
    return children


def union_ns(intervals: Iterable[tuple[int, int]]) -> int:
    """Length of the union of half-open intervals."""
    total, current_start, current_end = 0, None, None
    for start, end in sorted(intervals):
        if end <= start:
            continue
        if current_end is None or start > current_end:
            if current_end is not None:
                total += current_end - current_start
            current_start, current_end = start, end
        else:
            current_end = max(current_end, end)
    if current_end is not None:
        total += current_end - current_start
    return total


def _clip(intervals: Iterable[tuple[int, int]], low: int, high: int) -> list[tuple[int, int]]:
    return [(max(s, low), min(e, high)) for s, e in intervals if min(e, high) > max(s, low)]


def self_ns(span: Span, children: dict[str, list[Span]]) -> int:
    """The span's duration not covered by any of its children."""
    kids = _clip(
        ((c.start_ns, c.end_ns) for c in children.get(span.span_id, [])), span.start_ns, span.end_ns
    )
    return span.duration_ns - union_ns(kids)


@dataclass(frozen=True)
class Segment:
    """A stretch of the critical path spent in `span`'s own time."""

    span: Span
    start_ns: int
    end_ns: int

    @property
    def duration_ns(self) -> int:
        return self.end_ns - self.start_ns


def critical_path(root: Span, children: dict[str, list[Span]]) -> list[Segment]:
    """The critical path under `root` as chronological segments (see module docstring).

    The segments tile [root.start_ns, root.end_ns]; each names the span whose own time
    the path runs through.
    """
    segments: list[Segment] = []

    def walk(span: Span, low: int, high: int) -> None:
        kids = []
        for child in children.get(span.span_id, []):
            start, end = max(child.start_ns, low), min(child.end_ns, high)
            if end > start:
                kids.append((start, end, child))
        # Latest end first; on a tie the longer child (it started earlier) wins.
        kids.sort(key=lambda kid: (-kid[1], kid[0], kid[2].span_id))
        point = high
        for start, end, child in kids:
            if end > point:
                continue  # overlaps the child already on the path: ran concurrently
            if end < point:
                segments.append(Segment(span, end, point))
            walk(child, start, end)
            point = start
            if point <= low:
                break
        if point > low:
            segments.append(Segment(span, low, point))

    walk(root, root.start_ns, root.end_ns)
    segments.reverse()
    return segments


@dataclass(frozen=True)
class Usage:
    count: int
    wall_ns: int
    """Union of the spans' intervals."""
    self_ns: int
    """Sum of the spans' own time (children excluded)."""


def usage_by(spans: Sequence[Span], children: dict[str, list[Span]], key: str) -> dict[str, Usage]:
    """Usage per `key` ("service" or "name"), in order of first start."""
    groups: dict[str, list[Span]] = defaultdict(list)
    for span in sorted(spans, key=lambda s: s.start_ns):
        groups[getattr(span, key)].append(span)
    return {
        group: Usage(
            count=len(members),
            wall_ns=union_ns((s.start_ns, s.end_ns) for s in members),
            self_ns=sum(self_ns(s, children) for s in members),
        )
        for group, members in groups.items()
    }


@dataclass(frozen=True)
class RpcOverhead:
    """Time of one client call not spent in the server's work spans."""

    client: Span
    server_ns: int
    """Client time covered by server spans (the union of retries' server spans)."""
    work_ns: int
    """Client time covered by the servers' work spans."""
    matched: bool
    """A server span continued this call's trace."""
    instrumented: bool
    """Every server span had work spans (else its whole time counted as work)."""

    @property
    def transport_ns(self) -> int:
        return self.client.duration_ns - self.server_ns

    @property
    def in_service_ns(self) -> int:
        return self.server_ns - self.work_ns

    @property
    def overhead_ns(self) -> int:
        return self.client.duration_ns - self.work_ns


def rpc_overheads(spans: Sequence[Span], children: dict[str, list[Span]]) -> list[RpcOverhead]:
    """One RpcOverhead per client span, in start order (see module docstring)."""
    found = []
    for client in sorted((s for s in spans if s.is_rpc_client), key=lambda s: s.start_ns):
        low, high = client.start_ns, client.end_ns
        servers = [c for c in children.get(client.span_id, []) if c.is_rpc_server]
        work, instrumented = [], True
        for server in servers:
            # Clipped to the server span, and it to the client span (clock skew).
            server_low, server_high = max(server.start_ns, low), min(server.end_ns, high)
            server_children = children.get(server.span_id, [])
            if server_children:
                spans_of_work = ((c.start_ns, c.end_ns) for c in server_children)
                work += _clip(spans_of_work, server_low, server_high)
            else:
                work += _clip([(server.start_ns, server.end_ns)], server_low, server_high)
                instrumented = False
        server_ns = union_ns(_clip(((s.start_ns, s.end_ns) for s in servers), low, high))
        found.append(
            RpcOverhead(
                client=client,
                server_ns=server_ns,
                work_ns=union_ns(work),
                matched=bool(servers),
                instrumented=instrumented,
            )
        )
    return found


@dataclass
class StepReport:
    step: StepTrace
    duration_ns: int
    path: list[Segment]
    path_by_stage: dict[tuple[str, str], int]
    """(service, span name) → critical-path time, largest first."""
    services: dict[str, Usage]
    stages: dict[tuple[str, str], Usage]
    """(service, span name) → usage."""
    rpcs: list[RpcOverhead]

    @property
    def path_by_service(self) -> dict[str, int]:
        """service → critical-path time, largest first."""
        totals: dict[str, int] = defaultdict(int)
        for (service, _), ns in self.path_by_stage.items():
            totals[service] += ns
        return dict(sorted(totals.items(), key=lambda item: -item[1]))

    @property
    def rpc_overhead_ns(self) -> int:
        return sum(r.overhead_ns for r in self.rpcs)

    @property
    def path_rpc_overhead_ns(self) -> int:
        """Critical-path time spent in RPC spans' own time (transport, (de)coding)."""
        return sum(s.duration_ns for s in self.path if s.span.is_rpc_client or s.span.is_rpc_server)


def analyse_step(step: StepTrace) -> StepReport:
    children = children_by_parent(step.spans)
    path = critical_path(step.root, children)
    by_stage: dict[tuple[str, str], int] = defaultdict(int)
    for segment in path:
        by_stage[(segment.span.service, segment.span.name)] += segment.duration_ns
    stage_groups: dict[tuple[str, str], list[Span]] = defaultdict(list)
    for span in step.spans:
        stage_groups[(span.service, span.name)].append(span)
    stages = {
        key: Usage(
            count=len(members),
            wall_ns=union_ns((s.start_ns, s.end_ns) for s in members),
            self_ns=sum(self_ns(s, children) for s in members),
        )
        for key, members in stage_groups.items()
    }
    return StepReport(
        step=step,
        duration_ns=step.root.duration_ns,
        path=path,
        path_by_stage=dict(sorted(by_stage.items(), key=lambda item: -item[1])),
        services=usage_by(step.spans, children, "service"),
        stages=dict(sorted(stages.items(), key=lambda item: -item[1].self_ns)),
        rpcs=rpc_overheads(step.spans, children),
    )


# --- output ---------------------------------------------------------------------------


def _ms(ns: int) -> str:
    return f"{ns / NS_PER_MS:9.1f}"


def _pct(ns: int, total: int) -> str:
    return f"{100 * ns / total:5.1f}%" if total else "    -"


def merged_path(path: Sequence[Segment]) -> list[Segment]:
    """Consecutive segments of the same span joined (a span resumed between children
    shows as several segments)."""
    merged: list[Segment] = []
    for segment in path:
        if merged and merged[-1].span.span_id == segment.span.span_id:
            last = merged.pop()
            merged.append(Segment(segment.span, last.start_ns, segment.end_ns))
        else:
            merged.append(segment)
    return merged


def bottleneck(report: StepReport) -> str:
    """One line: the service holding most of the critical path, its largest stage there,
    and every service's share of the path."""
    total = report.duration_ns
    by_service = report.path_by_service
    if not by_service:
        return "bottleneck: none (an empty step)"
    service, ns = next(iter(by_service.items()))
    stage, stage_ns = next((n, t) for (s, n), t in report.path_by_stage.items() if s == service)
    shares = ", ".join(f"{s} {_pct(t, total).strip()}" for s, t in by_service.items())
    return (
        f"bottleneck: {service}, {_pct(ns, total).strip()} of the critical path (largest "
        f"stage {stage}, {_pct(stage_ns, total).strip()}); by service: {shares}"
    )


def format_step(report: StepReport, path_limit: int = 40) -> str:
    step, total = report.step, report.duration_ns
    label = "?" if step.step is None else step.step
    lines = [
        f"step {label}  trace {step.trace_id}  {total / NS_PER_MS:.1f} ms  "
        f"{len(step.spans)} spans" + (f"  ({len(step.orphans)} orphans)" if step.orphans else ""),
        f"  {bottleneck(report)}",
        "  critical path (chronological; own time of each span on the path):",
        "     start ms        ms      %  span (service)",
    ]
    origin = step.root.start_ns
    path = [s for s in report.path if s.duration_ns > 0]
    for segment in path[:path_limit]:
        lines.append(
            f"    {_ms(segment.start_ns - origin)} {_ms(segment.duration_ns)} "
            f"{_pct(segment.duration_ns, total)}  {segment.span.name} ({segment.span.service})"
        )
    if len(path) > path_limit:
        lines.append(f"    ... {len(path) - path_limit} more segments")
    lines.append("  critical path by stage:")
    for (service, name), ns in report.path_by_stage.items():
        lines.append(f"    {_ms(ns)} ms {_pct(ns, total)}  {name} ({service})")
    lines.append("  per service:\n    spans   wall ms   self ms  service")
    for service, usage in report.services.items():
        lines.append(f"    {usage.count:5d} {_ms(usage.wall_ns)} {_ms(usage.self_ns)}  {service}")
    lines.append("  per stage, by self time:\n    calls   wall ms   self ms  span (service)")
    for (service, name), usage in report.stages.items():
        lines.append(
            f"    {usage.count:5d} {_ms(usage.wall_ns)} {_ms(usage.self_ns)}  {name} ({service})"
        )
    if report.rpcs:
        lines.append(
            "  RPC overhead (client time outside the server's work spans):\n"
            "    call                                       client ms  transport  in-service"
            "   overhead"
        )
        for rpc in report.rpcs:
            note = "" if rpc.matched else "  unmatched"
            note += "" if rpc.instrumented else "  uninstrumented"
            call = rpc.client.name.removeprefix(RPC_CLIENT_PREFIX)
            lines.append(
                f"    {call:<42} {_ms(rpc.client.duration_ns)}  {_ms(rpc.transport_ns)}  "
                f"{_ms(rpc.in_service_ns)}  {_ms(rpc.overhead_ns)}{note}"
            )
        lines.append(
            f"    total {report.rpc_overhead_ns / NS_PER_MS:.1f} ms summed over calls; "
            f"{report.path_rpc_overhead_ns / NS_PER_MS:.1f} ms "
            f"({_pct(report.path_rpc_overhead_ns, total).strip()}) on the critical path"
        )
    return "\n".join(lines)


def format_summary(reports: Sequence[StepReport]) -> str:
    """Mean critical-path time per stage over all steps."""
    totals: dict[tuple[str, str], int] = defaultdict(int)
    for report in reports:
        for key, ns in report.path_by_stage.items():
            totals[key] += ns
    count = len(reports)
    mean_step = sum(r.duration_ns for r in reports) / count
    by_service: dict[str, int] = defaultdict(int)
    for (service, _), ns in totals.items():
        by_service[service] += ns
    shares = sorted(by_service.items(), key=lambda item: -item[1])
    lines = [
        f"{count} steps, mean {mean_step / NS_PER_MS:.1f} ms; share of the critical path: "
        + ", ".join(f"{s} {_pct(ns / count, mean_step).strip()}" for s, ns in shares),
        "mean critical-path time per stage:",
    ]
    for (service, name), ns in sorted(totals.items(), key=lambda item: -item[1]):
        lines.append(
            f"    {_ms(round(ns / count))} ms {_pct(ns / count, mean_step)}  {name} ({service})"
        )
    return "\n".join(lines)


def _stage_label(name: str) -> str:
    """A span's label on the timeline: an RPC's client and server share "Service/Rpc"."""
    return name.removeprefix(RPC_CLIENT_PREFIX).removeprefix(RPC_SERVER_PREFIX)


def timeline_lanes(spans: Sequence[Span]) -> dict[str, int]:
    """Sub-lane of each span within its service's row: below its parent when the parent
    ran in the same service, and never overlapping another bar of the same lane
    (concurrent calls get lanes of their own). Greedy, in start order."""
    by_id = {s.span_id: s for s in spans}
    lanes: dict[str, int] = {}
    busy: dict[tuple[str, int], list[tuple[int, int]]] = defaultdict(list)
    for span in sorted(spans, key=lambda s: (s.start_ns, -s.end_ns)):
        parent = by_id.get(span.parent_id or "")
        lane = 0
        if parent is not None and parent.service == span.service and parent.span_id in lanes:
            lane = lanes[parent.span_id] + 1
        while any(
            start < span.end_ns and span.start_ns < end for start, end in busy[(span.service, lane)]
        ):
            lane += 1
        lanes[span.span_id] = lane
        busy[(span.service, lane)].append((span.start_ns, span.end_ns))
    return lanes


def plot_timeline(report: StepReport, path: str | Path) -> Path:
    """Writes a PNG timeline of one step: a row per service (sub-lanes for nesting and
    concurrency), a bar per span (an RPC's client bar pale, its server bar solid, both in
    the RPC's colour), the critical path as a red line over each row."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    step = report.step
    origin = step.root.start_ns
    services = list(report.services)
    lanes = timeline_lanes(step.spans)
    lane_count: dict[str, int] = defaultdict(lambda: 1)
    for span in step.spans:
        lane_count[span.service] = max(lane_count[span.service], lanes[span.span_id] + 1)
    # Rows as tall as their lanes need; y grows downwards.
    lane_height = 0.5
    row_top: dict[str, float] = {}
    top = 0.0
    for service in services:
        row_top[service] = top
        top += lane_count[service] * lane_height + 0.5
    total_ms = report.duration_ns / NS_PER_MS
    figure_width_in = 14.0
    figure, axes = plt.subplots(figsize=(figure_width_in, 1.4 + 0.55 * top))
    # Colours by first appearance: distinct for the first 20 stages.
    palette = matplotlib.colormaps["tab20"]
    stage_labels = dict.fromkeys(_stage_label(s.name) for s in step.spans)
    colors = {label: palette(index % 20) for index, label in enumerate(stage_labels)}
    # Label width estimate: ≈ 0.075 in per character at font size 7.
    ms_per_char = total_ms * 0.075 / (figure_width_in * 0.85)
    for span in step.spans:
        label = _stage_label(span.name)
        bottom = row_top[span.service] + 0.3 + lanes[span.span_id] * lane_height
        start_ms = (span.start_ns - origin) / NS_PER_MS
        width_ms = span.duration_ns / NS_PER_MS
        axes.broken_barh(
            [(start_ms, width_ms)],
            (bottom, lane_height * 0.9),
            facecolors=colors[label],
            alpha=0.45 if span.is_rpc_client else 1.0,
            edgecolor="black",
            linewidth=0.3,
        )
        fitting = int(width_ms / ms_per_char)
        if fitting >= 4:
            text = label if len(label) <= fitting else label[: fitting - 1] + "…"
            axes.text(
                start_ms + width_ms / 2,
                bottom + lane_height * 0.45,
                text,
                ha="center",
                va="center",
                fontsize=7,
            )
    for segment in report.path:
        y = row_top[segment.span.service] + 0.15
        axes.plot(
            [(segment.start_ns - origin) / NS_PER_MS, (segment.end_ns - origin) / NS_PER_MS],
            [y, y],
            color="red",
            linewidth=2.5,
            solid_capstyle="butt",
        )
    axes.set_yticks(
        [row_top[s] + 0.3 + lane_count[s] * lane_height / 2 for s in services], services
    )
    for service in services[1:]:
        axes.axhline(row_top[service] - 0.1, color="grey", linewidth=0.5)
    axes.set_ylim(top, 0)
    axes.set_xlim(0, total_ms)
    axes.set_xlabel("ms since step start (red: critical path; pale: RPC client side)")
    label = "?" if step.step is None else step.step
    axes.set_title(f"PPO step {label} — {total_ms:.1f} ms — trace {step.trace_id}")
    axes.grid(axis="x", linewidth=0.3)
    figure.tight_layout()
    path = Path(path)
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return path


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="rlserve trace report",
        description="Per PPO step: critical path, time per service/stage, RPC overhead.",
    )
    parser.add_argument("files", nargs="+", type=Path, help="OTLP/JSON(-lines) or Jaeger JSON")
    parser.add_argument("--format", choices=["auto", "otlp", "jaeger"], default="auto")
    parser.add_argument("--step", type=int, help="report only this step (and plot it)")
    parser.add_argument("--timeline", type=Path, help="write a PNG timeline of one step here")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    spans: list[Span] = []
    for path in args.files:
        try:
            spans += read_spans(path, args.format)
        except (OSError, TraceFormatError, KeyError, ValueError) as error:
            print(f"trace report: {path}: {error}", file=sys.stderr)
            return 2
    steps = find_steps(spans)
    if args.step is not None:
        steps = [s for s in steps if s.step == args.step]
    if not steps:
        wanted = "" if args.step is None else f" for step {args.step}"
        print(
            f"trace report: no '{STEP_SPAN_NAME}' trace{wanted} among {len(spans)} spans",
            file=sys.stderr,
        )
        return 1
    reports = [analyse_step(step) for step in steps]
    for report in reports:
        print(format_step(report))
        print()
    if len(reports) > 1:
        print(format_summary(reports))
    if args.timeline is not None:
        written = plot_timeline(reports[0], args.timeline)
        print(f"timeline of step {reports[0].step.step}: {written}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
