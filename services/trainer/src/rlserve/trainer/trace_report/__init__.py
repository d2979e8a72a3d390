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

Modules: `spans` (both formats read into `Span`), `analysis` (the steps' traces, the
critical path, time per service and stage, RPC overhead), `render` (the text report
and the timeline); their public names are importable from here, and `main` is the
command (also `python -m rlserve.trainer.trace_report`).
"""

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from rlserve.trainer.trace_report.analysis import (
    RpcOverhead,
    Segment,
    StepReport,
    StepTrace,
    Usage,
    analyse_step,
    children_by_parent,
    critical_path,
    find_steps,
    rpc_overheads,
    self_ns,
    union_ns,
    usage_by,
)
from rlserve.trainer.trace_report.render import (
    bottleneck,
    format_step,
    format_summary,
    merged_path,
    plot_timeline,
    timeline_lanes,
)
from rlserve.trainer.trace_report.spans import (
    STEP_ATTRIBUTE,
    STEP_SPAN_NAME,
    Span,
    TraceFormatError,
    read_spans,
    spans_from_jaeger_json,
    spans_from_otlp_json,
)

__all__ = [
    "STEP_ATTRIBUTE",
    "STEP_SPAN_NAME",
    "RpcOverhead",
    "Segment",
    "Span",
    "StepReport",
    "StepTrace",
    "TraceFormatError",
    "Usage",
    "analyse_step",
    "bottleneck",
    "children_by_parent",
    "critical_path",
    "find_steps",
    "format_step",
    "format_summary",
    "main",
    "merged_path",
    "plot_timeline",
    "read_spans",
    "rpc_overheads",
    "self_ns",
    "spans_from_jaeger_json",
    "spans_from_otlp_json",
    "timeline_lanes",
    "union_ns",
    "usage_by",
]


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
