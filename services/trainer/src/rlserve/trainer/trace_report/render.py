"""A step's report as text (critical path, bottleneck, time per service and stage, RPC
overhead; a summary over steps) and as a PNG timeline."""

from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path

from rlserve.trainer.trace_report.analysis import Segment, StepReport
from rlserve.trainer.trace_report.spans import RPC_CLIENT_PREFIX, RPC_SERVER_PREFIX, Span

NS_PER_MS = 1_000_000


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
    if report.tools:
        slowest = next(iter(report.tools))
        lines.append(
            f"  tools: slowest {slowest}; some call pending {_ms(report.tool_wait_ns).strip()} ms "
            f"({_pct(report.tool_wait_ns, total).strip()} of the step)\n"
            "    calls  summed ms  slowest ms  tool"
        )
        for name, usage in report.tools.items():
            lines.append(
                f"    {usage.calls:5d} {_ms(usage.total_ns)}  {_ms(usage.slowest_ns)}  {name}"
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
