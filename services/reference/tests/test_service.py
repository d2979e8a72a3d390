"""The reference through Serve's gRPC port: log-probs, bad requests, 2 workers = 1."""

import grpc
import pytest
import torch
from ray import serve

from rlserve.core.batch import Batch
from rlserve.core.codec import batch_from_proto, batch_to_proto
from rlserve.core.modeling import load_causal_lm
from rlserve.core.rpc import call_metadata
from rlserve.core.serving import deadline_metadata
from rlserve.reference.app import build_app
from rlserve.v1 import common_pb2, reference_pb2, reference_pb2_grpc

APPS = {1: "reference-dp1-test", 2: "reference-dp2-test"}
TIMEOUT_S = 120.0


@pytest.fixture(scope="module")
def stub(serve_cluster, tiny_model_dir):
    targets = []
    for workers, app in APPS.items():
        args = {
            "model_path": str(tiny_model_dir),
            "workers": workers,
            "forward_micro_batch_samples": 2,
            "max_batch_samples": 16,
        }
        targets.append(serve.RunTarget(build_app(args), name=app, route_prefix=f"/{app}"))
    serve.run_many(targets)  # together: their workers start in parallel
    channel = serve_cluster.channel()
    yield reference_pb2_grpc.ReferenceServiceStub(channel)
    channel.close()
    for app in APPS.values():
        serve.delete(app)


def ref_log_probs(stub, batch: Batch, workers: int = 1, timeout_s: float = TIMEOUT_S):
    response = stub.ComputeRefLogProb(
        reference_pb2.ComputeRefLogProbRequest(batch=batch_to_proto(batch)),
        metadata=call_metadata(APPS[workers], deadline_metadata(timeout_s)),
        timeout=TIMEOUT_S,
    )
    result = batch_from_proto(response.batch)
    return result.tensors["ref_log_probs"], dict(response.metrics), result.meta


def test_log_probs_and_info(stub, tiny_model_dir, make_batch, direct_reference):
    batch = make_batch(6, seed=41)
    log_probs, metrics, meta = ref_log_probs(stub, batch)
    expected = direct_reference(load_causal_lm(tiny_model_dir), batch)
    torch.testing.assert_close(log_probs, expected, atol=1e-5, rtol=0)
    assert metrics["tokens"] == float(batch.tensors["response_mask"].sum())
    assert meta["weights_version"] == 0

    info = stub.GetInfo(
        reference_pb2.ReferenceServiceGetInfoRequest(), metadata=call_metadata(APPS[2])
    ).info
    assert (info.role, info.engine, info.model, info.weights_version) == (
        "reference",
        "hf",
        str(tiny_model_dir),
        0,
    )
    assert [w.rank for w in info.workers] == [0, 1]


def test_two_workers_agree_with_one(stub, make_batch):
    batch = make_batch(7, seed=42)  # odd: the 2-worker split pads one row
    one, _, _ = ref_log_probs(stub, batch, workers=1)
    two, _, _ = ref_log_probs(stub, batch, workers=2)
    # Same rows, same micro-batch size; only the padded split differs. 1e-6: summation order.
    torch.testing.assert_close(two, one, atol=1e-6, rtol=0)


def test_invalid_requests_then_a_valid_call(stub, make_batch):
    good = make_batch(4, seed=43)
    t = good.tensors
    cases = [
        (Batch({**t, "input_ids": t["input_ids"].float()}), grpc.StatusCode.INVALID_ARGUMENT,
         "batch.tensors['input_ids']: dtype must be int64 or int32, got torch.float32"),
        (Batch({k: v for k, v in t.items() if k != "response_mask"}),
         grpc.StatusCode.INVALID_ARGUMENT, "batch.tensors['response_mask']: missing"),
        (Batch({**t, "responses": t["responses"] + 1000}), grpc.StatusCode.INVALID_ARGUMENT,
         "batch.tensors['responses']: token ids must lie in 0..98"),
        (make_batch(17), grpc.StatusCode.RESOURCE_EXHAUSTED, "batch: 17 rows exceed"),
    ]  # fmt: skip
    for batch, code, message in cases:
        with pytest.raises(grpc.RpcError) as error:
            ref_log_probs(stub, batch)
        assert error.value.code() == code, error.value.details()
        assert message in error.value.details()

    request = reference_pb2.ComputeRefLogProbRequest()
    request.batch.tensors["input_ids"].CopyFrom(
        common_pb2.Tensor(dtype=common_pb2.DTYPE_UNSPECIFIED, shape=[1], data=b"")
    )
    with pytest.raises(grpc.RpcError) as error:
        stub.ComputeRefLogProb(request, metadata=call_metadata(APPS[1]), timeout=TIMEOUT_S)
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "tensors['input_ids'].dtype" in error.value.details()

    with pytest.raises(grpc.RpcError) as error:
        ref_log_probs(stub, good, timeout_s=-1.0)
    assert error.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED

    log_probs, _, _ = ref_log_probs(stub, good)  # the replica keeps serving
    assert log_probs.shape == (4, 5)
