"""The reference merged into the rollout service (placement.reference_in_rollout): no
reference app is deployed, the rollout app answers ReferenceService from frozen initial
weights held beside the actor, and a PPO run with a KL penalty trains against it."""

import asyncio
from pathlib import Path

import grpc
import pytest
import torch
from ray import serve

from integration_tests.support import (
    deployed_services,
    fresh_services,
    run_inputs,
    session_runs_root,
    tiny_run_config,
)
from rlserve.core.batch import Batch
from rlserve.core.codec import batch_from_proto, batch_to_proto
from rlserve.core.modeling import load_tokenizer
from rlserve.core.rpc import call_metadata
from rlserve.trainer.deploy import service_args
from rlserve.trainer.metrics import read_metrics
from rlserve.trainer.run import train_on_services
from rlserve.v1 import reference_pb2, reference_pb2_grpc, rollout_pb2, rollout_pb2_grpc

TIMEOUT_S = 120
SEQUENCE_KEYS = ["input_ids", "attention_mask", "responses", "response_mask"]


def _sequences(rollout, model_dir) -> Batch:
    tokenizer = load_tokenizer(model_dir)
    tokenizer.padding_side = "left"
    encoded = tokenizer(["3+4=", "12+15="], return_tensors="pt", padding=True)
    prompts = Batch(
        {"input_ids": encoded["input_ids"], "attention_mask": encoded["attention_mask"]}
    )
    generated = rollout.GenerateSequences(
        rollout_pb2.GenerateSequencesRequest(
            prompts=batch_to_proto(prompts),
            sampling=rollout_pb2.SamplingParams(
                temperature=1.0, max_new_tokens=3, responses_per_prompt=2, seed=1
            ),
        ),
        metadata=call_metadata("rollout"),
        timeout=TIMEOUT_S,
    )
    return batch_from_proto(generated.batch).select(tensor_keys=SEQUENCE_KEYS, non_tensor_keys=[])


def _scores(rollout, reference, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
    wire = batch_to_proto(batch)
    policy = rollout.ComputeLogProb(
        rollout_pb2.ComputeLogProbRequest(batch=wire),
        metadata=call_metadata("rollout"),
        timeout=TIMEOUT_S,
    )
    ref = reference.ComputeRefLogProb(
        reference_pb2.ComputeRefLogProbRequest(batch=wire),
        metadata=call_metadata("rollout"),
        timeout=TIMEOUT_S,
    )
    return (
        batch_from_proto(policy.batch).tensors["log_probs"],
        batch_from_proto(ref.batch).tensors["ref_log_probs"],
    )


def test_merged_reference_stays_at_the_initial_weights_through_training(
    serve_cluster, embedded, tmp_path
):
    config = tiny_run_config(
        tmp_path,
        placement={"reference_in_rollout": True},
        algorithm={"kl_ctrl": {"kl_coef": 0.05}},
        trainer={"total_steps": 3},
    )
    inputs = run_inputs(embedded)
    apps = service_args(config, inputs.model_dir)
    assert "reference" not in apps and apps["rollout"]["serve_reference"] is True
    fresh_services(config, inputs)
    assert "reference" not in serve.status().applications

    channel = serve_cluster.channel()
    rollout = rollout_pb2_grpc.RolloutServiceStub(channel)
    reference = reference_pb2_grpc.ReferenceServiceStub(channel)
    info = reference.GetInfo(
        reference_pb2.ReferenceServiceGetInfoRequest(),
        metadata=call_metadata("rollout"),
        timeout=TIMEOUT_S,
    )
    assert info.info.role == "rollout" and len(info.info.workers) == 1

    batch = _sequences(rollout, embedded.model_dir)
    policy_before, ref_before = _scores(rollout, reference, batch)
    torch.testing.assert_close(ref_before, policy_before, atol=1e-5, rtol=0)

    summary = asyncio.run(
        train_on_services(config, inputs, tmp_path, serve_cluster.grpc_address, show_progress=False)
    )
    assert summary.steps == 3
    records = [r for r in read_metrics(Path(summary.metrics_jsonl)) if "kl_mean" in r]
    assert len(records) == 3 and records[-1]["kl_mean"] != 0.0  # policy drifted from the ref

    policy_after, ref_after = _scores(rollout, reference, batch)
    torch.testing.assert_close(ref_after, ref_before, atol=1e-6, rtol=0)
    assert (policy_after - policy_before).abs().max() > 1e-3
    channel.close()


def test_rollout_without_reference_weights_refuses_the_reference_rpc(
    serve_cluster, embedded, tmp_path
):
    config = tiny_run_config(tmp_path, session_runs_root(tmp_path))  # a separate reference
    deployed_services(config, run_inputs(embedded), serve_cluster.grpc_address)
    channel = serve_cluster.channel()
    reference = reference_pb2_grpc.ReferenceServiceStub(channel)
    rollout = rollout_pb2_grpc.RolloutServiceStub(channel)
    with pytest.raises(grpc.RpcError) as error:
        reference.ComputeRefLogProb(
            reference_pb2.ComputeRefLogProbRequest(
                batch=batch_to_proto(_sequences(rollout, embedded.model_dir))
            ),
            metadata=call_metadata("rollout"),
            timeout=TIMEOUT_S,
        )
    assert error.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "serve_reference: true" in error.value.details()
    channel.close()
