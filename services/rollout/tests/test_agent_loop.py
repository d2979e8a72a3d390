"""The agent loop with a scripted engine and scripted tools (no model, no Ray): each
sample's trajectory is its prompt, its turns and the template's pieces around each
observation; a slow tool holds up no other sample; every limit and failure ends or
counts where it says."""

import asyncio
import json
import time

import pytest

from rlserve.core.embedded.tokenizer import build_char_tokenizer
from rlserve.rollout.agent_loop import (
    AgentLimits,
    AgentSample,
    GeneratedTurn,
    ToolAnswer,
    run_agent_loop,
)
from rlserve.rollout.tool_calls import BracketParser
from rlserve.rollout.trajectory import ChatDeltas, Trajectory

# A template whose pieces are all characters the character tokenizer has.
TEMPLATE = (
    "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}#{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)


@pytest.fixture(scope="module")
def tokenizer():
    tokenizer = build_char_tokenizer()
    tokenizer.chat_template = TEMPLATE
    return tokenizer


def encode(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


class ScriptedEngine:
    """Answers each sample's next scripted turn (found by its prompt); records which
    samples each generation held."""

    def __init__(self, tokenizer, scripts: dict[str, list[str]], delay_s: float = 0.0):
        self.tokenizer, self.scripts, self.delay_s = tokenizer, scripts, delay_s
        self.turns_taken = dict.fromkeys(scripts, 0)
        self.batches: list[list[str]] = []
        self.budgets: list[list[int]] = []

    def prompt_of(self, ids: list[int]) -> str:
        text = self.tokenizer.decode(ids)
        return next(prompt for prompt in self.scripts if text.startswith(f"<user>{prompt}"))

    async def __call__(self, ids: list[list[int]], budgets: list[int]) -> list[GeneratedTurn]:
        await asyncio.sleep(self.delay_s)
        prompts = [self.prompt_of(sample) for sample in ids]
        self.batches.append(prompts)
        self.budgets.append(budgets)
        turns = []
        for prompt, budget in zip(prompts, budgets, strict=True):
            text = self.scripts[prompt][self.turns_taken[prompt]]
            self.turns_taken[prompt] += 1
            turn = encode(self.tokenizer, text)
            cut = len(turn) > budget
            turn = turn[:budget]
            turns.append(GeneratedTurn(turn, [-0.1] * len(turn), cut))
        return turns


class ScriptedTools:
    """The calculator, with a delay per expression; records every call."""

    def __init__(self, delays_s: dict[str, float] | None = None, fail: str | None = None):
        self.delays_s, self.fail = delays_s or {}, fail
        self.calls: list[tuple[str, str, dict, str]] = []

    async def __call__(self, session_id, call, row_kwargs_json) -> ToolAnswer:
        arguments = json.loads(call.arguments_json)
        self.calls.append((session_id, call.name, arguments, row_kwargs_json))
        expression = arguments["expression"]
        await asyncio.sleep(self.delays_s.get(expression, 0.0))
        if expression == self.fail:
            raise ConnectionError("environment unreachable")
        if expression == "done":
            return ToolAnswer("bye", step_reward=1.0, done=True)
        if call.name != "calc":
            return ToolAnswer(f"Error: no tool {call.name!r}", error="unknown_tool")
        return ToolAnswer(str(eval(expression, {})), step_reward=0.5)  # test-only numbers


def samples_for(tokenizer, prompts: list[str]) -> list[AgentSample]:
    deltas = ChatDeltas(tokenizer)
    out = []
    for index, prompt in enumerate(prompts):
        ids = tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=False
        )
        out.append(AgentSample(Trajectory(encode(tokenizer, ids)), f"s{index}", '{"calc": {}}'))
    return out, deltas


def run(samples, engine, tools, deltas, **limits):
    asyncio.run(
        run_agent_loop(samples, engine, tools, BracketParser(), deltas, AgentLimits(**limits))
    )


def test_a_sample_calls_a_tool_reads_its_answer_and_answers(tokenizer):
    samples, deltas = samples_for(tokenizer, ["12*7+3=", "1+1="])
    engine = ScriptedEngine(tokenizer, {"12*7+3=": ["[calc: 12*7]", "87"], "1+1=": ["2"]})
    tools = ScriptedTools()
    run(samples, engine, tools, deltas)
    tool_sample, plain = samples
    assert tool_sample.ending == "answer" and plain.ending == "answer"
    assert tools.calls == [("s0", "calc", {"expression": "12*7"}, '{"calc": {}}')]
    expected = "<user>12*7+3=#<assistant>[calc: 12*7]#<tool>84#<assistant>87"
    assert tokenizer.decode(tool_sample.trajectory.ids) == expected
    turn1, turn2 = encode(tokenizer, "[calc: 12*7]"), encode(tokenizer, "87")
    context = encode(tokenizer, "#<tool>84#<assistant>")
    assert tool_sample.trajectory.response_ids == turn1 + context + turn2
    assert tool_sample.trajectory.response_mask == [1] * len(turn1) + [0] * len(context) + [
        1
    ] * len(turn2)
    assert tool_sample.trajectory.log_probs == [-0.1] * len(turn1) + [0.0] * len(context) + [
        -0.1
    ] * len(turn2)
    assert (tool_sample.tool_calls, tool_sample.tool_reward, tool_sample.trajectory.turns) == (
        1,
        0.5,
        2,
    )
    assert tokenizer.decode(plain.trajectory.response_ids) == "2"
    assert plain.tool_calls == 0 and not plain.errors


def test_a_slow_tool_holds_up_no_other_sample(tokenizer):
    samples, deltas = samples_for(tokenizer, ["slow=", "fast="])
    engine = ScriptedEngine(
        tokenizer,
        {
            "slow=": ["[calc: 2*3]", "6"],
            "fast=": ["[calc: 1+1]", "[calc: 2+2]", "[calc: 3+3]", "6"],
        },
        delay_s=0.01,
    )
    tools = ScriptedTools(delays_s={"2*3": 1.0})
    started = time.monotonic()
    run(samples, engine, tools, deltas)
    assert time.monotonic() - started < 3
    # the fast sample took three more turns while the slow tool ran
    assert engine.batches[0] == ["slow=", "fast="]
    assert engine.batches[1:4] == [["fast="]] * 3
    assert engine.batches[4] == ["slow="]
    assert [s.ending for s in samples] == ["answer", "answer"]
    assert samples[0].tool_s >= 1.0 > samples[1].tool_s


def test_limits_end_a_sample_where_they_say(tokenizer):
    calls = ["[calc: 1+1]"] * 10
    samples, deltas = samples_for(tokenizer, ["t=", "c="])
    engine = ScriptedEngine(tokenizer, {"t=": calls, "c=": ["[calc: 1][calc: 2][calc: 3]"]})
    run(samples, engine, ScriptedTools(), deltas, max_turns=3, max_tool_calls=2)
    turns, calls_limit = samples
    assert turns.ending == "max_turns" and turns.trajectory.turns == 3
    assert turns.tool_calls == 2  # the third turn's call was not run
    assert calls_limit.ending == "max_tool_calls" and calls_limit.tool_calls == 0


def test_the_response_never_passes_its_token_budget(tokenizer):
    samples, deltas = samples_for(tokenizer, ["big=", "long="])
    engine = ScriptedEngine(tokenizer, {"big=": ["[calc: 10**30]", "x"], "long=": ["y" * 50]})
    run(samples, engine, ScriptedTools(), deltas, max_response_tokens=30)
    big, long = samples
    assert long.ending == "max_tokens" and len(long.trajectory.response_ids) == 30
    assert engine.budgets[0] == [30, 30]
    # the observation pushed past the budget: cut there, and the sample ended
    assert big.ending == "max_tokens" and len(big.trajectory.response_ids) == 30
    assert sum(big.trajectory.response_mask) == len(encode(tokenizer, "[calc: 10**30]"))


def test_an_observation_is_cut_to_its_token_limit(tokenizer):
    samples, deltas = samples_for(tokenizer, ["q="])
    engine = ScriptedEngine(tokenizer, {"q=": ["[calc: 10**20]", "ok"]})
    run(samples, engine, ScriptedTools(), deltas, max_tool_response_tokens=5)
    text = tokenizer.decode(samples[0].trajectory.response_ids)
    assert text == "[calc: 10**20]#<tool>10000#<assistant>ok"


def test_failures_are_observations_and_counts(tokenizer):
    samples, deltas = samples_for(tokenizer, ["f="])
    engine = ScriptedEngine(tokenizer, {"f=": ["[calc: down][nope: 1]", "[calc: done]", "never"]})
    tools = ScriptedTools(fail="down")
    run(samples, engine, tools, deltas)
    (sample,) = samples
    assert dict(sample.errors) == {"unavailable": 1, "unknown_tool": 1}
    assert sample.ending == "done" and sample.tool_calls == 3 and sample.tool_reward == 1.0
    text = tokenizer.decode(sample.trajectory.response_ids)
    assert "<tool>Error: the tool could not be reached (ConnectionError)#" in text
    assert "<tool>Error: no tool 'nope'#" in text
    # the episode ended with the tool's done: the turn is closed, nothing follows
    assert text.endswith("[calc: done]#")


def test_a_turn_cut_by_its_budget_ends_the_sample_unparsed(tokenizer):
    samples, deltas = samples_for(tokenizer, ["c="])
    engine = ScriptedEngine(tokenizer, {"c=": ["[calc: 1+1]"]})
    tools = ScriptedTools()
    run(samples, engine, tools, deltas, max_response_tokens=5)
    assert samples[0].ending == "max_tokens" and tools.calls == []


def test_a_request_naming_environment_apps_without_end_is_refused(tokenizer):
    """Requests name the environment app; each name costs the replica a gRPC channel."""
    import grpc

    from rlserve.core import api
    from rlserve.core.serving import RpcError
    from rlserve.rollout.agent_rollout import MAX_ENVIRONMENT_APPS, AgentRollout

    rollout = AgentRollout(tokenizer)
    rollout.check(api.Agent(environment_app="environment"))
    for name in ("", "a/b", "x" * 65):
        with pytest.raises(RpcError) as bad:
            rollout.check(api.Agent(environment_app=name))
        assert bad.value.code == grpc.StatusCode.INVALID_ARGUMENT
        assert bad.value.message.startswith("agent.environment_app: ")
    rollout._clients = {f"app{i}": object() for i in range(MAX_ENVIRONMENT_APPS)}
    with pytest.raises(RpcError, match="already calls 8 environment apps"):
        rollout.check(api.Agent(environment_app="one-more"))
    rollout.check(api.Agent(environment_app="app3"))  # one it already calls
