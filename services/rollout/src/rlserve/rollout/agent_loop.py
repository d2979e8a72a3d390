"""The multi-turn agent loop: samples that generate, call tools and go on, token in,
token out.

`run_agent_loop` drives every sample of a request through its turns: the model writes a
turn (generation stops at EOS or where a tool call closes), the parser finds its calls,
the tools answer, the answers go into the trajectory as the chat template renders them
(rlserve.rollout.trajectory), and the sample writes its next turn. It knows neither the
engine nor the transport: `generate` continues a batch of token sequences by one turn
each, `call_tool` runs one call (the environment service, over gRPC, in the rollout
service), so the loop is tested on its own.

Scheduling: one generation at a time (the engine batches), tool calls as tasks. A
generation takes every sample that is ready (its tool answers are in); a sample whose
tool is still running misses that generation and joins a later one, so one slow tool
holds up nobody else's turns.

A sample ends when its turn calls no tool (its answer), a tool says the episode is done,
its turns reach `max_turns`, its calls would pass `max_tool_calls`, its response would
pass `max_response_tokens`, or its turn was cut by the token budget. What went wrong is
an observation the model reads and a count the step reports (`AgentSample`):
malformed calls ("bad_arguments", never sent), and the environment's errors (timeout,
tool_error, unknown_tool); a call the transport could not make at all is "unavailable".
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Literal

from rlserve.core import tracing
from rlserve.rollout.tool_calls import ParsedCall, ToolCallParser
from rlserve.rollout.trajectory import ChatDeltas, Trajectory

Ending = Literal["answer", "done", "max_turns", "max_tool_calls", "max_tokens"]


@dataclass(frozen=True)
class AgentLimits:
    """How far one sample may go."""

    max_turns: int = 4
    """Model turns per sample (the last one's calls are not run)."""
    max_tool_calls: int = 8
    """Tool calls per sample; a turn that would pass it ends the sample."""
    max_tool_response_tokens: int = 256
    """Tokens of one observation's text; a longer one is cut."""
    max_response_tokens: int = 512
    """Tokens after the prompt: the model's turns and the observations together."""


@dataclass(frozen=True)
class GeneratedTurn:
    """One sample's turn, as the engine sampled it."""

    ids: list[int]
    log_probs: list[float] | None
    cut: bool
    """The turn stopped at its token budget, not at EOS or a call's end."""


@dataclass(frozen=True)
class ToolAnswer:
    """What one call answered."""

    observation: str
    step_reward: float = 0.0
    done: bool = False
    error: str = ""
    """"" or the kind of failure (see the module doc)."""


GenerateTurns = Callable[[list[list[int]], list[int]], Awaitable[list[GeneratedTurn]]]
"""(each sample's ids so far, each one's most new tokens) -> each sample's next turn."""
CallTool = Callable[[str, ParsedCall, str], Awaitable[ToolAnswer]]
"""(session id, the call, the row's tools_kwargs JSON) -> its answer."""


@dataclass
class AgentSample:
    """One sample's trajectory and what happened on the way."""

    trajectory: Trajectory
    session_id: str
    tools_kwargs_json: str = ""
    tool_calls: int = 0
    tool_reward: float = 0.0
    """The sum of the calls' step rewards."""
    errors: Counter[str] = field(default_factory=Counter)
    """Failed calls by kind."""
    tool_s: float = 0.0
    """Seconds its tool calls took, one after another."""
    ending: Ending | None = None


async def run_agent_loop(
    samples: Sequence[AgentSample],
    generate: GenerateTurns,
    call_tool: CallTool,
    parser: ToolCallParser,
    deltas: ChatDeltas,
    limits: AgentLimits,
    role: str = "tool",
) -> None:
    """Runs every sample to its end (module doc), filling in its trajectory and counts.
    `role` is the chat role observations are rendered as."""
    ready = list(samples)
    tools: dict[asyncio.Task, AgentSample] = {}
    generation: asyncio.Task | None = None
    generating: list[AgentSample] = []
    turn = 0
    try:
        while ready or tools or generation:
            if generation is None and ready:
                generating, ready = ready, []
                budgets = [
                    limits.max_response_tokens - len(s.trajectory.response_ids) for s in generating
                ]
                generation = asyncio.create_task(
                    _generate_turn(generate, generating, budgets, turn)
                )
                turn += 1
            waiting = [*tools, *([generation] if generation else [])]
            done, _ = await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                if task is generation:
                    generation = None
                    for sample, generated in zip(generating, task.result(), strict=True):
                        calls = _take_turn(sample, generated, parser, deltas, limits)
                        if calls:
                            tools[asyncio.create_task(_run_calls(sample, calls, call_tool))] = (
                                sample
                            )
                else:
                    sample = tools.pop(task)
                    if _add_observations(sample, task.result(), deltas, limits, role):
                        ready.append(sample)
    finally:
        for task in [*tools, *([generation] if generation else [])]:
            task.cancel()


async def _generate_turn(
    generate: GenerateTurns, samples: list[AgentSample], budgets: list[int], turn: int
) -> list[GeneratedTurn]:
    with tracing.span("agent.generate", turn=turn, samples=len(samples)):
        turns = await generate([s.trajectory.ids for s in samples], budgets)
    if len(turns) != len(samples):
        raise RuntimeError(f"the engine answered {len(turns)} turns for {len(samples)} samples")
    return turns


def _take_turn(
    sample: AgentSample,
    generated: GeneratedTurn,
    parser: ToolCallParser,
    deltas: ChatDeltas,
    limits: AgentLimits,
) -> list[ParsedCall]:
    """Adds the model's turn; the calls to run next, or [] when the sample ends."""
    trajectory = sample.trajectory
    trajectory.add_model_turn(generated.ids, generated.log_probs)
    if generated.cut or len(trajectory.response_ids) >= limits.max_response_tokens:
        sample.ending = "max_tokens"
        return []
    calls = parser.parse(deltas.tokenizer.decode(generated.ids))
    if not calls:
        sample.ending = "answer"
        return []
    if trajectory.turns >= limits.max_turns:
        sample.ending = "max_turns"
        return []
    if sample.tool_calls + len(calls) > limits.max_tool_calls:
        sample.ending = "max_tool_calls"
        return []
    return calls


async def _run_calls(
    sample: AgentSample, calls: list[ParsedCall], call_tool: CallTool
) -> list[ToolAnswer]:
    """The turn's calls, concurrently; their answers in call order."""

    async def one(call: ParsedCall) -> ToolAnswer:
        if call.problem:
            return ToolAnswer(f"Error: {call.problem}", error="bad_arguments")
        with tracing.span(f"agent.tool/{call.name[:64]}", session=sample.session_id) as span:
            try:
                answer = await call_tool(sample.session_id, call, sample.tools_kwargs_json)
            except Exception as error:  # the transport's, after its retries
                answer = ToolAnswer(
                    f"Error: the tool could not be reached ({type(error).__name__})",
                    error="unavailable",
                )
            if answer.error and span.is_recording():
                span.set_attribute("rlserve.tool_error", answer.error)
            return answer

    loop = asyncio.get_running_loop()
    started = loop.time()
    answers = await asyncio.gather(*(one(call) for call in calls))
    sample.tool_s += loop.time() - started
    sample.tool_calls += len(calls)
    return answers


def _add_observations(
    sample: AgentSample,
    answers: list[ToolAnswer],
    deltas: ChatDeltas,
    limits: AgentLimits,
    role: str,
) -> bool:
    """Adds the template's turn end and each answer as a message; whether the sample
    goes on to another turn."""
    trajectory = sample.trajectory
    for answer in answers:
        sample.tool_reward += answer.step_reward
        if answer.error:
            sample.errors[answer.error] += 1
    # the turn ends as the template ends it, whatever comes next: the ids stay a
    # conversation the template could have rendered
    trajectory.add_context(deltas.turn_end(trajectory.response_ids))
    if any(answer.done for answer in answers):
        trajectory.cut_to(limits.max_response_tokens)
        sample.ending = "done"
        return False
    for answer in answers:
        trajectory.add_context(
            deltas.message_ids(role, answer.observation, limits.max_tool_response_tokens)
        )
    if len(trajectory.response_ids) >= limits.max_response_tokens:
        trajectory.cut_to(limits.max_response_tokens)
        sample.ending = "max_tokens"
        return False
    return True
