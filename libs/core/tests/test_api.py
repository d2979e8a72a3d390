"""The plain API (rlserve.core.api) against the contract in proto/: each request names a
real RPC of its service with its own messages, carries every field of its protobuf
request, and round-trips through protobuf unchanged; so do the answers."""

from dataclasses import fields

import numpy as np
import pytest
import torch
from google.protobuf import message_factory

from rlserve.core import api
from rlserve.core.batch import Batch
from rlserve.core.wire import BatchColumns
from rlserve.v1 import common_pb2, rollout_pb2


def _batch(rows: int = 3) -> Batch:
    ids = torch.arange(rows * 4, dtype=torch.int64).reshape(rows, 4)
    return Batch(
        tensors={"input_ids": ids, "attention_mask": torch.ones_like(ids)},
        non_tensors={"response_text": [f"r{i}" for i in range(rows)]},
        meta={"weights_version": 5, "step": 2},
    )


def _assert_same_batch(a: Batch, b: Batch) -> None:
    assert a.tensors.keys() == b.tensors.keys()
    for key in a.tensors:
        assert torch.equal(a[key], b[key]) and a[key].dtype == b[key].dtype
    assert a.non_tensors == b.non_tensors and a.meta == b.meta


@pytest.mark.parametrize("request_type", api.BATCH_REQUESTS, ids=lambda t: t.RPC)
def test_each_request_is_its_rpcs_own(request_type):
    service = common_pb2.DESCRIPTOR.pool.FindServiceByName(f"rlserve.v1.{request_type.SERVICE}")
    method = service.methods_by_name[request_type.RPC]
    assert message_factory.GetMessageClass(method.input_type) is request_type.PROTO
    assert message_factory.GetMessageClass(method.output_type) is request_type.RESPONSE_PROTO


@pytest.mark.parametrize("request_type", api.BATCH_REQUESTS, ids=lambda t: t.RPC)
def test_each_request_carries_every_field_of_its_message(request_type):
    names = {field.name for field in fields(request_type)}
    assert names == set(request_type.PROTO.DESCRIPTOR.fields_by_name)


def test_agent_carries_every_field_of_agent_params():
    names = {field.name for field in fields(api.Agent)}
    assert names == set(rollout_pb2.AgentParams.DESCRIPTOR.fields_by_name)


REQUESTS = [
    api.GenerateSequencesRequest(
        _batch(),
        api.Sampling(0.7, 8, top_p=0.9, top_k=5, responses_per_prompt=4, seed=11),
        expected_weights_version=5,
        return_log_probs=True,
    ),
    api.GenerateSequencesRequest(_batch(), api.Sampling(0.0, 3, ignore_eos=True)),
    api.GenerateSequencesRequest(
        _batch(),
        api.Sampling(1.0, 64),
        agent=api.Agent("env", "bracket", "code", 3, 5, 100, 2.5, "user"),
    ),
    api.ComputeLogProbRequest(_batch(), True, 5, True),
    api.ComputeLogProbRequest(_batch()),
    api.UpdateActorRequest(7, 5, _batch()),
    api.ComputeRefLogProbRequest(_batch()),
    api.ComputeValuesRequest(_batch()),
    api.UpdateCriticRequest(3, _batch()),
    api.ComputeRewardRequest(_batch()),
]


@pytest.mark.parametrize("request_", REQUESTS, ids=lambda r: type(r).RPC)
def test_requests_round_trip_through_protobuf(request_):
    wire = type(request_).PROTO.FromString(request_.to_proto().SerializeToString())
    back = type(request_).from_proto(wire)
    for name in (field.name for field in fields(request_)):
        mine, theirs = getattr(request_, name), getattr(back, name)
        if isinstance(mine, Batch):
            _assert_same_batch(mine, theirs)
        else:
            assert mine == theirs, name


def test_sampling_reads_the_protos_zero_defaults_and_keeps_its_float32_precision():
    read = api.Sampling.from_proto(rollout_pb2.SamplingParams(temperature=0.7, max_new_tokens=4))
    assert (read.top_p, read.top_k, read.responses_per_prompt, read.seed) == (1.0, -1, 1, None)
    # the handle route's Sampling samples exactly what the gRPC route's would
    assert api.Sampling(0.7, 4) == read and read.temperature == float(np.float32(0.7))


def test_a_reward_replica_without_a_model_reads_columns_only():
    message = api.ComputeRewardRequest(_batch()).to_proto()
    columns = api.ComputeRewardRequest.from_proto(message, reads_tensors=False).batch
    assert isinstance(columns, BatchColumns) and len(columns) == 3
    assert columns.non_tensors["response_text"] == ["r0", "r1", "r2"]


def test_answers_round_trip_through_protobuf():
    batch = _batch()
    answer = api.BatchAnswer(batch, {"forward_s": 0.5})
    back = api.BatchAnswer.from_proto(answer.to_proto(rollout_pb2.ComputeLogProbResponse))
    _assert_same_batch(batch, back.batch)
    assert back.metrics == {"forward_s": 0.5}

    for scores in (None, Batch({"log_probs": torch.ones(3, 2)})):
        update = api.UpdateAnswer({"pg_loss": 1.5}, 6, True, scores)
        back = api.UpdateAnswer.from_proto(update.to_proto(rollout_pb2.UpdateActorResponse))
        assert (back.metrics, back.weights_version, back.replayed) == ({"pg_loss": 1.5}, 6, True)
        assert (back.scores is None) == (scores is None)

    scores = {"scores": np.array([1.0, 0.0], dtype=np.float32)}
    reward = api.ScoresAnswer(scores, {"rule_s": 0.1})
    back = api.ScoresAnswer.from_proto(reward.to_proto(api.ComputeRewardRequest.RESPONSE_PROTO))
    assert np.array_equal(back.scores["scores"], scores["scores"])
    assert back.scores["scores"].dtype == np.float32 and back.metrics == {"rule_s": 0.1}
