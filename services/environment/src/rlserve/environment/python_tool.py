"""The built-in "python" tool: the model's code run in the sandbox
(rlserve.environment.sandbox; its threat model is docs/sandbox.md).

{"code": "print(6 * 7)"} -> what the code printed; when it failed, its exit status and
stderr follow, and a run a limit ended says which. The tool is built with the sandbox's
limits (`limits`, SandboxLimits' fields) and refuses to build where the sandbox cannot
isolate code, unless `allow_without_isolation` says to run it anyway (then the code sees
the host's files and network: only for code you would run yourself).
"""

from __future__ import annotations

from typing import Any

from rlserve.environment.sandbox import SandboxLimits, run_python, sandbox_available
from rlserve.environment.tools import ToolCall, ToolOutcome, function_schema, string_argument


class PythonTool:
    """Runs one Python program per call in the sandbox."""

    def __init__(
        self,
        limits: dict[str, Any] | None = None,
        allow_without_isolation: bool = False,
        max_code_chars: int = 16_384,
    ):
        self.limits = SandboxLimits(**(limits or {}))
        self.allow_without_isolation = allow_without_isolation
        self.max_code_chars = max_code_chars
        reason = sandbox_available()
        if reason is not None and not allow_without_isolation:
            raise ValueError(
                f"the sandbox cannot isolate code here ({reason}); run the service where it "
                "can (Linux, root or user namespaces), or set allow_without_isolation: true "
                "for code you trust"
            )

    def schema(self) -> dict[str, Any]:
        return function_schema(
            "python",
            "Run a Python program (standard library only, no network, no files outside "
            "its working directory) and read what it prints.",
            {
                "type": "object",
                "properties": {"code": {"type": "string", "description": "the program"}},
                "required": ["code"],
            },
        )

    async def __call__(self, call: ToolCall) -> ToolOutcome:
        code = string_argument(call.arguments, "code", self.max_code_chars)
        result = await run_python(
            code, self.limits, allow_without_isolation=self.allow_without_isolation
        )
        observation = result.stdout
        if result.exit_code != 0 or result.killed_by:
            ending = f"stopped by {result.killed_by}" if result.killed_by else "failed"
            observation += f"\n[{ending}, exit status {result.exit_code}]\n{result.stderr}"
        if result.truncated:
            observation += "\n[output cut at the sandbox's output_bytes]"
        return ToolOutcome(observation, metrics={"sandbox_s": result.wall_s})
