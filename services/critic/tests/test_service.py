"""The critic through Serve's gRPC port: values, updates, replay, checkpoints, bad requests."""

import time

import grpc
import pytest
import torch
from ray import serve

from rlserve.core.batch import Batch
from rlserve.core.codec import batch_from_proto, batch_to_proto
from rlserve.core.rpc import call_metadata
from rlserve.core.serving import deadline_metadata
from rlserve.critic.app import build_app
from rlserve.v1 import common_pb2, critic_pb2, critic_pb2_grpc

APP = "critic-service-test"
TIMEOUT_S = 120.0
SEQUENCE_KEYS = ["input_ids", "attention_mask", "responses", "response_mask"]
CHECKPOINT_ROOT = None  # set by the stub fixture
CONFIG = {
    "workers": 1,
    "num_cpus_per_worker": 1,
    "ppo_mini_batch_samples": 4,
    "micro_batch_samples": 2,
    "ppo_epochs": 2,
    "lr": 1e-2,
    "max_batch_samples": 16,
}


@pytest.fixture(scope="module")
def stub(serve_cluster, tiny_model_dir, tmp_path_factory):
    global CHECKPOINT_ROOT
    # Every tmp_path lies under pytest's base temp dir: the service's checkpoint root.
    CHECKPOINT_ROOT = tmp_path_factory.getbasetemp().resolve()
    args = {"model_path": str(tiny_model_dir), "checkpoint_root": str(CHECKPOINT_ROOT), **CONFIG}
    serve.run(build_app(args), name=APP, route_prefix=f"/{APP}")
    channel = serve_cluster.channel()
    yield critic_pb2_grpc.CriticServiceStub(channel)
    channel.close()
    serve.delete(APP)


def sequences(batch: Batch) -> Batch:
    return batch.select([key for key in SEQUENCE_KEYS if key in batch.tensors])


def compute_values(stub, batch: Batch) -> tuple[torch.Tensor, int]:
    response = stub.ComputeValues(
        critic_pb2.ComputeValuesRequest(batch=batch_to_proto(sequences(batch))),
        metadata=call_metadata(APP, deadline_metadata(TIMEOUT_S)),
        timeout=TIMEOUT_S,
    )
    values = batch_from_proto(response.batch)
    return values.tensors["values"], values.meta["weights_version"]


def update(stub, step: int, batch: Batch) -> critic_pb2.UpdateCriticResponse:
    return stub.UpdateCritic(
        critic_pb2.UpdateCriticRequest(step=step, batch=batch_to_proto(batch)),
        metadata=call_metadata(APP, deadline_metadata(TIMEOUT_S)),
        timeout=TIMEOUT_S,
    )


def checkpoint(stub, rpc: str, path) -> tuple[int, int]:
    """Save/LoadCheckpoint of a directory under the checkpoint root (or of `path` as sent,
    when it is a str)."""
    request_type = getattr(critic_pb2, f"CriticService{rpc}Request")
    name = path if isinstance(path, str) else str(path.resolve().relative_to(CHECKPOINT_ROOT))
    location = common_pb2.CheckpointLocation(path=name)
    response = getattr(stub, rpc)(
        request_type(location=location), metadata=call_metadata(APP), timeout=TIMEOUT_S
    )
    return response.weights_version, response.last_applied_step


def test_info_values_update_replay(stub, make_batch):
    info = stub.GetInfo(critic_pb2.CriticServiceGetInfoRequest(), metadata=call_metadata(APP)).info
    assert (info.role, info.engine, info.weights_version, info.last_applied_step) == (
        "critic",
        "deepspeed",
        0,
        -1,
    )
    assert [w.rank for w in info.workers] == [0] and info.workers[0].pid > 0

    batch = make_batch(8, seed=21)
    values, version = compute_values(stub, batch)
    assert values.shape == (8, 5) and version == 0
    assert torch.count_nonzero(values) == 0  # zero-initialised head

    first = update(stub, 0, batch)
    assert (first.weights_version, first.replayed) == (1, False)
    assert first.metrics["vf_loss"] > 0 and first.metrics["grad_norm"] > 0
    assert first.metrics["tokens"] == float(batch.tensors["response_mask"].sum())
    trained, version = compute_values(stub, batch)
    assert version == 1 and torch.count_nonzero(trained) > 0
    assert torch.all(trained[batch.tensors["response_mask"] == 0] == 0)

    replay = update(stub, 0, batch)
    assert (replay.weights_version, replay.replayed) == (1, True)
    assert dict(replay.metrics) == dict(first.metrics)
    assert torch.equal(compute_values(stub, batch)[0], trained)
    info = stub.GetInfo(critic_pb2.CriticServiceGetInfoRequest(), metadata=call_metadata(APP)).info
    assert (info.weights_version, info.last_applied_step) == (1, 0)


def test_checkpoint_save_update_load_restores(stub, make_batch, tmp_path):
    batch = make_batch(4, seed=22)
    version, step = checkpoint(stub, "SaveCheckpoint", tmp_path)
    assert (tmp_path / "model" / "model.safetensors").is_file()
    assert (tmp_path / "model" / "config.json").is_file()
    saved, _ = compute_values(stub, batch)

    moved = update(stub, step + 1, batch)
    assert moved.weights_version == version + 1
    assert not torch.equal(compute_values(stub, batch)[0], saved)

    assert checkpoint(stub, "LoadCheckpoint", tmp_path) == (version, step)
    restored, restored_version = compute_values(stub, batch)
    assert restored_version == version
    assert torch.equal(restored, saved)

    # The exported model reproduces the service's values with plain transformers.
    from transformers import AutoModelForTokenClassification

    from rlserve.core.modeling import position_ids_from_mask

    model = AutoModelForTokenClassification.from_pretrained(tmp_path / "model").eval()
    ids, attention = batch.tensors["input_ids"], batch.tensors["attention_mask"]
    with torch.no_grad():
        logits = model(
            input_ids=ids, attention_mask=attention, position_ids=position_ids_from_mask(attention)
        ).logits[:, -6:-1, 0]
    mask = batch.tensors["response_mask"]
    torch.testing.assert_close(logits * mask, saved, atol=1e-5, rtol=0)


def _tensors(batch: Batch, **changes) -> Batch:
    tensors = {k: v for k, v in batch.tensors.items() if k not in changes}
    tensors.update({k: v for k, v in changes.items() if v is not None})
    return Batch(tensors)


def test_invalid_requests_then_a_valid_call(stub, make_batch, tmp_path):
    info = stub.GetInfo(critic_pb2.CriticServiceGetInfoRequest(), metadata=call_metadata(APP)).info
    step = info.last_applied_step + 1  # steps must be the next one: checks come after
    good = make_batch(4, seed=23)
    t = good.tensors
    nan_values = t["values"].clone()
    nan_values[1, 0] = float("inf")
    calls = [
        (compute_values, (_tensors(good, attention_mask=t["attention_mask"][:, :3]),),
         grpc.StatusCode.INVALID_ARGUMENT, "batch.tensors['attention_mask']: shape"),
        (compute_values, (make_batch(17),),
         grpc.StatusCode.RESOURCE_EXHAUSTED, "batch: 17 rows exceed"),
        (compute_values, (_tensors(good, responses=None),),
         grpc.StatusCode.INVALID_ARGUMENT, "batch.tensors['responses']: missing"),
        (lambda s, b: update(s, step, b), (_tensors(good, values=nan_values),),
         grpc.StatusCode.INVALID_ARGUMENT, "batch.tensors['values']: 1 values are NaN or infinite"),
        (lambda s, b: update(s, step, b), (_tensors(good, returns=None),),
         grpc.StatusCode.INVALID_ARGUMENT, "batch.tensors['returns']: missing"),
        (lambda s, b: update(s, step, b), (make_batch(6),),
         grpc.StatusCode.INVALID_ARGUMENT, "ppo_mini_batch_samples (4)"),
        (lambda s, b: update(s, 2**63 - 1, b), (good,),
         grpc.StatusCode.FAILED_PRECONDITION, f"expects step {step} next"),
        (lambda s, p: checkpoint(s, "LoadCheckpoint", p), (tmp_path / "nothing",),
         grpc.StatusCode.FAILED_PRECONDITION, "location.path: no critic checkpoint"),
        (lambda s, p: checkpoint(s, "SaveCheckpoint", p), ("/tmp/elsewhere",),
         grpc.StatusCode.INVALID_ARGUMENT, "location.path: '/tmp/elsewhere' is absolute"),
        (lambda s, p: checkpoint(s, "SaveCheckpoint", p), ("../up",),
         grpc.StatusCode.INVALID_ARGUMENT, "location.path: '../up' climbs out with '..'"),
    ]  # fmt: skip
    for call, args, code, message in calls:
        with pytest.raises(grpc.RpcError) as error:
            call(stub, *args)
        assert error.value.code() == code, error.value.details()
        assert message in error.value.details()

    # A malformed tensor is rejected by the codec with the field's name.
    request = critic_pb2.ComputeValuesRequest()
    request.batch.tensors["input_ids"].CopyFrom(
        common_pb2.Tensor(dtype=common_pb2.DTYPE_INT64, shape=[2, 3], data=b"\0" * 7)
    )
    with pytest.raises(grpc.RpcError) as error:
        stub.ComputeValues(request, metadata=call_metadata(APP), timeout=TIMEOUT_S)
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "tensors['input_ids'].data" in error.value.details()

    # A caller whose deadline has passed gets DEADLINE_EXCEEDED, and nothing trains.
    version = stub.GetInfo(critic_pb2.CriticServiceGetInfoRequest(), metadata=call_metadata(APP))
    with pytest.raises(grpc.RpcError) as error:
        stub.UpdateCritic(
            critic_pb2.UpdateCriticRequest(step=step, batch=batch_to_proto(good)),
            metadata=call_metadata(APP, deadline_metadata(-1.0)),
            timeout=TIMEOUT_S,
        )
    assert error.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED

    # The replica keeps serving.
    values, weights_version = compute_values(stub, good)
    assert values.shape == (4, 5) and weights_version == version.info.weights_version
    assert update(stub, step, good).replayed is False


def test_an_update_whose_caller_hangs_up_completes(stub, make_batch):
    """A caller gone mid-update (a killed trainer) must not cut the update in half: Serve
    cancels the request, and Ray would cancel the worker calls made under it too."""
    info = stub.GetInfo(critic_pb2.CriticServiceGetInfoRequest(), metadata=call_metadata(APP)).info
    step = info.last_applied_step + 1
    batch = make_batch(16, prompt_len=6, response_len=3000, seed=24)  # ≈ 6 s of training
    call = stub.UpdateCritic.future(
        critic_pb2.UpdateCriticRequest(step=step, batch=batch_to_proto(batch)),
        metadata=call_metadata(APP, deadline_metadata(TIMEOUT_S)),
        timeout=TIMEOUT_S,
    )
    time.sleep(1.5)  # the update is under way
    assert call.cancel(), "the update finished before the caller hung up: make it longer"

    retried = update(stub, step, batch)  # waits for the update still running
    assert (retried.weights_version, retried.replayed) == (info.weights_version + 1, True)
    info = stub.GetInfo(critic_pb2.CriticServiceGetInfoRequest(), metadata=call_metadata(APP)).info
    assert info.last_applied_step == step
