"""GenerateSequences with tools, end to end on the session's cluster: the rollout service,
once per engine (hf and vLLM), and the environment service (calculator), called through
Serve's proxy.

The model is the tiny Llama taught one tool-using conversation (integration_tests/
agent_support.py): asked "2*3=", it writes the call "[calc: 2*3]", reads the tool's "6" and
answers "6". So greedy decoding makes the calls this test checks, the tool really runs,
and the answer carries the observation's tokens with mask 0 between the model's two
turns, token for token the same through either engine.

A second tiny model, on SmolLM2-135M-Instruct's tokenizer and chat template, is taught a
Hermes-format conversation: through either engine its trajectory must be the prompt, the
generated call, the template's delta around the tool's answer and the generated answer,
each piece's ids exactly as the template's own text tokenizes, nothing lost at the
boundaries (the turn end the call stopped before, newlines, special tokens).
"""

import asyncio
import dataclasses
import json

import grpc
import pytest
import torch
from ray import serve

from integration_tests.agent_support import (
    PROMPT,
    TEMPLATE,
    build_smollm2_agent_model,
    smollm2_conversation,
    smollm2_tokenizer,
)
from rlserve.core import api
from rlserve.core.batch import Batch
from rlserve.core.embedded.tokenizer import build_char_tokenizer
from rlserve.core.rpc import ServiceClient, open_channel
from rlserve.environment.app import build_app as build_environment
from rlserve.rollout.app import build_app as build_rollout
from rlserve.v1 import rollout_pb2_grpc

ENVIRONMENT = "environment-agent"
ENGINES = ("hf", "vllm")


def deploy_rollouts(model_dir, checkpoint_root, name: str) -> None:
    """One rollout app per engine serving `model_dir`: <name>-hf and <name>-vllm."""
    for engine in ENGINES:
        serve.run(
            build_rollout(
                {
                    "model_path": str(model_dir),
                    "checkpoint_root": str(checkpoint_root),
                    "engine": engine,
                    "ppo_mini_batch_samples": 2,
                    "micro_batch_samples": 2,
                    "max_new_tokens_limit": 64,
                }
            ),
            name=f"{name}-{engine}",
            route_prefix=f"/{name}-{engine}",
        )


@pytest.fixture(scope="module")
def client(serve_cluster, agent_model_dir, tmp_path_factory):
    # the calculator under the name the models learned to call
    environment = {"tools": {"calc": {"tool": "calculator"}}, "num_cpus_per_replica": 0.5}
    serve.run(build_environment(environment), name=ENVIRONMENT, route_prefix=f"/{ENVIRONMENT}")
    deploy_rollouts(agent_model_dir, tmp_path_factory.getbasetemp().resolve(), "rollout-agent")
    yield serve_cluster
    for engine in ENGINES:
        serve.delete(f"rollout-agent-{engine}")
    serve.delete(ENVIRONMENT)


@pytest.fixture(scope="module")
def smollm2_client(client, tmp_path_factory):
    model_dir = build_smollm2_agent_model(tmp_path_factory.mktemp("smollm2_agent"))
    deploy_rollouts(model_dir, tmp_path_factory.getbasetemp().resolve(), "rollout-smollm2")
    yield client
    for engine in ENGINES:
        serve.delete(f"rollout-smollm2-{engine}")


def call_rollout(address: str, app: str, prompt_ids: list[list[int]], pad_id: int, agent):
    """GenerateSequences on `app` for left-padded prompts, greedy, up to 64 tokens."""
    width = max(map(len, prompt_ids))
    input_ids = torch.full((len(prompt_ids), width), pad_id)
    attention_mask = torch.zeros((len(prompt_ids), width), dtype=torch.long)
    for row, ids in enumerate(prompt_ids):
        input_ids[row, width - len(ids) :] = torch.tensor(ids)
        attention_mask[row, width - len(ids) :] = 1
    prompts_batch = Batch(
        {"input_ids": input_ids, "attention_mask": attention_mask},
        {"tools_kwargs": [json.dumps({"calc": {}})] * len(prompt_ids)},
    )
    request = api.GenerateSequencesRequest(prompts_batch, api.Sampling(0.0, 64), agent=agent)

    async def call():
        channel = open_channel(address)
        service = ServiceClient(channel, rollout_pb2_grpc.RolloutServiceStub, app, 120.0)
        try:
            return await service.call_api(request)
        finally:
            await service.close()
            await channel.close()

    return asyncio.run(call())


def generate(address: str, engine: str, prompts: list[str], agent: api.Agent):
    tokenizer = build_char_tokenizer()
    tokenizer.chat_template = TEMPLATE
    prompt_ids = [
        tokenizer.encode(
            tokenizer.apply_chat_template(
                [{"role": "user", "content": p}], add_generation_prompt=True, tokenize=False
            ),
            add_special_tokens=False,
        )
        for p in prompts
    ]
    answer = call_rollout(
        address, f"rollout-agent-{engine}", prompt_ids, tokenizer.pad_token_id, agent
    )
    return answer, tokenizer


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


@pytest.mark.parametrize("engine", ENGINES)
def test_smollm2s_template_trajectory_is_the_prompt_the_turns_and_the_answers_delta(
    smollm2_client, engine
):
    tokenizer = smollm2_tokenizer()
    prompt, call, delta, answer = smollm2_conversation(tokenizer)
    hermes = dataclasses.replace(AGENT, tool_call_format="hermes")
    batch = call_rollout(
        smollm2_client.grpc_address,
        f"rollout-smollm2-{engine}",
        [prompt],
        tokenizer.pad_token_id,
        hermes,
    ).batch
    assert batch["prompts"][0].tolist() == prompt
    length = int(batch["attention_mask"][0, len(prompt) :].sum())
    assert batch["responses"][0, :length].tolist() == call + delta + answer
    # the call stopped at "</tool_call>": the turn end comes from the template, mask 0
    assert tokenizer.decode(delta).startswith("<|im_end|>\n<|im_start|>tool\n6")
    mask = batch["response_mask"][0, :length].tolist()
    assert mask == [1] * len(call) + [0] * len(delta) + [1] * len(answer)
    assert batch["tool_calls"].tolist() == [1] and batch["tool_errors"].tolist() == [0]
    assert PROMPT in tokenizer.decode(prompt)
