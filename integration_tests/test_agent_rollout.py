"""GenerateSequences with tools, end to end on the session's cluster: the rollout service,
once per engine (hf and vLLM), and the environment service (calculator), called through
Serve's proxy.

The model is the tiny Llama taught one tool-using conversation (integration_tests/
agent_support.py): asked "2*3=", it writes the call "[calc: 2*3]", reads the tool's "6" and
answers "6". So greedy decoding makes the calls this test checks, the tool really runs,
and the answer carries the observation's tokens with mask 0 between the model's two
turns, token for token the same through either engine.
"""

import asyncio
import dataclasses
import json

import grpc
import pytest
from ray import serve

from integration_tests.agent_support import TEMPLATE
from rlserve.core import api
from rlserve.core.batch import Batch
from rlserve.core.embedded.tokenizer import build_char_tokenizer
from rlserve.core.rpc import ServiceClient, open_channel
from rlserve.environment.app import build_app as build_environment
from rlserve.rollout.app import build_app as build_rollout
from rlserve.v1 import rollout_pb2_grpc

ENVIRONMENT = "environment-agent"
ENGINES = ("hf", "vllm")


@pytest.fixture(scope="module")
def client(serve_cluster, agent_model_dir, tmp_path_factory):
    # the calculator under the name the model learned to call
    environment = {"tools": {"calc": {"tool": "calculator"}}, "num_cpus_per_replica": 0.5}
    serve.run(build_environment(environment), name=ENVIRONMENT, route_prefix=f"/{ENVIRONMENT}")
    for engine in ENGINES:
        serve.run(
            build_rollout(
                {
                    "model_path": str(agent_model_dir),
                    "checkpoint_root": str(tmp_path_factory.getbasetemp().resolve()),
                    "engine": engine,
                    "ppo_mini_batch_samples": 2,
                    "micro_batch_samples": 2,
                    "max_new_tokens_limit": 64,
                }
            ),
            name=f"rollout-agent-{engine}",
            route_prefix=f"/rollout-agent-{engine}",
        )
    yield serve_cluster
    for engine in ENGINES:
        serve.delete(f"rollout-agent-{engine}")
    serve.delete(ENVIRONMENT)


def generate(
    address: str, engine: str, prompts: list[str], agent: api.Agent, max_new_tokens: int = 40
):
    tokenizer = build_char_tokenizer()
    tokenizer.chat_template = TEMPLATE
    texts = [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": p}], add_generation_prompt=True, tokenize=False
        )
        for p in prompts
    ]
    encoded = tokenizer(texts, padding=True, add_special_tokens=False, return_tensors="pt")
    prompts_batch = Batch(
        {"input_ids": encoded.input_ids, "attention_mask": encoded.attention_mask},
        {"tools_kwargs": [json.dumps({"calc": {}})] * len(prompts)},
    )
    request = api.GenerateSequencesRequest(
        prompts_batch, api.Sampling(0.0, max_new_tokens), agent=agent
    )

    async def call():
        channel = open_channel(address)
        service = ServiceClient(
            channel, rollout_pb2_grpc.RolloutServiceStub, f"rollout-agent-{engine}", 120.0
        )
        try:
            return await service.call_api(request)
        finally:
            await service.close()
            await channel.close()

    return asyncio.run(call()), tokenizer


AGENT = api.Agent(
    environment_app=ENVIRONMENT,
    tool_call_format="bracket",
    bracket_argument="expression",
    max_turns=3,
    max_tool_calls=2,
    max_tool_response_tokens=16,
    tool_timeout_s=30.0,
)


@pytest.mark.parametrize("engine", ENGINES)
def test_a_tool_call_runs_and_its_answer_sits_between_the_turns_with_mask_0(client, engine):
    answer, tokenizer = generate(client.grpc_address, engine, ["2*3="], AGENT)
    batch = answer.batch
    length = int(batch["attention_mask"][0, batch["prompts"].shape[1] :].sum())
    response = batch["responses"][0, :length].tolist()
    text = tokenizer.decode(response)
    # the call, the template's turn end and the tool's answer, the model's answer + EOS
    assert text == "[calc: 2*3]#<tool>6#<assistant>6#<eos>"
    call = tokenizer.encode("[calc: 2*3]", add_special_tokens=False)
    context = tokenizer.encode("#<tool>6#<assistant>", add_special_tokens=False)
    assert response[: len(call) + len(context)] == call + context
    mask = batch["response_mask"][0, :length].tolist()
    assert mask == [1] * len(call) + [0] * len(context) + [1] * (length - len(call) - len(context))
    assert batch["response_mask"][0, length:].sum() == 0
    assert batch["turns"].tolist() == [2] and batch["tool_calls"].tolist() == [1]
    assert batch["tool_errors"].tolist() == [0] and batch.non_tensors["ending"] == ["answer"]
    assert batch.non_tensors["response_text"] == ["6#"]  # the last turn, special tokens out
    assert answer.metrics["agent/tool_calls"] == 1.0 and answer.metrics["agent/tool_s"] > 0


def test_a_request_the_service_cannot_run_is_invalid_argument_naming_the_field(client):
    for field, value in (("tool_call_format", "xml"), ("max_turns", 0)):
        with pytest.raises(grpc.aio.AioRpcError) as error:
            generate(
                client.grpc_address, "hf", ["2*3="], dataclasses.replace(AGENT, **{field: value})
            )
        assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert error.value.details().startswith(f"agent.{field}: ")
