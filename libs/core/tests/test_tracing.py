"""rlserve.core.tracing: set-up, ids, sampling, propagation, file and OTLP export.

The OTLP path is checked against a real gRPC TraceService receiver started in the test
(the collector protocol Jaeger speaks); the whole-stack check against a real backend is
integration_tests/test_tracing_backend.py.
"""

import asyncio
import base64
import json
import random
import socket
import threading
import time
import timeit
from concurrent import futures

import grpc
import pytest
import torch
from google.protobuf.json_format import ParseDict
from opentelemetry import trace
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.sdk.trace.id_generator import RandomIdGenerator
from opentelemetry.trace import SpanKind, StatusCode

from rlserve.core import tracing


@pytest.fixture(autouse=True)
def _tracing_off_afterwards():
    yield
    tracing.shutdown_tracing()


def _recording(tmp_path, service: str = "trainer", ratio: float = 1.0, **kwargs):
    """Tracing on with an in-memory exporter next to the file exporter setup_tracing adds."""
    file_path = tmp_path / f"{service}.jsonl"
    provider = tracing.setup_tracing(service, None, ratio, True, file_path=file_path, **kwargs)
    memory = InMemorySpanExporter()
    provider.add_span_processor(SimpleSpanProcessor(memory))
    return memory, file_path


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _read_lines(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


# --- ids ------------------------------------------------------------------------------


def test_seeding_random_makes_the_sdk_default_ids_repeat():
    # The hazard the custom generator exists for: seeded processes repeat SDK ids.
    generator = RandomIdGenerator()
    random.seed(0)
    first = [generator.generate_span_id() for _ in range(4)]
    random.seed(0)
    assert [generator.generate_span_id() for _ in range(4)] == first


def test_urandom_ids_do_not_repeat_after_the_same_seed():
    generator = tracing.UrandomIdGenerator()
    random.seed(0)
    torch.manual_seed(0)
    spans_first = {generator.generate_span_id() for _ in range(100)}
    traces_first = {generator.generate_trace_id() for _ in range(100)}
    random.seed(0)
    torch.manual_seed(0)
    spans_second = {generator.generate_span_id() for _ in range(100)}
    traces_second = {generator.generate_trace_id() for _ in range(100)}
    assert len(spans_first) == len(spans_second) == 100
    assert not spans_first & spans_second
    assert not traces_first & traces_second
    assert all(0 < span_id < 2**64 for span_id in spans_first)
    assert all(0 < trace_id < 2**128 for trace_id in traces_first)


def test_spans_of_identically_seeded_runs_get_distinct_ids(tmp_path):
    memory, _ = _recording(tmp_path)
    for _ in range(2):
        random.seed(0)
        torch.manual_seed(0)
        with tracing.span("ppo.step", step=0), tracing.span("trainer.advantages"):
            pass
    spans = memory.get_finished_spans()
    assert len(spans) == 4
    assert len({s.context.span_id for s in spans}) == 4
    assert len({s.context.trace_id for s in spans}) == 2


# --- off ------------------------------------------------------------------------------


def test_disabled_installs_nothing_and_records_nothing(tmp_path):
    global_provider = trace.get_tracer_provider()
    path = tmp_path / "spans.jsonl"
    assert tracing.setup_tracing("trainer", "http://127.0.0.1:1", 1.0, False, path) is None
    assert not tracing.tracing_enabled()
    with tracing.span("ppo.step", step=1) as current:
        assert not current.is_recording()
        current.set_attribute("rlserve.tokens", 3)  # accepted and dropped
        assert tracing.inject_metadata([("application", "rollout")]) == [("application", "rollout")]
    assert isinstance(tracing.get_tracer(), trace.NoOpTracer)
    assert trace.get_tracer_provider() is global_provider
    assert not path.exists()


def test_disabled_span_costs_about_a_function_call():
    tracing.setup_tracing("trainer", None, 1.0, False)

    def instrumented():
        with tracing.span("rollout.generate", step=1, tokens=10):
            pass

    # Best of several repeats: the machine is shared, the minimum is the code's cost.
    disabled_s = min(timeit.repeat(instrumented, number=20_000, repeat=5)) / 20_000
    print(f"disabled span: {disabled_s * 1e9:.0f} ns")
    assert disabled_s < 2e-6


# --- spans, attributes, resource ------------------------------------------------------


def test_span_attributes_resource_and_parenting(tmp_path):
    memory, _ = _recording(
        tmp_path,
        "rollout",
        resource_attributes={"rlserve.replica": "rollout#abc", "rlserve.node_id": "n1"},
    )
    with (
        tracing.span("ppo.step", {"custom.key": "v"}, step=7, role=None) as root,
        tracing.span("rollout.generate", tokens=120, batch_size=8) as child,
    ):
        child.set_attribute("rlserve.weights_version", 3)
    spans = {s.name: s for s in memory.get_finished_spans()}
    step, generate = spans["ppo.step"], spans["rollout.generate"]
    # Every span also names its service (backends like Phoenix drop the resource).
    assert dict(step.attributes) == {
        "custom.key": "v",
        "rlserve.step": 7,
        "rlserve.service": "rollout",
    }
    assert dict(generate.attributes) == {
        "rlserve.service": "rollout",
        "rlserve.tokens": 120,
        "rlserve.batch_size": 8,
        "rlserve.weights_version": 3,
    }
    assert generate.parent.span_id == root.get_span_context().span_id
    assert step.parent is None
    resource = dict(step.resource.attributes)
    assert resource["service.name"] == "rollout"
    assert resource["rlserve.replica"] == "rollout#abc"
    assert resource["rlserve.node_id"] == "n1"
    assert {"host.name", "process.pid"} <= resource.keys()


def test_exception_marks_the_span_as_error(tmp_path):
    memory, _ = _recording(tmp_path)
    with pytest.raises(ValueError), tracing.span("reward.http_call"):
        raise ValueError("boom")
    (failed,) = memory.get_finished_spans()
    assert failed.status.status_code is StatusCode.ERROR
    assert failed.events[0].name == "exception"


def test_concurrent_calls_in_gather_are_siblings_under_the_step(tmp_path):
    memory, _ = _recording(tmp_path)

    async def call(method: str) -> list[tuple[str, str]]:
        with tracing.rpc_client_span("CriticService", method, role="critic"):
            await asyncio.sleep(0.01)
            return tracing.inject_metadata([("application", "critic")])

    async def step():
        with tracing.span("ppo.step", step=0):
            return await asyncio.gather(call("ComputeValues"), call("UpdateCritic"))

    metadata = asyncio.run(step())
    spans = {s.name: s for s in memory.get_finished_spans()}
    root_id = spans["ppo.step"].context.span_id
    for method, sent in zip(["ComputeValues", "UpdateCritic"], metadata, strict=True):
        client = spans[f"rpc.client/CriticService/{method}"]
        assert client.parent.span_id == root_id
        assert client.kind is SpanKind.CLIENT
        assert client.attributes["rpc.method"] == method
        assert client.attributes["rlserve.role"] == "critic"
        # Each call's metadata names its own client span as the parent.
        assert f"{client.context.span_id:016x}" in dict(sent)["traceparent"]


# --- propagation ----------------------------------------------------------------------


def test_server_span_continues_the_callers_trace(tmp_path):
    memory, _ = _recording(tmp_path)
    with tracing.rpc_client_span("RolloutService", "GenerateSequences") as client:
        metadata = tracing.inject_metadata([("application", "rollout")])
    assert metadata[0] == ("application", "rollout")
    assert {key for key, _ in metadata[1:]} == {"traceparent"}
    # What a Serve replica sees: other keys, upper-case variants, binary values.
    incoming = [
        ("application", "rollout"),
        ("blob-bin", b"\x00\x01"),
        *((key.upper(), value) for key, value in metadata[1:]),
    ]
    with (
        tracing.rpc_server_span("RolloutService", "GenerateSequences", incoming, replica="r1"),
        tracing.span("rollout.generate"),
    ):
        pass
    spans = {s.name: s for s in memory.get_finished_spans()}
    server = spans["rpc.server/RolloutService/GenerateSequences"]
    client_context = client.get_span_context()
    assert server.context.trace_id == client_context.trace_id
    assert server.parent.span_id == client_context.span_id
    assert server.parent.is_remote
    assert server.kind is SpanKind.SERVER
    assert server.attributes["rlserve.replica"] == "r1"
    assert spans["rollout.generate"].parent.span_id == server.context.span_id


def test_extract_without_trace_metadata_starts_a_new_trace(tmp_path):
    memory, _ = _recording(tmp_path)
    context = tracing.extract_context([("application", "reward")])
    with tracing.span("rpc.server/RewardService/ComputeReward", context=context):
        pass
    (server,) = memory.get_finished_spans()
    assert server.parent is None


def test_sampling_ratio_applies_to_roots_and_callers_decision_to_the_rest(tmp_path):
    memory, _ = _recording(tmp_path, "critic", ratio=0.0)
    with tracing.span("ppo.step") as root:
        assert not root.is_recording()
        # An unsampled root still propagates, flagged not-sampled (…-00 / …-02).
        traceparent = dict(tracing.inject_metadata([]))["traceparent"]
        assert traceparent.endswith(("-00", "-02"))
    sampled_caller = [("traceparent", f"00-{'ab' * 16}-{'cd' * 8}-01")]
    with tracing.rpc_server_span("CriticService", "ComputeValues", sampled_caller):
        pass
    unsampled_caller = [("traceparent", f"00-{'ab' * 16}-{'ef' * 8}-00")]
    with tracing.rpc_server_span("CriticService", "ComputeValues", unsampled_caller):
        pass
    (recorded,) = memory.get_finished_spans()
    assert recorded.parent.span_id == int("cd" * 8, 16)
    assert recorded.context.trace_id == int("ab" * 16, 16)


def test_invalid_arguments_name_the_field():
    with pytest.raises(ValueError, match="sampling_ratio"):
        tracing.setup_tracing("trainer", "http://127.0.0.1:4317", 1.5, True)
    with pytest.raises(ValueError, match="endpoint / file_path"):
        tracing.setup_tracing("trainer", None, 1.0, True)


def test_setting_up_again_replaces_and_flushes_the_previous_setup(tmp_path):
    first_path, second_path = tmp_path / "first.jsonl", tmp_path / "second.jsonl"
    tracing.setup_tracing("rollout", None, 1.0, True, first_path)
    with tracing.span("rollout.generate"):
        pass
    # The batch processor has not exported yet; replacing the set-up must flush it.
    tracing.setup_tracing("critic", None, 1.0, True, second_path)
    with tracing.span("critic.forward"):
        pass
    tracing.shutdown_tracing()
    (first,) = _read_lines(first_path)
    (second,) = _read_lines(second_path)
    assert _names_and_services(first) == [("rollout.generate", "rollout")]
    assert _names_and_services(second) == [("critic.forward", "critic")]


# --- export formats -------------------------------------------------------------------


def _names_and_services(request: dict) -> list[tuple[str, str]]:
    found = []
    for resource_spans in request["resourceSpans"]:
        attributes = {a["key"]: a["value"] for a in resource_spans["resource"]["attributes"]}
        service = attributes["service.name"]["stringValue"]
        for scope_spans in resource_spans["scopeSpans"]:
            found += [(s["name"], service) for s in scope_spans["spans"]]
    return found


def test_file_exporter_writes_otlp_json_lines(tmp_path):
    memory, path = _recording(tmp_path, "reward")
    with tracing.span("ppo.step", step=2), tracing.span("reward.http_call", retries=1):
        pass
    assert tracing.flush_tracing()
    (request,) = _read_lines(path)
    assert sorted(_names_and_services(request)) == [
        ("ppo.step", "reward"),
        ("reward.http_call", "reward"),
    ]
    spans = {s["name"]: s for s in request["resourceSpans"][0]["scopeSpans"][0]["spans"]}
    sdk = {s.name: s for s in memory.get_finished_spans()}
    call = spans["reward.http_call"]
    # OTLP/JSON: hex ids, integer enums, camelCase, int64 as decimal strings.
    assert call["traceId"] == f"{sdk['reward.http_call'].context.trace_id:032x}"
    assert call["spanId"] == f"{sdk['reward.http_call'].context.span_id:016x}"
    assert call["parentSpanId"] == spans["ppo.step"]["spanId"]
    assert call["kind"] == 1
    assert int(call["endTimeUnixNano"]) == sdk["reward.http_call"].end_time
    assert call["attributes"] == [
        {"key": "rlserve.retries", "value": {"intValue": "1"}},
        {"key": "rlserve.service", "value": {"stringValue": "reward"}},
    ]
    # Apart from the hex ids it is protobuf's JSON mapping of ExportTraceServiceRequest.
    for span_dict in spans.values():
        for key in ("traceId", "spanId", "parentSpanId"):
            if key in span_dict:
                span_dict[key] = base64.b64encode(bytes.fromhex(span_dict[key])).decode()
    parsed = ParseDict(request, trace_service_pb2.ExportTraceServiceRequest())
    assert len(parsed.resource_spans[0].scope_spans[0].spans) == 2


def test_file_exporter_keeps_lines_whole_with_concurrent_writers(tmp_path):
    # Two providers (as two processes would) appending to one file from threads.
    path = tmp_path / "shared.jsonl"
    exporters = [tracing.OtlpJsonLinesExporter(path) for _ in range(2)]
    providers = [TracerProvider() for _ in exporters]
    for provider, exporter in zip(providers, exporters, strict=True):
        provider.add_span_processor(SimpleSpanProcessor(exporter))

    def emit(provider: TracerProvider) -> None:
        tracer = provider.get_tracer("t")
        for index in range(200):
            with tracer.start_as_current_span("x" * 2000, attributes={"i": index}):
                pass

    threads = [threading.Thread(target=emit, args=(p,)) for p in providers]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for exporter in exporters:
        exporter.shutdown()
    lines = _read_lines(path)
    assert len(lines) == 400


class _Receiver(trace_service_pb2_grpc.TraceServiceServicer):
    """A real OTLP/gRPC trace receiver, as a collector runs it."""

    def __init__(self):
        self.requests: list[trace_service_pb2.ExportTraceServiceRequest] = []

    def Export(self, request, context):
        self.requests.append(request)
        return trace_service_pb2.ExportTraceServiceResponse()


def test_otlp_grpc_export_reaches_a_receiver():
    receiver = _Receiver()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(receiver, server)
    port = free_port()
    server.add_insecure_port(f"127.0.0.1:{port}")
    server.start()
    try:
        tracing.setup_tracing("trainer", f"http://127.0.0.1:{port}", 1.0, True)
        with tracing.span("ppo.step", step=5), tracing.span("trainer.advantages"):
            pass
        tracing.shutdown_tracing()
    finally:
        server.stop(grace=None)
    spans = [
        (span.name, resource_spans.resource)
        for request in receiver.requests
        for resource_spans in request.resource_spans
        for scope_spans in resource_spans.scope_spans
        for span in scope_spans.spans
    ]
    assert sorted(name for name, _ in spans) == ["ppo.step", "trainer.advantages"]
    resource = {a.key: a.value.string_value for a in spans[0][1].attributes}
    assert resource["service.name"] == "trainer"


def test_shutdown_is_bounded_when_the_collector_is_down():
    port = free_port()  # nothing listens there
    tracing.setup_tracing("trainer", f"http://127.0.0.1:{port}", 1.0, True)
    for step in range(3):
        with tracing.span("ppo.step", step=step):
            pass
    started = time.monotonic()
    assert tracing.shutdown_tracing(timeout_s=1.0) is False
    assert time.monotonic() - started < 3.0
    assert not tracing.tracing_enabled()
