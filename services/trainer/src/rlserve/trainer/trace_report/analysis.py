"""One PPO step's trace analysed: its critical path, time per service and stage, and
each RPC's overhead (definitions in the package docstring)."""

from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from rlserve.trainer.trace_report.spans import STEP_ATTRIBUTE, STEP_SPAN_NAME, Span


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


TOOL_SPAN_PREFIX = "agent.tool/"
"""A multi-turn rollout's tool call (rlserve.rollout.agent_loop), named by its tool."""


@dataclass
class ToolUsage:
    """One tool's calls in a step."""

    calls: int
    total_ns: int
    """Their durations summed (calls run concurrently, so this can pass the step's)."""
    slowest_ns: int


def tool_usage(spans: Sequence[Span]) -> dict[str, ToolUsage]:
    """Tool name → its calls, slowest call first."""
    groups: dict[str, list[Span]] = defaultdict(list)
    for span in spans:
        if span.name.startswith(TOOL_SPAN_PREFIX):
            groups[span.name.removeprefix(TOOL_SPAN_PREFIX)].append(span)
    usage = {
        name: ToolUsage(
            len(calls), sum(c.duration_ns for c in calls), max(c.duration_ns for c in calls)
        )
        for name, calls in groups.items()
    }
    return dict(sorted(usage.items(), key=lambda item: -item[1].slowest_ns))


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
    tools: dict[str, ToolUsage]
    """Tool name → its calls (multi-turn rollouts), slowest call first."""
    tool_wait_ns: int
    """Time some tool call was pending (the union of the calls)."""

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
        tools=tool_usage(step.spans),
        tool_wait_ns=union_ns(
            (s.start_ns, s.end_ns) for s in step.spans if s.name.startswith(TOOL_SPAN_PREFIX)
        ),
    )
