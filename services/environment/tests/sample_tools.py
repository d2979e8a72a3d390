"""User tools for the environment tests, loaded by import path ("sample_tools:Class")
as a user's own would be (conftest.py puts this directory on sys.path)."""

import asyncio

from rlserve.environment.tools import ToolCall, ToolOutcome, function_schema


class Counter:
    """Counts its calls per session, from the row's `start`; done at `stop`; rewards 1
    per call when `rewarding`."""

    def __init__(self, stop: int = 3, rewarding: bool = False):
        self.stop, self.rewarding = stop, rewarding

    def schema(self):
        return function_schema("counter", "Counts calls.", {"type": "object", "properties": {}})

    async def __call__(self, call: ToolCall) -> ToolOutcome:
        count = call.state.get("count", call.row_kwargs.get("start", 0)) + 1
        call.state["count"] = count
        return ToolOutcome(str(count), float(self.rewarding), count >= self.stop, {"counted": 1.0})


class Sleeper:
    """Sleeps `seconds` (an argument) before answering."""

    def schema(self):
        return function_schema("sleeper", "Sleeps.", {"type": "object", "properties": {}})

    async def __call__(self, call: ToolCall) -> ToolOutcome:
        await asyncio.sleep(float(call.arguments.get("seconds", 0)))
        return ToolOutcome("awake")


class Raiser:
    """Raises what its argument says: a ValueError (refused arguments) or a RuntimeError."""

    def schema(self):
        return function_schema("raiser", "Raises.", {"type": "object", "properties": {}})

    async def __call__(self, call: ToolCall) -> ToolOutcome:
        if call.arguments.get("kind") == "value":
            raise ValueError("argument 'kind' is refused")
        raise RuntimeError("the backend is down")


class Confused:
    """Answers something that is no ToolOutcome."""

    def schema(self):
        return function_schema("confused", "Wrong answers.", {"type": "object", "properties": {}})

    async def __call__(self, call: ToolCall):
        return "not an outcome"


class Verbose:
    """Answers `chars` characters."""

    def schema(self):
        return function_schema("verbose", "Talks.", {"type": "object", "properties": {}})

    async def __call__(self, call: ToolCall) -> ToolOutcome:
        return ToolOutcome("x" * int(call.arguments["chars"]))
