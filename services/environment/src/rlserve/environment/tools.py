"""Tools: what one tool call runs, the built-in calculator, and user tools by import path.

A tool is any object with a `schema()` (its OpenAI-style function schema) and an async
`__call__(call: ToolCall) -> ToolOutcome`. It is built once per replica from its
config's `kwargs`; what it keeps between the calls of one session lives in
`call.state`, a dict the service keeps per session and tool (so one tool object serves
every session, and a tool that keeps nothing ignores it). `call.row_kwargs` are the
dataset row's arguments for this tool (a ground truth to check against, a task id).

A tool's failure (an exception) is the service's to turn into an observation; a tool
returns observations for what it can explain itself ("division by zero").

The calculator evaluates arithmetic by walking Python's AST (numbers, + - * / // % **,
unary signs, parentheses) with bounds on the text, the exponent and the size of every
intermediate integer, so no expression can run long or allocate much: it never calls
eval.
"""

from __future__ import annotations

import ast
import math
import operator
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from rlserve.core.config import ConfigError, import_object


@dataclass
class ToolCall:
    """One call of a tool in a session."""

    session_id: str
    arguments: dict[str, Any]
    """The call's arguments, as the model wrote them (a JSON object)."""
    row_kwargs: Mapping[str, Any]
    """The dataset row's arguments for this tool in this session ({} = none)."""
    state: dict[str, Any] = field(default_factory=dict)
    """The tool's state in this session, empty at the session's first call."""


@dataclass(frozen=True)
class ToolOutcome:
    """What a tool call answers."""

    observation: str
    """What the model sees next."""
    step_reward: float = 0.0
    """Reward of this call."""
    done: bool = False
    """The call ended the episode."""
    metrics: Mapping[str, float] = field(default_factory=dict)
    """Figures of the call, summed per step by the rollout (e.g. sandbox_s)."""


class Tool(Protocol):
    def schema(self) -> dict[str, Any]:
        """{"type": "function", "function": {"name", "description", "parameters"}}."""
        ...

    async def __call__(self, call: ToolCall) -> ToolOutcome: ...


def function_schema(name: str, description: str, parameters: dict[str, Any]) -> dict[str, Any]:
    """An OpenAI-style function schema."""
    return {
        "type": "function",
        "function": {"name": name, "description": description, "parameters": parameters},
    }


def string_argument(arguments: Mapping[str, Any], name: str, max_chars: int) -> str:
    """`arguments[name]` as a string of at most `max_chars`; ValueError naming the
    argument otherwise (the service turns it into a bad_arguments observation)."""
    value = arguments.get(name)
    if not isinstance(value, str):
        raise ValueError(f"argument {name!r} must be a string")
    if len(value) > max_chars:
        raise ValueError(f"argument {name!r} is over {max_chars} characters")
    return value


# ---- the calculator -------------------------------------------------------------------

_BINARY: dict[type, Callable[[Any, Any], Any]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNARY: dict[type, Callable[[Any], Any]] = {ast.USub: operator.neg, ast.UAdd: operator.pos}


class CalculatorError(ValueError):
    """An expression the calculator refuses; the message is the observation."""


class Calculator:
    """Evaluates one arithmetic expression: {"expression": "12*7+3"} -> "87"."""

    def __init__(
        self, max_expression_chars: int = 256, max_exponent: int = 64, max_integer_digits: int = 100
    ):
        self.max_expression_chars = max_expression_chars
        self.max_exponent = max_exponent
        self.max_integer_digits = max_integer_digits

    def schema(self) -> dict[str, Any]:
        return function_schema(
            "calculator",
            "Evaluate an arithmetic expression of numbers, + - * / // % ** and parentheses.",
            {
                "type": "object",
                "properties": {"expression": {"type": "string", "description": "e.g. 12*7+3"}},
                "required": ["expression"],
            },
        )

    async def __call__(self, call: ToolCall) -> ToolOutcome:
        expression = string_argument(call.arguments, "expression", self.max_expression_chars)
        try:
            return ToolOutcome(format_number(self.evaluate(expression)))
        except CalculatorError as error:
            return ToolOutcome(f"Error: {error}")

    def evaluate(self, expression: str) -> int | float:
        """The value of `expression`; CalculatorError saying what it refuses."""
        try:
            tree = ast.parse(expression.strip(), mode="eval")
        except SyntaxError:
            raise CalculatorError(f"not an arithmetic expression: {expression!r}") from None
        return self._value(tree.body)

    def _value(self, node: ast.AST) -> int | float:
        if isinstance(node, ast.Constant) and type(node.value) in (int, float):
            return self._bounded(node.value)
        if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
            return self._bounded(_UNARY[type(node.op)](self._value(node.operand)))
        if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
            left, right = self._value(node.left), self._value(node.right)
            if isinstance(node.op, ast.Pow) and abs(right) > self.max_exponent:
                raise CalculatorError(f"exponent {right} is over {self.max_exponent}")
            try:
                return self._bounded(_BINARY[type(node.op)](left, right))
            except ZeroDivisionError:
                raise CalculatorError("division by zero") from None
            except OverflowError:
                raise CalculatorError("the result is too large") from None
        raise CalculatorError(f"unsupported element {type(node).__name__}")

    def _bounded(self, value: Any) -> int | float:
        if isinstance(value, complex):
            raise CalculatorError("the result is not a real number")
        if isinstance(value, int) and abs(value) >= 10**self.max_integer_digits:
            raise CalculatorError(f"the result has over {self.max_integer_digits} digits")
        if isinstance(value, float) and not math.isfinite(value):
            raise CalculatorError("the result is not finite")
        return value


def format_number(value: int | float) -> str:
    """An integer as itself; a float with an integral value as an integer ("6.0" ->
    "6"), else Python's shortest repr."""
    if isinstance(value, float) and value.is_integer() and abs(value) < 2**53:
        return str(int(value))
    return str(value)


# ---- user tools -----------------------------------------------------------------------


def user_tool(import_path: str, kwargs: Mapping[str, Any]) -> Tool:
    """The tool class at `import_path` ("package.module:Class"), built with `kwargs`.

    Raises:
        ConfigError: the path does not import, the class cannot be built with `kwargs`,
            or what it builds has no schema() or is not callable.
    """
    tool_class = import_object(import_path, "class")
    try:
        tool = tool_class(**kwargs)
    except TypeError as error:
        raise ConfigError("kwargs", f"{import_path} cannot be built with them: {error}") from None
    if not callable(tool) or not callable(getattr(tool, "schema", None)):
        raise ConfigError(
            "", f"{import_path} builds no tool: it needs schema() and async __call__(call)"
        )
    return tool
