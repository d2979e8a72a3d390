"""trace_report on hand-built PPO steps, in OTLP/JSON and in Jaeger JSON.

The step below (times in ms) has every case the report must handle: sequential and
concurrent calls, a server with work spans, one without (uninstrumented), a client
whose service did not trace (unmatched). Its critical path, per-stage times and RPC
overhead were worked out by hand and are written out in the tests.
"""

import base64
import itertools
import json
import random
import struct

import pytest

from rlserve.core import tracing
from rlserve.trainer import trace_report as tr

TRACE_ID = "0af7651916cd43dd8448eb211c80319c"
MS = 1_000_000
T0_NS = 1_700_000_000_000_000_000

# name, span id, parent id, service, start ms, end ms
STEP = [
    ("ppo.step", "a1", None, "trainer", 0, 100),
    ("rpc.client/RolloutService/GenerateSequences", "b1", "a1", "trainer", 5, 30),
    ("rpc.server/RolloutService/GenerateSequences", "b2", "b1", "rollout", 7, 29),
    ("rollout.generate", "b3", "b2", "rollout", 8, 27),
    ("rpc.client/RewardService/ComputeReward", "c1", "a1", "trainer", 31, 45),
    ("rpc.client/RolloutService/ComputeLogProb", "d1", "a1", "trainer", 32, 60),
    ("rpc.server/RolloutService/ComputeLogProb", "d2", "d1", "rollout", 35, 58),
    ("rollout.forward", "d3", "d2", "rollout", 37, 56),
    ("rpc.client/ReferenceService/ComputeRefLogProb", "e1", "a1", "trainer", 32, 50),
    ("rpc.server/ReferenceService/ComputeRefLogProb", "e2", "e1", "reference", 34, 49),
    ("reference.forward", "e3", "e2", "reference", 35, 48),
    ("rpc.client/CriticService/ComputeValues", "f1", "a1", "trainer", 33, 58),
    ("rpc.server/CriticService/ComputeValues", "f2", "f1", "critic", 36, 57),
    ("trainer.advantages", "71", "a1", "trainer", 61, 65),
    ("rpc.client/RolloutService/UpdateActor", "81", "a1", "trainer", 66, 95),
    ("rpc.server/RolloutService/UpdateActor", "82", "81", "rollout", 68, 94),
    ("actor.backward", "83", "82", "rollout", 69, 85),
    ("actor.optimizer_step", "84", "82", "rollout", 85, 88),
    ("actor.weight_sync", "85", "82", "rollout", 89, 93),
    ("rpc.client/CriticService/UpdateCritic", "91", "a1", "trainer", 66, 90),
    ("rpc.server/CriticService/UpdateCritic", "92", "91", "critic", 67, 89),
    ("critic.update", "93", "92", "critic", 68, 88),
]

# Worked out by hand from STEP (module docstring of trace_report has the definition).
EXPECTED_PATH = [  # chronological (span, start ms, end ms)
    ("ppo.step", 0, 5),
    ("rpc.client/RolloutService/GenerateSequences", 5, 7),
    ("rpc.server/RolloutService/GenerateSequences", 7, 8),
    ("rollout.generate", 8, 27),
    ("rpc.server/RolloutService/GenerateSequences", 27, 29),
    ("rpc.client/RolloutService/GenerateSequences", 29, 30),
    ("ppo.step", 30, 32),
    ("rpc.client/RolloutService/ComputeLogProb", 32, 35),
    ("rpc.server/RolloutService/ComputeLogProb", 35, 37),
    ("rollout.forward", 37, 56),
    ("rpc.server/RolloutService/ComputeLogProb", 56, 58),
    ("rpc.client/RolloutService/ComputeLogProb", 58, 60),
    ("ppo.step", 60, 61),
    ("trainer.advantages", 61, 65),
    ("ppo.step", 65, 66),
    ("rpc.client/RolloutService/UpdateActor", 66, 68),
    ("rpc.server/RolloutService/UpdateActor", 68, 69),
    ("actor.backward", 69, 85),
    ("actor.optimizer_step", 85, 88),
    ("rpc.server/RolloutService/UpdateActor", 88, 89),
    ("actor.weight_sync", 89, 93),
    ("rpc.server/RolloutService/UpdateActor", 93, 94),
    ("rpc.client/RolloutService/UpdateActor", 94, 95),
    ("ppo.step", 95, 100),
]
# call: (client ms, transport ms, in-service ms, overhead ms, matched, instrumented)
EXPECTED_RPCS = {
    "RolloutService/GenerateSequences": (25, 3, 3, 6, True, True),
    "RewardService/ComputeReward": (14, 14, 0, 14, False, True),
    "RolloutService/ComputeLogProb": (28, 5, 4, 9, True, True),
    "ReferenceService/ComputeRefLogProb": (18, 3, 2, 5, True, True),
    "CriticService/ComputeValues": (25, 4, 0, 4, True, False),
    "RolloutService/UpdateActor": (29, 3, 3, 6, True, True),
    "CriticService/UpdateCritic": (24, 2, 2, 4, True, True),
}
# service: (wall ms, self ms, spans)
EXPECTED_SERVICES = {
    "trainer": (100, 51, 9),
    "rollout": (71, 71, 8),
    "reference": (15, 15, 2),
    "critic": (43, 43, 3),
}


def _span_id(short: str) -> str:
    # Leading zeros on purpose: Jaeger drops them when it formats ids.
    return short.rjust(16, "0")


def _otlp_value(value):
    if isinstance(value, bool):
        return {"boolValue": value}
    if isinstance(value, int):
        return {"intValue": str(value)}
    return {"stringValue": str(value)}


def otlp_request(rows, trace_id=TRACE_ID, step=3, base64_ids=False) -> dict:
    """An ExportTraceServiceRequest in OTLP/JSON, one resource per service."""

    def encode(hex_id):
        return base64.b64encode(bytes.fromhex(hex_id)).decode() if base64_ids else hex_id

    by_service: dict[str, list] = {}
    for name, span_id, parent, service, start_ms, end_ms in rows:
        span = {
            "traceId": encode(trace_id),
            "spanId": encode(_span_id(span_id)),
            "name": name,
            "kind": 3 if name.startswith("rpc.client/") else 2 if "server" in name else 1,
            "startTimeUnixNano": str(T0_NS + start_ms * MS),
            "endTimeUnixNano": str(T0_NS + end_ms * MS),
            "attributes": [{"key": "rlserve.role", "value": _otlp_value(service)}],
        }
        if parent is not None:
            span["parentSpanId"] = encode(_span_id(parent))
        if name == "ppo.step":
            span["attributes"].append({"key": "rlserve.step", "value": _otlp_value(step)})
        by_service.setdefault(service, []).append(span)
    return {
        "resourceSpans": [
            {
                "resource": {
                    "attributes": [{"key": "service.name", "value": {"stringValue": service}}]
                },
                "scopeSpans": [{"scope": {"name": "rlserve"}, "spans": spans}],
            }
            for service, spans in by_service.items()
        ]
    }


def jaeger_trace(rows, trace_id=TRACE_ID, step=3) -> dict:
    """One trace as Jaeger's JSON API / UI download writes it (µs, %x ids)."""
    services = list(dict.fromkeys(row[3] for row in rows))
    process_of = {service: f"p{index + 1}" for index, service in enumerate(services)}

    def jaeger_id(hex_id):
        return hex_id.lstrip("0")

    spans = []
    for name, span_id, parent, service, start_ms, end_ms in rows:
        tags = [{"key": "rlserve.role", "type": "string", "value": service}]
        if name == "ppo.step":
            tags.append({"key": "rlserve.step", "type": "int64", "value": step})
        kind = "client" if name.startswith("rpc.client/") else "server"
        if name.startswith(("rpc.client/", "rpc.server/")):
            tags.append({"key": "span.kind", "type": "string", "value": kind})
        spans.append(
            {
                "traceID": jaeger_id(trace_id),
                "spanID": jaeger_id(_span_id(span_id)),
                "operationName": name,
                "references": (
                    []
                    if parent is None
                    else [
                        {
                            "refType": "CHILD_OF",
                            "traceID": jaeger_id(trace_id),
                            "spanID": jaeger_id(_span_id(parent)),
                        }
                    ]
                ),
                "startTime": (T0_NS + start_ms * MS) // 1000,
                "duration": (end_ms - start_ms) * 1000,
                "tags": tags,
                "logs": [],
                "processID": process_of[service],
                "warnings": None,
            }
        )
    return {
        "traceID": jaeger_id(trace_id),
        "spans": spans,
        "processes": {
            process_of[s]: {"serviceName": s, "tags": [{"key": "hostname", "value": "n1"}]}
            for s in services
        },
        "warnings": None,
    }


@pytest.fixture(params=["otlp", "otlp-base64", "jaeger"])
def step_file(request, tmp_path):
    """STEP written in each input format."""
    path = tmp_path / f"{request.param}.json"
    if request.param == "jaeger":
        path.write_text(json.dumps({"data": [jaeger_trace(STEP)], "total": 0, "limit": 0}))
    else:
        request_json = otlp_request(STEP, base64_ids=request.param == "otlp-base64")
        path.write_text(json.dumps(request_json) + "\n")
    return path


def _ms(ns: int) -> float:
    return ns / MS


# --- reading --------------------------------------------------------------------------


def test_both_formats_normalise_to_the_same_spans(step_file):
    spans = {s.span_id: s for s in tr.read_spans(step_file)}
    assert len(spans) == len(STEP)
    for name, span_id, parent, service, start_ms, end_ms in STEP:
        span = spans[_span_id(span_id)]
        assert span.trace_id == TRACE_ID
        assert span.name == name
        assert span.parent_id == (None if parent is None else _span_id(parent))
        assert span.service == service
        assert span.start_ns == T0_NS + start_ms * MS
        assert span.end_ns == T0_NS + end_ms * MS
        assert span.attributes["rlserve.role"] == service
    root = spans[_span_id("a1")]
    assert root.attributes["rlserve.step"] == 3
    assert spans[_span_id("b1")].is_rpc_client and spans[_span_id("b2")].is_rpc_server


def test_otlp_json_lines_and_jaeger_variants_are_read(tmp_path):
    lines = tmp_path / "spans.jsonl"
    first, second = STEP[:10], STEP[10:]
    lines.write_text(
        json.dumps(otlp_request(first)) + "\n\n" + json.dumps(otlp_request(second)) + "\n"
    )
    assert len(tr.read_spans(lines)) == len(STEP)
    wrapped = tmp_path / "v3.json"  # Jaeger's /api/v3 answer wraps OTLP/JSON
    wrapped.write_text(json.dumps({"result": otlp_request(STEP)}))
    assert len(tr.read_spans(wrapped)) == len(STEP)
    bare = tmp_path / "trace.json"  # one trace object, as some downloads hold
    bare.write_text(json.dumps(jaeger_trace(STEP)))
    assert len(tr.read_spans(bare)) == len(STEP)


def test_unreadable_input_is_reported_with_the_file(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text('{"resourceSpans": []}\nnot json\n')
    with pytest.raises(tr.TraceFormatError, match=r"bad\.json:2"):
        tr.read_spans(bad)
    other = tmp_path / "other.json"
    other.write_text('{"hello": 1}')
    with pytest.raises(tr.TraceFormatError, match="neither OTLP/JSON nor Jaeger"):
        tr.read_spans(other)


# --- analysis -------------------------------------------------------------------------


def test_critical_path_matches_the_hand_computed_one(step_file):
    (step,) = tr.find_steps(tr.read_spans(step_file))
    report = tr.analyse_step(step)
    assert step.step == 3 and step.trace_id == TRACE_ID and not step.orphans
    path = [
        (s.span.name, _ms(s.start_ns - T0_NS), _ms(s.end_ns - T0_NS))
        for s in tr.merged_path(report.path)
    ]
    assert path == EXPECTED_PATH
    assert sum(s.duration_ns for s in report.path) == report.duration_ns == 100 * MS
    by_stage = {name: _ms(ns) for (_, name), ns in report.path_by_stage.items()}
    assert by_stage == {
        "ppo.step": 14,
        "rollout.generate": 19,
        "rollout.forward": 19,
        "actor.backward": 16,
        "rpc.client/RolloutService/ComputeLogProb": 5,
        "trainer.advantages": 4,
        "rpc.server/RolloutService/ComputeLogProb": 4,
        "actor.weight_sync": 4,
        "rpc.client/RolloutService/GenerateSequences": 3,
        "rpc.server/RolloutService/GenerateSequences": 3,
        "rpc.client/RolloutService/UpdateActor": 3,
        "rpc.server/RolloutService/UpdateActor": 3,
        "actor.optimizer_step": 3,
    }
    assert _ms(report.path_rpc_overhead_ns) == 21


def test_rpc_overhead_matches_the_hand_computed_one(step_file):
    (step,) = tr.find_steps(tr.read_spans(step_file))
    report = tr.analyse_step(step)
    found = {
        r.client.name.removeprefix("rpc.client/"): (
            _ms(r.client.duration_ns),
            _ms(r.transport_ns),
            _ms(r.in_service_ns),
            _ms(r.overhead_ns),
            r.matched,
            r.instrumented,
        )
        for r in report.rpcs
    }
    assert found == EXPECTED_RPCS
    assert _ms(report.rpc_overhead_ns) == 48


def test_time_per_service_and_stage(step_file):
    (step,) = tr.find_steps(tr.read_spans(step_file))
    report = tr.analyse_step(step)
    services = {
        name: (_ms(u.wall_ns), _ms(u.self_ns), u.count) for name, u in report.services.items()
    }
    assert services == EXPECTED_SERVICES
    assert list(services) == ["trainer", "rollout", "reference", "critic"]  # first start
    stages = report.stages
    assert _ms(stages[("trainer", "ppo.step")].self_ns) == 13  # [30,31] is the reward call's
    assert _ms(stages[("critic", "rpc.server/CriticService/ComputeValues")].self_ns) == 21
    assert _ms(stages[("rollout", "actor.backward")].wall_ns) == 16
    assert next(iter(stages)) == ("critic", "rpc.server/CriticService/ComputeValues")


def test_concurrent_siblings_off_the_path_and_ties():
    # Two calls end together: the longer one (it started earlier) is on the path.
    rows = [
        ("ppo.step", "1", None, "trainer", 0, 10),
        ("short", "2", "1", "trainer", 6, 8),
        ("long", "3", "1", "trainer", 2, 8),
        ("overlapping", "4", "1", "trainer", 1, 5),
    ]
    (step,) = tr.find_steps(tr.spans_from_otlp_json(otlp_request(rows)))
    path = [
        (s.span.name, _ms(s.start_ns - T0_NS), _ms(s.end_ns - T0_NS))
        for s in tr.analyse_step(step).path
    ]
    # "overlapping" ends after "long" starts: it ran concurrently, so it is off the path.
    assert path == [("ppo.step", 0, 2), ("long", 2, 8), ("ppo.step", 8, 10)]


def test_skewed_children_are_clipped_and_orphans_counted():
    rows = [
        ("ppo.step", "1", None, "trainer", 10, 20),
        ("rpc.client/S/M", "2", "1", "trainer", 12, 19),
        # Another host's clock is 3 ms ahead: its server span sticks out of the client.
        ("rpc.server/S/M", "3", "2", "svc", 15, 22),
        ("lost-parent", "4", "99", "svc", 11, 12),
    ]
    (step,) = tr.find_steps(tr.spans_from_otlp_json(otlp_request(rows)))
    assert [s.name for s in step.orphans] == ["lost-parent"]
    report = tr.analyse_step(step)
    path = [(s.span.name, _ms(s.start_ns - T0_NS), _ms(s.end_ns - T0_NS)) for s in report.path]
    assert path == [
        ("ppo.step", 10, 12),
        ("rpc.client/S/M", 12, 15),
        ("rpc.server/S/M", 15, 19),
        ("ppo.step", 19, 20),
    ]
    (rpc,) = report.rpcs
    # No work spans under the server: its (clipped) time counts as work.
    assert (_ms(rpc.transport_ns), _ms(rpc.in_service_ns), _ms(rpc.work_ns)) == (3, 0, 4)
    assert not rpc.instrumented


def test_only_ppo_step_traces_are_steps_in_step_order():
    later = otlp_request(STEP, trace_id="1" * 32, step=7)
    earlier = otlp_request(STEP, trace_id="2" * 32, step=2)
    evaluation = otlp_request([("evaluate", "1", None, "trainer", 0, 5)], trace_id="3" * 32)
    spans = [
        *tr.spans_from_otlp_json(later),
        *tr.spans_from_otlp_json(earlier),
        *tr.spans_from_otlp_json(evaluation),
        *tr.spans_from_otlp_json(earlier),  # the same spans read twice count once
    ]
    steps = tr.find_steps(spans)
    assert [(s.step, len(s.spans)) for s in steps] == [(2, len(STEP)), (7, len(STEP))]


def test_critical_path_tiles_the_root_on_random_trees():
    generator = random.Random(0)
    for _ in range(200):
        rows = [("ppo.step", "1", None, "trainer", 0, 1000)]
        for index in range(2, generator.randint(2, 30)):
            parent = generator.choice(rows)
            start = generator.randint(parent[4] - 5, parent[5])  # some skew
            end = generator.randint(start, parent[5] + 5)
            rows.append((f"s{index}", format(index, "x"), parent[1], "svc", start, end))
        (step,) = tr.find_steps(tr.spans_from_otlp_json(otlp_request(rows)))
        path = tr.analyse_step(step).path
        assert path[0].start_ns == T0_NS and path[-1].end_ns == T0_NS + 1000 * MS
        for before, after in itertools.pairwise(path):
            assert before.end_ns == after.start_ns
            assert after.duration_ns > 0
        # Every path segment is inside its span.
        assert all(s.span.start_ns <= s.start_ns < s.end_ns <= s.span.end_ns for s in path)


def test_union_ns_merges_overlaps():
    assert tr.union_ns([]) == 0
    assert tr.union_ns([(0, 5), (3, 8), (10, 12), (12, 13), (20, 20)]) == 11


# --- output ---------------------------------------------------------------------------


def test_main_prints_every_step_and_writes_the_timeline(step_file, tmp_path, capsys):
    other = tmp_path / "step4.jsonl"
    other.write_text(json.dumps(otlp_request(STEP, trace_id="5" * 32, step=4)) + "\n")
    png = tmp_path / "timeline.png"
    assert tr.main([str(step_file), str(other), "--timeline", str(png)]) == 0
    out = capsys.readouterr().out
    assert f"step 3  trace {TRACE_ID}  100.0 ms  22 spans" in out
    assert "step 4  trace " + "5" * 32 in out
    assert "2 steps, mean 100.0 ms; share of the critical path: rollout 71.0%, trainer 29.0%" in out
    assert "RewardService/ComputeReward" in out and "unmatched" in out
    assert "uninstrumented" in out
    assert "total 48.0 ms summed over calls; 21.0 ms (21.0%) on the critical path" in out
    assert "timeline of step 3" in out
    header = png.read_bytes()[:24]
    assert header[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = struct.unpack(">II", header[16:24])
    assert width > 1000 and height > 400  # four service rows at 120 dpi


def test_main_selects_one_step(step_file, capsys):
    assert tr.main([str(step_file), "--step", "3"]) == 0
    assert "step 3" in capsys.readouterr().out
    assert tr.main([str(step_file), "--step", "9"]) == 1
    assert "no 'ppo.step' trace for step 9" in capsys.readouterr().err


def test_main_names_a_bad_file(tmp_path, capsys):
    missing = tmp_path / "missing.json"
    assert tr.main([str(missing)]) == 2
    assert "missing.json" in capsys.readouterr().err


# --- the file our tracing set-up writes -----------------------------------------------


def test_report_reads_the_file_exporters_output(tmp_path, capsys):
    path = tmp_path / "trainer.jsonl"
    tracing.setup_tracing("trainer", None, 1.0, True, file_path=path)
    try:
        for step in range(2):
            with tracing.span("ppo.step", step=step):
                with tracing.rpc_client_span("CriticService", "ComputeValues", role="critic"):
                    metadata = tracing.inject_metadata([])
                # What the service process would record, continuing the trace.
                with (
                    tracing.rpc_server_span("CriticService", "ComputeValues", metadata),
                    tracing.span("critic.forward", batch_size=4),
                ):
                    pass
                with tracing.span("trainer.advantages"):
                    pass
    finally:
        tracing.shutdown_tracing()
    steps = tr.find_steps(tr.read_spans(path))
    assert [s.step for s in steps] == [0, 1]
    for step in steps:
        report = tr.analyse_step(step)
        assert not step.orphans
        assert len(step.spans) == 5
        assert sum(s.duration_ns for s in report.path) == report.duration_ns
        assert {s.span.name for s in report.path} >= {"ppo.step", "trainer.advantages"}
        assert {s.service for s in step.spans} == {"trainer"}
    assert tr.main([str(path)]) == 0
    assert "step 1" in capsys.readouterr().out


def test_timeline_lanes_separate_concurrent_and_nested_spans():
    spans = tr.spans_from_otlp_json(otlp_request(STEP))
    lane_of_id = tr.timeline_lanes(spans)
    lanes = {s.name: lane_of_id[s.span_id] for s in spans}
    assert lanes["ppo.step"] == 0
    # The four forward calls overlap (32-45 ms): four lanes of their own under the root.
    forwards = [
        "rpc.client/RewardService/ComputeReward",
        "rpc.client/RolloutService/ComputeLogProb",
        "rpc.client/ReferenceService/ComputeRefLogProb",
        "rpc.client/CriticService/ComputeValues",
    ]
    assert len({lanes[name] for name in forwards}) == 4
    assert min(lanes[name] for name in forwards) == 1
    # Nested below their parent; sequential siblings share a lane.
    assert lanes["rollout.generate"] == lanes["rpc.server/RolloutService/GenerateSequences"] + 1
    assert lanes["actor.backward"] == lanes["actor.optimizer_step"] == lanes["actor.weight_sync"]


def test_bottleneck_names_the_service_holding_most_of_the_critical_path(step_file):
    (step,) = tr.find_steps(tr.read_spans(step_file))
    report = tr.analyse_step(step)
    # from the hand-computed path: rollout spans 71 ms of the 100, the trainer's 29 ms
    assert {name: _ms(ns) for name, ns in report.path_by_service.items()} == {
        "rollout": 71,
        "trainer": 29,
    }
    line = tr.bottleneck(report)
    assert line == (
        "bottleneck: rollout, 71.0% of the critical path (largest stage rollout.generate, "
        "19.0%); by service: rollout 71.0%, trainer 29.0%"
    )
    assert "  " + line in tr.format_step(report)


def test_tools_name_the_slowest_and_the_share_of_the_step_spent_waiting():
    rows = [
        ("ppo.step", "1", None, "trainer", 0, 100),
        ("agent.generate", "2", "1", "rollout", 0, 10),
        ("agent.tool/python", "3", "1", "rollout", 10, 50),
        ("agent.tool/calc", "4", "1", "rollout", 12, 14),
        ("agent.tool/calc", "5", "1", "rollout", 60, 63),
        ("agent.generate", "6", "1", "rollout", 63, 70),
    ]
    (step,) = tr.find_steps(tr.spans_from_otlp_json(otlp_request(rows)))
    report = tr.analyse_step(step)
    assert list(report.tools) == ["python", "calc"]  # slowest call first
    calc = report.tools["calc"]
    assert (calc.calls, _ms(calc.total_ns), _ms(calc.slowest_ns)) == (2, 5, 3)
    assert _ms(report.tool_wait_ns) == 43  # 10..50 and 60..63
    text = tr.format_step(report)
    assert "tools: slowest python; some call pending 43.0 ms (43.0% of the step)" in text
