"""One trace across three processes, exported over OTLP gRPC to a real backend (Phoenix).

The test process plays the trainer: its `ppo.step` root span has two client spans. One
call goes through Serve's gRPC proxy to a deployment (playing the reference service)
whose server span continues the trace from the incoming metadata; the other hands the
injected metadata to a Ray task (playing the reward service) that continues it the same
way. Every process runs `setup_tracing` with its own service name and exports to
Phoenix; the test then reads the spans back and checks the links across processes.
Phoenix drops resource attributes, so a span's service is read from its
`rlserve.service` attribute (see integration_tests/phoenix.py).
"""

import os

import grpc
import pytest
import ray
from ray import serve

from rlserve.core import tracing
from rlserve.core.rpc import call_metadata
from rlserve.core.serving import rpc_method
from rlserve.v1 import reference_pb2, reference_pb2_grpc

APP = "tracing-probe"
SERVICES = ("trainer", "reference", "reward")


@serve.deployment
class TracedReference:
    """A ReferenceService replica that only traces: one work span under the server span
    that `rpc_method` opens."""

    def __init__(self, endpoint: str):
        tracing.setup_tracing(
            "reference",
            endpoint,
            1.0,
            True,
            resource_attributes={"rlserve.replica": serve.get_replica_context().replica_tag},
        )

    @rpc_method(reference_pb2.ComputeRefLogProbResponse)
    async def ComputeRefLogProb(self, request, call):
        # rpc_method opened the server span, continuing the caller's trace.
        with tracing.span("reference.forward", batch_size=4, pid=os.getpid()):
            pass
        # Export before answering so the test need not wait for the batch interval.
        tracing.flush_tracing()
        return reference_pb2.ComputeRefLogProbResponse(metrics={"pid": float(os.getpid())})


@ray.remote(num_cpus=0)
def traced_reward(endpoint: str, metadata: list[tuple[str, str]]) -> int:
    """A reward 'service' in a Ray worker continuing the trace handed over as metadata."""
    tracing.setup_tracing("reward", endpoint, 1.0, True)
    try:
        with (
            tracing.rpc_server_span("RewardService", "ComputeReward", metadata, role="reward"),
            tracing.span("reward.http_call", status=200, retries=0, pid=os.getpid()),
        ):
            pass
    finally:
        tracing.shutdown_tracing()
    return os.getpid()


@pytest.fixture(scope="module")
def reference_stub(serve_cluster, phoenix_backend):
    serve.run(TracedReference.bind(phoenix_backend.otlp_endpoint), name=APP, route_prefix=f"/{APP}")
    channel = serve_cluster.channel()
    yield reference_pb2_grpc.ReferenceServiceStub(channel)
    serve.delete(APP)
    channel.close()


def test_one_step_is_one_trace_across_processes(phoenix_backend, reference_stub):
    tracing.setup_tracing("trainer", phoenix_backend.otlp_endpoint, 1.0, True)
    try:
        with tracing.span("ppo.step", step=0) as root:
            with tracing.rpc_client_span("ReferenceService", "ComputeRefLogProb", role="reference"):
                metadata = tracing.inject_metadata(call_metadata(APP))
                response = reference_stub.ComputeRefLogProb(
                    reference_pb2.ComputeRefLogProbRequest(), metadata=metadata, timeout=60
                )
            with tracing.rpc_client_span("RewardService", "ComputeReward", role="reward"):
                reward_pid = ray.get(
                    traced_reward.remote(
                        phoenix_backend.otlp_endpoint, tracing.inject_metadata([])
                    ),
                    timeout=120,
                )
        trace_id = format(root.get_span_context().trace_id, "032x")
    except grpc.RpcError as error:
        pytest.fail(f"probe call failed: {error.code()} {error.details()}")
    finally:
        tracing.shutdown_tracing()
    reference_pid = int(response.metrics["pid"])
    assert len({os.getpid(), reference_pid, reward_pid}) == 3, "three distinct processes"

    stored = phoenix_backend.wait_for_spans(7, [trace_id])
    spans = {span["name"]: span for span in stored}
    assert len(spans) == len(stored) == 7, sorted(span["name"] for span in stored)

    def parent_of(name: str) -> str | None:
        parent_id = spans[name]["parent_id"]
        return next(
            (n for n, s in spans.items() if s["context"]["span_id"] == parent_id),
            "<orphan>" if parent_id else None,
        )

    assert {name: parent_of(name) for name in spans} == {
        "ppo.step": None,
        "rpc.client/ReferenceService/ComputeRefLogProb": "ppo.step",
        "rpc.server/ReferenceService/ComputeRefLogProb": (
            "rpc.client/ReferenceService/ComputeRefLogProb"
        ),
        "reference.forward": "rpc.server/ReferenceService/ComputeRefLogProb",
        "rpc.client/RewardService/ComputeReward": "ppo.step",
        "rpc.server/RewardService/ComputeReward": "rpc.client/RewardService/ComputeReward",
        "reward.http_call": "rpc.server/RewardService/ComputeReward",
    }
    assert {name: s["attributes"]["rlserve.service"] for name, s in spans.items()} == {
        "ppo.step": "trainer",
        "rpc.client/ReferenceService/ComputeRefLogProb": "trainer",
        "rpc.client/RewardService/ComputeReward": "trainer",
        "rpc.server/ReferenceService/ComputeRefLogProb": "reference",
        "reference.forward": "reference",
        "rpc.server/RewardService/ComputeReward": "reward",
        "reward.http_call": "reward",
    }
    # Attributes survive the trip, and the work ran in the process that says so.
    assert spans["ppo.step"]["attributes"]["rlserve.step"] == 0
    assert spans["reference.forward"]["attributes"]["rlserve.pid"] == reference_pid
    assert spans["reward.http_call"]["attributes"]["rlserve.pid"] == reward_pid
    assert spans["reward.http_call"]["attributes"]["rlserve.status"] == 200
    assert spans["rpc.client/RewardService/ComputeReward"]["attributes"]["rpc.method"] == (
        "ComputeReward"
    )


def test_unsampled_step_leaves_no_spans_downstream(phoenix_backend, reference_stub):
    # Ratio 0 at the trainer: the services follow its decision although their own
    # ratio is 1.0, so no span of this step reaches the backend.
    tracing.setup_tracing("trainer", phoenix_backend.otlp_endpoint, 0.0, True)
    try:
        with tracing.span("ppo.step", step=1) as root:
            with tracing.rpc_client_span("ReferenceService", "ComputeRefLogProb"):
                reference_stub.ComputeRefLogProb(
                    reference_pb2.ComputeRefLogProbRequest(),
                    metadata=tracing.inject_metadata(call_metadata(APP)),
                    timeout=60,
                )
            with tracing.rpc_client_span("RewardService", "ComputeReward"):
                ray.get(
                    traced_reward.remote(
                        phoenix_backend.otlp_endpoint, tracing.inject_metadata([])
                    ),
                    timeout=120,
                )
        unsampled_trace_id = format(root.get_span_context().trace_id, "032x")
        # Then a sampled call through the same processes: once its spans are stored,
        # anything the services had exported for the unsampled step would be too.
        tracing.setup_tracing("trainer", phoenix_backend.otlp_endpoint, 1.0, True)
        with tracing.span("marker") as marker:
            reference_stub.ComputeRefLogProb(
                reference_pb2.ComputeRefLogProbRequest(),
                metadata=tracing.inject_metadata(call_metadata(APP)),
                timeout=60,
            )
            ray.get(
                traced_reward.remote(phoenix_backend.otlp_endpoint, tracing.inject_metadata([])),
                timeout=120,
            )
        marker_trace_id = format(marker.get_span_context().trace_id, "032x")
    finally:
        tracing.shutdown_tracing()
    phoenix_backend.wait_for_spans(5, [marker_trace_id])
    assert phoenix_backend.spans(trace_ids=[unsampled_trace_id]) == []
