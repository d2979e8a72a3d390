"""Tracing wired into the RPC client, the server wrapper and the worker groups.

- ServiceClient + rpc_method over a real gRPC (aio) server in this process: one client
  span per attempt carrying the W3C context, a server span continuing it, error status
  on both sides, attributes read from the messages; with tracing off no trace metadata
  is sent at all.
- WorkerGroup on the session's Ray cluster: workers inherit the controller's set-up,
  continue the caller's trace under a `worker.<method>` span, and never start a trace
  of their own.
"""

import asyncio
import json
import time

import grpc
import pytest
import torch
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

from rlserve.core import tracing
from rlserve.core.batch import Batch
from rlserve.core.codec import batch_to_proto
from rlserve.core.process_group import init_process_group, node_ip, open_rendezvous
from rlserve.core.rpc import RetryPolicy, ServiceClient
from rlserve.core.serving import RpcError, invalid_argument, rpc_method
from rlserve.core.workers import WorkerGroup
from rlserve.v1 import reward_pb2, reward_pb2_grpc


@pytest.fixture(autouse=True)
def _tracing_off_afterwards():
    yield
    tracing.shutdown_tracing()


class FlakyReward(reward_pb2_grpc.RewardServiceServicer):
    """RewardService.ComputeReward: answers per the batch's meta 'mode'."""

    def __init__(self):
        self.calls = 0
        self.metadata_keys: list[set[str]] = []

    @rpc_method(reward_pb2.ComputeRewardResponse)
    async def ComputeReward(self, request, call):
        self.calls += 1
        self.metadata_keys.append({key for key, _ in call.metadata})
        mode = request.batch.meta.extra["mode"].string_value
        if mode == "flaky" and self.calls == 1:
            raise RpcError(grpc.StatusCode.UNAVAILABLE, "replica starting")
        if mode == "invalid":
            raise invalid_argument("batch.non_tensors['response_text']", "missing")
        with tracing.span("reward.rule", batch_size=2):
            pass
        return reward_pb2.ComputeRewardResponse(metrics={"tokens": 7.0})


def _request(mode: str) -> reward_pb2.ComputeRewardRequest:
    batch = Batch(tensors={"input_ids": torch.zeros(2, 3, dtype=torch.int64)}, meta={"mode": mode})
    return reward_pb2.ComputeRewardRequest(batch=batch_to_proto(batch))


async def _serve_and_call(servicer: FlakyReward, calls: list[str]) -> list[object]:
    """Starts a gRPC server with `servicer`, makes `calls` under a `ppo.step` span."""
    server = grpc.aio.server()
    reward_pb2_grpc.add_RewardServiceServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    client = ServiceClient(
        channel,
        reward_pb2_grpc.RewardServiceStub,
        "reward",
        timeout_s=10,
        policy=RetryPolicy(retries=2, initial_backoff_s=0.01),
        direct=False,  # this server, never a Serve app of the session's cluster
    )
    outcomes: list[object] = []
    try:
        with tracing.span("ppo.step", step=3):
            for mode in calls:
                try:
                    outcomes.append(await client.call("ComputeReward", _request(mode)))
                except grpc.aio.AioRpcError as error:
                    outcomes.append(error.code())
    finally:
        await channel.close()
        await server.stop(None)
    return outcomes


def _recording(tmp_path) -> InMemorySpanExporter:
    provider = tracing.setup_tracing(
        "rlserve-trainer", None, 1.0, True, file_path=tmp_path / "spans.jsonl"
    )
    memory = InMemorySpanExporter()
    provider.add_span_processor(SimpleSpanProcessor(memory))
    return memory


def test_each_attempt_is_a_client_span_with_its_server_span_as_child(tmp_path):
    memory = _recording(tmp_path)
    servicer = FlakyReward()
    outcomes = asyncio.run(_serve_and_call(servicer, ["flaky"]))
    assert isinstance(outcomes[0], reward_pb2.ComputeRewardResponse)
    assert servicer.calls == 2  # UNAVAILABLE once, then answered
    spans = memory.get_finished_spans()
    by_id = {s.context.span_id: s for s in spans}
    (root,) = [s for s in spans if s.name == "ppo.step"]
    clients = sorted(
        (s for s in spans if s.name == "rpc.client/RewardService/ComputeReward"),
        key=lambda s: s.attributes["rlserve.attempt"],
    )
    servers = [s for s in spans if s.name == "rpc.server/RewardService/ComputeReward"]
    assert [c.attributes["rlserve.attempt"] for c in clients] == [0, 1]
    assert all(c.parent.span_id == root.context.span_id for c in clients)
    assert all(
        c.kind is SpanKind.CLIENT and c.attributes["rlserve.role"] == "reward" for c in clients
    )
    # The failed attempt is an error on both sides; the retry is fine.
    assert clients[0].status.status_code is StatusCode.ERROR
    assert clients[0].attributes["rpc.grpc.status_code"] == grpc.StatusCode.UNAVAILABLE.value[0]
    assert clients[1].status.status_code is StatusCode.UNSET
    assert len(servers) == 2
    for server in servers:
        parent = by_id[server.parent.span_id]
        assert parent in clients and server.parent.is_remote
        assert server.kind is SpanKind.SERVER
        assert server.context.trace_id == root.context.trace_id
        assert server.attributes["rlserve.role"] == "reward"
        assert server.attributes["rlserve.batch_size"] == 2
        assert server.attributes["rlserve.request_bytes"] > 0
    failed = next(s for s in servers if by_id[s.parent.span_id] is clients[0])
    answered = next(s for s in servers if by_id[s.parent.span_id] is clients[1])
    assert failed.status.status_code is StatusCode.ERROR
    assert "UNAVAILABLE: replica starting" in failed.status.description
    assert answered.attributes["rlserve.tokens"] == 7
    (work,) = [s for s in spans if s.name == "reward.rule"]
    assert work.parent.span_id == answered.context.span_id


def test_a_non_retryable_failure_is_one_errored_attempt(tmp_path):
    memory = _recording(tmp_path)
    outcomes = asyncio.run(_serve_and_call(FlakyReward(), ["invalid"]))
    assert outcomes == [grpc.StatusCode.INVALID_ARGUMENT]
    spans = {s.name: s for s in memory.get_finished_spans()}
    client = spans["rpc.client/RewardService/ComputeReward"]
    server = spans["rpc.server/RewardService/ComputeReward"]
    assert client.status.status_code is StatusCode.ERROR
    assert server.status.status_code is StatusCode.ERROR
    assert server.attributes["rpc.grpc.status_code"] == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert "batch.non_tensors['response_text']: missing" in server.status.description


def test_tracing_off_sends_no_trace_metadata():
    tracing.setup_tracing("rlserve-trainer", None, 1.0, False)
    servicer = FlakyReward()
    asyncio.run(_serve_and_call(servicer, ["ok"]))
    assert servicer.metadata_keys[0].isdisjoint(tracing.TRACE_METADATA_KEYS)
    assert "application" in servicer.metadata_keys[0]


# --- worker groups ----------------------------------------------------------------------


class TracedWorker:
    """A rank whose method opens a span of its own, as service workers do."""

    def __init__(self, rank: int, world_size: int):
        self.rank, self.world_size = rank, world_size
        self.rendezvous = None

    def node_address(self):
        self.rendezvous = open_rendezvous()
        return node_ip(), self.rendezvous.port

    def init_distributed(self, address, port):
        init_process_group(self.rank, self.world_size, address, port, store=self.rendezvous)

    def double(self, batch: Batch) -> Batch:
        with tracing.span("probe.compute", batch_size=len(batch)):
            return Batch(tensors={"x": batch["x"] * 2})


def _spans_in(path, names: set[str], count: int, timeout_s: float = 30.0) -> list[dict]:
    """OTLP/JSON spans named `names` in the file, once `count` arrived (workers export
    on their own thread), each with its resource attributes under "resource"."""
    deadline = time.monotonic() + timeout_s
    while True:
        found = []
        lines = path.read_text().splitlines() if path.exists() else []
        for line in lines:
            for resource_spans in json.loads(line)["resourceSpans"]:
                resource = {
                    a["key"]: next(iter(a["value"].values()))
                    for a in resource_spans["resource"]["attributes"]
                }
                for scope in resource_spans["scopeSpans"]:
                    found += [
                        {**s, "resource": resource} for s in scope["spans"] if s["name"] in names
                    ]
        if len(found) >= count or time.monotonic() > deadline:
            return found
        time.sleep(0.25)


def test_workers_continue_the_callers_trace(serve_cluster, tmp_path):
    path = tmp_path / "spans.jsonl"
    tracing.setup_tracing(
        "rlserve-probe", None, 1.0, True, path, resource_attributes={"rlserve.replica": "r1"}
    )
    group = WorkerGroup(TracedWorker, 2, {}, num_cpus_per_worker=0.5)
    try:
        batch = Batch(tensors={"x": torch.arange(5)})
        with tracing.span("rpc.server/Probe/Double") as server:
            result = asyncio.run(group.run_split("double", batch))
        assert result["x"].tolist() == [0, 2, 4, 6, 8]
        # A call outside any trace: the workers must not start traces of their own.
        asyncio.run(group.run_split("double", batch))
        tracing.flush_tracing()
        spans = _spans_in(path, {"worker.double", "probe.compute"}, 4)
        time.sleep(2 * tracing.EXPORT_DELAY_MS / 1000)  # anything more would be a defect
        spans = _spans_in(path, {"worker.double", "probe.compute"}, 4)
    finally:
        group.shutdown()
    assert len(spans) == 4, [s["name"] for s in spans]
    server_id = f"{server.get_span_context().span_id:016x}"
    trace_id = f"{server.get_span_context().trace_id:032x}"
    shares = [s for s in spans if s["name"] == "worker.double"]
    assert all(s["parentSpanId"] == server_id and s["traceId"] == trace_id for s in shares)
    attributes = [{a["key"]: a["value"] for a in s["attributes"]} for s in shares]
    assert sorted(int(a["rlserve.rank"]["intValue"]) for a in attributes) == [0, 1]
    assert sorted(int(a["rlserve.batch_size"]["intValue"]) for a in attributes) == [3, 3]
    share_ids = {s["spanId"] for s in shares}
    assert all(s["parentSpanId"] in share_ids for s in spans if s["name"] == "probe.compute")
    for span in spans:
        resource = span["resource"]
        assert resource["service.name"] == "rlserve-probe"
        assert resource["rlserve.replica"] == "r1"  # inherited from the controller
        assert resource["rlserve.node_id"]
        assert "rlserve.rank" in resource


def test_a_group_made_while_tracing_is_off_makes_plain_calls(serve_cluster):
    tracing.setup_tracing("rlserve-probe", None, 1.0, False)
    group = WorkerGroup(TracedWorker, 1, {}, num_cpus_per_worker=0.5)
    try:
        assert group._tracing is None
        result = asyncio.run(group.run_split("double", Batch(tensors={"x": torch.arange(3)})))
        assert result["x"].tolist() == [0, 2, 4]
    finally:
        group.shutdown()
