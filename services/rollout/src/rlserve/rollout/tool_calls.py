"""Tool calls in what the model wrote, one parser per format.

A parser reads the text of one model turn (decoded only to be read: the trajectory keeps
the generated token ids, never this text re-encoded) and answers the calls in it, in
order, and `stop_strings`: where generation of a turn should stop so the tool can answer
before the model goes on (the text that closes a call).

- "hermes": `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, as Qwen,
  Hermes and SmolLM2-style chat models are taught; one or several per turn. A call whose
  JSON does not parse, or lacks a string name or an object of arguments, is answered as
  a malformed call (the environment never sees it), so the model learns from it.
- "bracket": `[tool_name: argument text]`, the embedded task's (a character model learns
  it in a few hundred warm-up steps); the text becomes the tool's one argument, named by
  the parser's `argument` (the calculator's "expression").
"""

from __future__ import annotations

import contextlib
import json
import re
from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True)
class ParsedCall:
    """One call the model wrote."""

    name: str
    """The tool's name ("" when the call is malformed)."""
    arguments_json: str
    """Its arguments, a JSON object, as the environment service reads them."""
    problem: str = ""
    """Why the call is malformed ("" when it is not): the observation the model gets."""


class ToolCallParser(Protocol):
    stop_strings: tuple[str, ...]

    def parse(self, text: str) -> list[ParsedCall]: ...


class HermesParser:
    """`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`."""

    OPEN, CLOSE = "<tool_call>", "</tool_call>"
    stop_strings = (CLOSE,)
    _CALL = re.compile(re.escape(OPEN) + r"(.*?)" + re.escape(CLOSE), re.DOTALL)

    def parse(self, text: str) -> list[ParsedCall]:
        return [self._call(body) for body in self._CALL.findall(text)]

    def _call(self, body: str) -> ParsedCall:
        try:
            call = json.loads(body)
        except json.JSONDecodeError as error:
            return ParsedCall("", "{}", f"the tool call is not JSON ({error.msg})")
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            return ParsedCall("", "{}", 'a tool call needs a string "name"')
        arguments = call.get("arguments", {})
        if isinstance(arguments, str):  # some models write the arguments as a JSON string
            with contextlib.suppress(json.JSONDecodeError):
                arguments = json.loads(arguments)
        if not isinstance(arguments, dict):
            return ParsedCall(call["name"], "{}", '"arguments" must be a JSON object')
        return ParsedCall(call["name"], json.dumps(arguments))


class BracketParser:
    """`[tool_name: argument text]`, the argument text passed as `argument`."""

    stop_strings = ("]",)
    _CALL = re.compile(r"\[([A-Za-z_][A-Za-z0-9_]*):\s?([^\]\[]*)\]")

    def __init__(self, argument: str = "expression"):
        self.argument = argument

    def parse(self, text: str) -> list[ParsedCall]:
        return [
            ParsedCall(name, json.dumps({self.argument: argument}))
            for name, argument in self._CALL.findall(text)
        ]


PARSERS = {"hermes": HermesParser, "bracket": BracketParser}
"""Parsers by the name of their format."""
