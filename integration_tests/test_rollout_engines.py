"""The rollout service's two engines agree: hf and vllm apps side by side on one Serve.

The model is the warmed-up embedded Llama (head size 32, which vLLM's CPU attention
supports), so greedy answers differ across prompts and agreement is a real check. Both
apps receive the same PPO update; greedy generation must change and still agree, which
shows each engine received the new weights.
"""

import grpc
import pytest
import torch
from ray import serve

from rlserve.core.batch import Batch
from rlserve.core.codec import batch_from_proto, batch_to_proto
from rlserve.core.embedded.task import read_jsonl
from rlserve.core.modeling import load_tokenizer
from rlserve.core.rpc import call_metadata
from rlserve.trainer.deploy import deploy_applications
from rlserve.v1 import rollout_pb2, rollout_pb2_grpc

ENGINES = ("hf", "vllm")


@pytest.fixture(scope="module")
def stubs(serve_cluster, embedded):
    args = {
        "model_path": str(embedded.model_dir),
        "lr": 5e-3,
        "ppo_mini_batch_samples": 32,
        "micro_batch_samples": 32,
    }
    apps = [
        {
            "name": f"rollout-{engine}",
            "route_prefix": f"/rollout-{engine}",
            "import_path": "rlserve.rollout.app:build_app",
            "args": {**args, "engine": engine},
        }
        for engine in ENGINES
    ]
    deploy_applications(apps, timeout_s=300)
    channel = serve_cluster.channel()
    yield {engine: rollout_pb2_grpc.RolloutServiceStub(channel) for engine in ENGINES}
    for engine in ENGINES:
        serve.delete(f"rollout-{engine}")
    channel.close()


def _call(stubs, engine, rpc, request):
    metadata = call_metadata(f"rollout-{engine}")
    return getattr(stubs[engine], rpc)(request, metadata=metadata, timeout=300)


def _prompts(embedded, count=32) -> Batch:
    tokenizer = load_tokenizer(embedded.model_dir)
    rows = read_jsonl(embedded.eval_path)[:count]
    encoded = tokenizer([r["prompt"] for r in rows], padding=True, return_tensors="pt")
    return Batch(
        tensors={"input_ids": encoded["input_ids"], "attention_mask": encoded["attention_mask"]}
    )


def _generate(stubs, engine, prompts, temperature=0.0, seed=0) -> Batch:
    request = rollout_pb2.GenerateSequencesRequest(
        prompts=batch_to_proto(prompts),
        sampling=rollout_pb2.SamplingParams(
            temperature=temperature, max_new_tokens=4, responses_per_prompt=1, seed=seed
        ),
    )
    return batch_from_proto(_call(stubs, engine, "GenerateSequences", request).batch)


def test_greedy_agrees_before_and_after_the_same_update(stubs, embedded):
    prompts = _prompts(embedded)
    before = {e: _generate(stubs, e, prompts) for e in ENGINES}
    assert torch.equal(before["hf"]["responses"], before["vllm"]["responses"])
    assert len(set(before["hf"]["response_text"])) > 5  # answers differ across prompts

    # One update from sampled responses with positive advantages: the same batch for both.
    sampled = _generate(stubs, "hf", prompts, temperature=1.0, seed=3)
    sequences = sampled.select(
        tensor_keys=["input_ids", "attention_mask", "responses", "response_mask"],
        non_tensor_keys=[],
    )
    scored = _call(
        stubs,
        "hf",
        "ComputeLogProb",
        rollout_pb2.ComputeLogProbRequest(batch=batch_to_proto(sequences)),
    )
    update = Batch(
        tensors={
            **sequences.tensors,
            "old_log_probs": batch_from_proto(scored.batch)["log_probs"],
            "advantages": torch.ones_like(sampled["response_mask"], dtype=torch.float32),
        },
        meta=sampled.meta,
    )
    for engine in ENGINES:
        result = _call(
            stubs,
            engine,
            "UpdateActor",
            rollout_pb2.UpdateActorRequest(step=0, batch=batch_to_proto(update), weights_version=0),
        )
        assert result.weights_version == 1

    after = {e: _generate(stubs, e, prompts) for e in ENGINES}
    assert after["hf"].meta["weights_version"] == after["vllm"].meta["weights_version"] == 1
    assert not torch.equal(after["vllm"]["responses"], before["vllm"]["responses"])
    assert torch.equal(after["hf"]["responses"], after["vllm"]["responses"])


def test_vllm_app_rejects_a_bad_request_and_keeps_serving(stubs, embedded):
    request = rollout_pb2.GenerateSequencesRequest(
        prompts=batch_to_proto(_prompts(embedded, 2)),
        sampling=rollout_pb2.SamplingParams(max_new_tokens=0),
    )
    with pytest.raises(grpc.RpcError) as error:
        _call(stubs, "vllm", "GenerateSequences", request)
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "max_new_tokens" in error.value.details()
    assert len(_generate(stubs, "vllm", _prompts(embedded, 2))) == 2
