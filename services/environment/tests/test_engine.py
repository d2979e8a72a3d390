"""EnvironmentEngine without Ray: what the caller's mistakes raise, what the model's and
the tools' failures answer, sessions' state, expiry and eviction."""

import asyncio
import json
import time

import grpc
import pytest

from rlserve.core.config import ConfigError, validate_config
from rlserve.core.serving import RpcError
from rlserve.environment.config import EnvironmentServiceConfig
from rlserve.environment.engine import EnvironmentEngine

TOOLS = {
    "calculator": {"tool": "calculator"},
    "counter": {"tool": "sample_tools:Counter", "kwargs": {"stop": 3, "rewarding": True}},
    "sleeper": {"tool": "sample_tools:Sleeper", "timeout_s": 0.2},
    "raiser": {"tool": "sample_tools:Raiser"},
    "confused": {"tool": "sample_tools:Confused"},
    "verbose": {"tool": "sample_tools:Verbose"},
}


def engine(**settings) -> EnvironmentEngine:
    return EnvironmentEngine(
        validate_config(EnvironmentServiceConfig, {"tools": TOOLS, **settings})
    )


def call(engine, tool, arguments, session="s-1", row=""):
    return asyncio.run(engine.call_tool(session, tool, json.dumps(arguments), row))


def test_a_call_answers_the_tools_outcome():
    answer = call(engine(), "calculator", {"expression": "12*7+3"})
    assert (answer.observation, answer.error, answer.done) == ("87", "", False)
    assert answer.metrics["tool_s"] >= 0


def test_the_models_mistakes_are_observations_naming_what_went_wrong():
    env = engine()
    unknown = call(env, "calculater", {})
    assert unknown.error == "unknown_tool" and "tools: calculator, confused" in unknown.observation
    not_json = asyncio.run(env.call_tool("s", "calculator", "{expression: 1}", ""))
    assert not_json.error == "bad_arguments" and "not JSON" in not_json.observation
    not_object = asyncio.run(env.call_tool("s", "calculator", "[1]", ""))
    assert not_object.error == "bad_arguments"
    refused = call(env, "calculator", {"expression": 7})
    assert refused.error == "bad_arguments"
    assert refused.observation == "Error: argument 'expression' must be a string"


def test_a_tool_past_its_timeout_answers_timeout_and_the_engine_goes_on():
    env = engine()
    started = time.monotonic()
    answer = call(env, "sleeper", {"seconds": 30})
    assert time.monotonic() - started < 5
    assert answer.error == "timeout" and "within 0.2 s" in answer.observation
    assert call(env, "sleeper", {"seconds": 0}).observation == "awake"


def test_a_failing_tool_answers_tool_error():
    env = engine()
    failed = call(env, "raiser", {"kind": "runtime"})
    assert failed.error == "tool_error"
    assert failed.observation == "Error: raiser failed (RuntimeError: the backend is down)"
    assert call(env, "raiser", {"kind": "value"}).error == "bad_arguments"
    confused = call(env, "confused", {})
    assert confused.error == "tool_error" and "not a ToolOutcome" in confused.observation


def test_a_long_observation_is_cut_and_says_so():
    answer = call(engine(max_observation_chars=100), "verbose", {"chars": 1000})
    assert answer.observation == "x" * 100 + "\n[observation cut at 100 characters]"


def test_a_session_keeps_each_tools_state_from_the_rows_kwargs():
    env = engine()
    row = json.dumps({"counter": {"start": 10}})
    answers = [call(env, "counter", {}, "a", row) for _ in range(2)]
    assert [a.observation for a in answers] == ["11", "12"]
    assert answers[0].step_reward == 1.0 and answers[0].metrics["counted"] == 1.0
    # another session starts afresh; the first one's kwargs were read once
    assert call(env, "counter", {}, "b").observation == "1"
    assert call(env, "counter", {}, "a").observation == "13"
    assert [call(env, "counter", {}, "b").done for _ in range(2)] == [False, True]
    assert env.close("a") and not env.close("a")
    assert call(env, "counter", {}, "a").observation == "1"


def test_sessions_expire_and_the_least_recently_used_are_evicted():
    env = engine(max_sessions=2, session_ttl_s=0.2)
    for session in ("a", "b", "a", "c"):  # c evicts b, the least recently used
        call(env, "counter", {}, session)
    assert env.sessions.evicted == 1 and len(env.sessions) == 2
    assert call(env, "counter", {}, "a").observation == "3"
    assert call(env, "counter", {}, "b").observation == "1"
    time.sleep(0.3)
    assert call(env, "counter", {}, "a").observation == "1"  # expired: afresh
    assert len(env.sessions) == 1


@pytest.mark.parametrize(
    ("session", "row", "field"),
    [
        ("", "", "session_id"),
        ("a/b", "", "session_id"),
        ("s" * 129, "", "session_id"),
        ("s", "{not json", "tools_kwargs_json"),
        ("s", '{"counter": 3}', "tools_kwargs_json"),
        ("s", "[]", "tools_kwargs_json"),
        ("s", json.dumps({"counter": {"x": "y" * 70_000}}), "tools_kwargs_json"),
    ],
)
def test_a_malformed_request_is_invalid_argument_naming_the_field(session, row, field):
    with pytest.raises(RpcError) as error:
        asyncio.run(engine().call_tool(session, "calculator", "{}", row))
    assert error.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert error.value.message.startswith(f"{field}: ")


def test_oversized_arguments_are_invalid_argument():
    with pytest.raises(RpcError) as error:
        asyncio.run(engine(max_arguments_chars=10).call_tool("s", "calculator", "1" * 11, ""))
    assert error.value.message.startswith("arguments_json: over max_arguments_chars (10)")


@pytest.mark.parametrize(
    ("tools", "field", "problem"),
    [
        ({"c": {"tool": "abacus"}}, "tools.c.tool", "unknown tool 'abacus'; built-in tools:"),
        ({"c": {"tool": "no_such_module:X"}}, "tools.c", "cannot import module 'no_such_module'"),
        ({"c": {"tool": "sample_tools:Nothing"}}, "tools.c", "has no class 'Nothing'"),
        ({"c": {"tool": "sample_tools:Counter", "kwargs": {"bad": 1}}}, "tools.c.kwargs", "cannot"),
        ({"c": {"tool": "calculator", "kwargs": {"bad": 1}}}, "tools.c.kwargs", "cannot"),
        ({}, "tools", ""),
    ],
)
def test_config_errors_name_the_tool(tools, field, problem):
    with pytest.raises(ConfigError) as error:
        validate_config(EnvironmentServiceConfig, {"tools": tools})
    assert field in error.value.paths
    assert problem in str(error.value)


def test_schemas_carry_the_name_the_model_calls():
    schemas = engine().schemas()
    assert schemas["calculator"]["function"]["name"] == "calculator"
    assert schemas["counter"]["function"]["name"] == "counter"
    assert "expression" in schemas["calculator"]["function"]["parameters"]["properties"]


def test_the_python_tool_runs_code_in_the_sandbox_and_says_how_it_ended():
    env = EnvironmentEngine(
        validate_config(
            EnvironmentServiceConfig,
            {"tools": {"python": {"tool": "python", "kwargs": {"limits": {"wall_s": 2.0}}}}},
        )
    )
    answer = call(env, "python", {"code": "print(6 * 7)"})
    assert (answer.observation, answer.error) == ("42\n", "")
    assert answer.metrics["sandbox_s"] > 0
    failed = call(env, "python", {"code": "import os\nprint('x')\nraise SystemExit(3)"})
    assert failed.observation.startswith("x\n\n[failed, exit status 3]")
    hung = call(env, "python", {"code": "import time\ntime.sleep(30)"})
    assert "[stopped by wall_s" in hung.observation
    outside = call(env, "python", {"code": "print(open('/etc/hostname').read())"})
    assert "FileNotFoundError" in outside.observation or "PermissionError" in outside.observation
    assert call(env, "python", {"code": 7}).error == "bad_arguments"
    schema = env.schemas()["python"]["function"]
    assert schema["name"] == "python" and "code" in schema["parameters"]["properties"]


def test_the_python_tool_refuses_to_build_where_the_sandbox_cannot_isolate(monkeypatch):
    from rlserve.environment import python_tool

    monkeypatch.setattr(python_tool, "sandbox_available", lambda: "no user namespaces")
    tools = {"python": {"tool": "python"}}
    with pytest.raises(ConfigError) as error:
        validate_config(EnvironmentServiceConfig, {"tools": tools})
    assert "tools.python.kwargs" in error.value.paths
    assert "no user namespaces" in str(error.value) and "allow_without_isolation" in str(
        error.value
    )
    tools["python"]["kwargs"] = {"allow_without_isolation": True}
    validate_config(EnvironmentServiceConfig, {"tools": tools})  # said so: it builds
