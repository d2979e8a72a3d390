"""Faulty user tools, and a reward rule, for the multi-turn fault tests, loaded by import
path ("integration_tests.agent_tools:Hang") as a user's own would be: the session's Ray
cluster puts the repository root on its processes' PYTHONPATH (conftest.serve_cluster)."""

import asyncio

from rlserve.environment.tools import ToolCall, ToolOutcome, function_schema

_SCHEMA = {"type": "object", "properties": {"expression": {"type": "string"}}}


class Hang:
    """Never answers (a tool whose backend stalls)."""

    def schema(self):
        return function_schema("hang", "Stalls.", _SCHEMA)

    async def __call__(self, call: ToolCall) -> ToolOutcome:
        await asyncio.sleep(3600)
        return ToolOutcome("late")


class Broken:
    """Raises on every call (a tool whose backend is down)."""

    def schema(self):
        return function_schema("broken", "Fails.", _SCHEMA)

    async def __call__(self, call: ToolCall) -> ToolOutcome:
        raise RuntimeError("the backend is down")


def score_every_response_1(response_text: str, ground_truth: str, **extra) -> float:
    """A reward rule under which only rollout.agent.on_tool_error "zero_reward" can make
    a score 0."""
    return 1.0
