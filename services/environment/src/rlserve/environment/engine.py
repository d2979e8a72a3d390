"""The environment service's work, testable without Ray or gRPC: one tool call of a
session, with its checks, its time limit and its failure rules; and the sessions' state.

What is whose fault:
- a malformed request (session id, oversized or non-object tools_kwargs_json: the
  trainer's data, not the model's words) is INVALID_ARGUMENT naming the field;
- whatever the model wrote (arguments that are not a JSON object, an unknown tool) and
  whatever the tool did (an exception, a call past its `timeout_s`) is an answer: an
  observation saying what went wrong, with `error` naming the kind ("bad_arguments",
  "unknown_tool", "tool_error", "timeout"), so the rollout shows it to the model and
  counts it, and the service keeps serving.

Sessions: each (session, tool) pair has a state dict, created at the pair's first call
with the row's kwargs for that tool, kept `session_ttl_s` after the session's last call
and at most `max_sessions` sessions per replica (least recently used evicted first). A
session is a replica's only state, and it is rebuilt, empty, where it is missing (a new
replica, an evicted or expired session): the built-in tools keep none.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from rlserve.core.serving import invalid_argument
from rlserve.environment.config import EnvironmentServiceConfig, build_tool
from rlserve.environment.tools import Tool, ToolCall, ToolOutcome

logger = logging.getLogger(__name__)

SESSION_ID = re.compile(r"[A-Za-z0-9._:-]{1,128}")
ERROR_KINDS = ("bad_arguments", "unknown_tool", "tool_error", "timeout")


@dataclass(frozen=True)
class CallAnswer:
    """What CallTool answers."""

    observation: str
    step_reward: float = 0.0
    done: bool = False
    error: str = ""
    """"" or one of ERROR_KINDS."""
    metrics: dict[str, float] = field(default_factory=dict)


@dataclass
class _Session:
    row_kwargs: dict[str, Any]
    states: dict[str, dict[str, Any]] = field(default_factory=dict)
    last_used_s: float = 0.0


class Sessions:
    """The sessions' state on one replica: LRU with a time-to-live."""

    def __init__(self, ttl_s: float, max_sessions: int):
        self.ttl_s = ttl_s
        self.max_sessions = max_sessions
        self._sessions: OrderedDict[str, _Session] = OrderedDict()
        self.evicted = 0
        """Sessions dropped to stay within max_sessions (not counting expiries)."""

    def __len__(self) -> int:
        return len(self._sessions)

    def get(self, session_id: str, row_kwargs: dict[str, Any]) -> _Session:
        """The session, created with `row_kwargs` when missing or expired."""
        now = time.monotonic()
        self._expire(now)
        session = self._sessions.get(session_id)
        if session is None:
            session = _Session(row_kwargs)
            self._sessions[session_id] = session
            while len(self._sessions) > self.max_sessions:
                self._sessions.popitem(last=False)
                self.evicted += 1
        self._sessions.move_to_end(session_id)
        session.last_used_s = now
        return session

    def close(self, session_id: str) -> bool:
        return self._sessions.pop(session_id, None) is not None

    def _expire(self, now: float) -> None:
        while self._sessions:
            oldest = next(iter(self._sessions.values()))
            if now - oldest.last_used_s <= self.ttl_s:
                return
            self._sessions.popitem(last=False)


class EnvironmentEngine:
    """The tools of one replica and the state of its sessions."""

    def __init__(self, config: EnvironmentServiceConfig):
        self.config = config
        self.tools: dict[str, Tool] = {
            name: build_tool(tool) for name, tool in config.tools.items()
        }
        self.sessions = Sessions(config.session_ttl_s, config.max_sessions)

    def schemas(self) -> dict[str, dict[str, Any]]:
        """Each tool's function schema, under the name the model calls it by."""
        schemas = {}
        for name, tool in self.tools.items():
            schema = tool.schema()
            schema = {**schema, "function": {**schema.get("function", {}), "name": name}}
            schemas[name] = schema
        return schemas

    async def call_tool(
        self, session_id: str, tool_name: str, arguments_json: str, tools_kwargs_json: str
    ) -> CallAnswer:
        """One tool call (module doc for what raises and what answers)."""
        self._check_session_id(session_id)
        row_kwargs = self._row_kwargs(tools_kwargs_json)
        if len(arguments_json) > self.config.max_arguments_chars:
            raise invalid_argument(
                "arguments_json", f"over max_arguments_chars ({self.config.max_arguments_chars})"
            )
        tool = self.tools.get(tool_name)
        if tool is None:
            known = ", ".join(sorted(self.tools))
            return CallAnswer(
                f"Error: no tool {tool_name[:64]!r}; tools: {known}", error="unknown_tool"
            )
        try:
            arguments = json.loads(arguments_json or "{}")
        except json.JSONDecodeError as error:
            return CallAnswer(f"Error: arguments are not JSON ({error.msg})", error="bad_arguments")
        if not isinstance(arguments, dict):
            return CallAnswer("Error: arguments must be a JSON object", error="bad_arguments")
        session = self.sessions.get(session_id, row_kwargs)
        call = ToolCall(
            session_id,
            arguments,
            session.row_kwargs.get(tool_name) or {},
            session.states.setdefault(tool_name, {}),
        )
        timeout_s = self.config.tools[tool_name].timeout_s
        started = time.perf_counter()
        try:
            outcome = await asyncio.wait_for(tool(call), timeout_s)
            if not isinstance(outcome, ToolOutcome):
                raise TypeError(f"answered {type(outcome).__name__}, not a ToolOutcome")
            answer = CallAnswer(
                self._clipped(str(outcome.observation)),
                float(outcome.step_reward),
                bool(outcome.done),
                metrics={key: float(value) for key, value in outcome.metrics.items()},
            )
        except TimeoutError:
            return CallAnswer(
                f"Error: {tool_name} did not answer within {timeout_s:g} s",
                error="timeout",
                metrics={"tool_s": time.perf_counter() - started},
            )
        except ValueError as error:  # the tools' way of refusing arguments
            return CallAnswer(f"Error: {error}", error="bad_arguments")
        except Exception as error:
            logger.warning("tool %s failed: %s: %s", tool_name, type(error).__name__, error)
            return CallAnswer(
                f"Error: {tool_name} failed ({type(error).__name__}: {error})"[:1000],
                error="tool_error",
                metrics={"tool_s": time.perf_counter() - started},
            )
        answer.metrics["tool_s"] = time.perf_counter() - started
        return answer

    def close(self, session_id: str) -> bool:
        self._check_session_id(session_id)
        return self.sessions.close(session_id)

    def _check_session_id(self, session_id: str) -> None:
        if not SESSION_ID.fullmatch(session_id):
            raise invalid_argument(
                "session_id", "must be 1 to 128 characters of letters, digits and ._:-"
            )

    def _row_kwargs(self, tools_kwargs_json: str) -> dict[str, Any]:
        if len(tools_kwargs_json) > self.config.max_arguments_chars:
            raise invalid_argument(
                "tools_kwargs_json", f"over max_arguments_chars ({self.config.max_arguments_chars})"
            )
        if not tools_kwargs_json:
            return {}
        try:
            parsed = json.loads(tools_kwargs_json)
        except json.JSONDecodeError as error:
            raise invalid_argument("tools_kwargs_json", f"not JSON: {error.msg}") from None
        if not isinstance(parsed, dict) or not all(isinstance(v, dict) for v in parsed.values()):
            raise invalid_argument(
                "tools_kwargs_json",
                'must be a JSON object of objects by tool name, e.g. {"checker": {}}',
            )
        return parsed

    def _clipped(self, observation: str) -> str:
        limit = self.config.max_observation_chars
        if len(observation) <= limit:
            return observation
        return observation[:limit] + f"\n[observation cut at {limit} characters]"
