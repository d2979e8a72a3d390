"""GenerateSequences with tools: the agent loop on this service's workers and the
environment service, and its answer as a batch.

The controller runs it under its lock (the weights stay the same for every turn of
every sample). Generation goes to the worker group (`generate_turns`, the samples split
across ranks); tool calls go to the environment service named in the request, by gRPC
through Serve's proxy (or the app's replica directly, as ServiceClient chooses), with
the caller's token and the call's own timeout. Each sample is its own session,
`<request id>-<row>`.

The batch is GenerateSequences' with a multi-turn response: `responses` hold the model's
turns and the observations between them, `response_mask` is 1 on the model's tokens
only, `attention_mask` on every response token; `response_text` is the last model
turn's text (the answer a reward reads), and per row `turns`, `tool_calls`,
`tool_errors`, `tool_rewards` and `ending`.
"""

from __future__ import annotations

import dataclasses
import json
import re
import uuid
from collections import Counter
from typing import Any

import grpc
import torch

from rlserve.core import api
from rlserve.core.batch import Batch
from rlserve.core.rpc import ServiceClient, open_channel
from rlserve.core.serving import Deadline, invalid_argument
from rlserve.rollout.agent_loop import (
    AgentLimits,
    AgentSample,
    GeneratedTurn,
    ToolAnswer,
    run_agent_loop,
)
from rlserve.rollout.generation import SamplingSettings
from rlserve.rollout.methods import GENERATE_TURNS
from rlserve.rollout.tool_calls import PARSERS, BracketParser, ParsedCall
from rlserve.rollout.trajectory import ChatDeltas, TemplateError, Trajectory
from rlserve.v1 import environment_pb2, environment_pb2_grpc

TOOLS_KWARGS_COLUMN = "tools_kwargs"
APP_NAME = re.compile(r"[A-Za-z0-9._-]{1,64}")
MAX_ENVIRONMENT_APPS = 8
"""Environment apps one replica keeps a client (a gRPC channel) for: requests name the
app, so a bound keeps callers from making it open channels without end."""


def serve_proxy_address() -> str:
    """host:port of Serve's gRPC proxy on this cluster (its first proxy's node)."""
    from rlserve.core.placement import serve_details

    details = serve_details()
    port = (details.get("grpc_options") or {}).get("port")
    proxies = list((details.get("proxies") or {}).values())
    if not port or not proxies:
        raise RuntimeError("Serve runs no gRPC proxy on this cluster to reach tools through")
    return f"{proxies[0]['node_ip']}:{port}"


class AgentRollout:
    """Multi-turn generation for one rollout replica (module doc)."""

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        self._deltas: ChatDeltas | None = None
        self._clients: dict[str, ServiceClient] = {}

    def check(self, agent: api.Agent) -> None:
        """INVALID_ARGUMENT naming the field of a request this service cannot run."""
        if agent.tool_call_format not in PARSERS:
            raise invalid_argument(
                "agent.tool_call_format",
                f"one of {sorted(PARSERS)}, got {agent.tool_call_format!r}",
            )
        bounds = {
            "max_turns": (agent.max_turns, 1),
            "max_tool_calls": (agent.max_tool_calls, 0),
            "max_tool_response_tokens": (agent.max_tool_response_tokens, 1),
        }
        for name, (value, least) in bounds.items():
            if value < least:
                raise invalid_argument(f"agent.{name}", f"must be >= {least}, got {value}")
        if not agent.tool_timeout_s > 0:
            raise invalid_argument(
                "agent.tool_timeout_s", f"must be > 0, got {agent.tool_timeout_s}"
            )
        if not APP_NAME.fullmatch(agent.environment_app):
            raise invalid_argument(
                "agent.environment_app",
                "must be a Serve application name ([A-Za-z0-9._-], 1 to 64)",
            )
        if (
            agent.environment_app not in self._clients
            and len(self._clients) >= MAX_ENVIRONMENT_APPS
        ):
            raise invalid_argument(
                "agent.environment_app",
                f"this replica already calls {MAX_ENVIRONMENT_APPS} environment apps "
                f"({', '.join(sorted(self._clients))}); use one of them",
            )
        try:
            self.deltas()
        except TemplateError as error:
            raise invalid_argument("agent", str(error)) from None

    def deltas(self) -> ChatDeltas:
        if self._deltas is None:
            self._deltas = ChatDeltas(self.tokenizer)
        return self._deltas

    async def run(
        self,
        group: Any,
        prompts: Batch,
        sampling: SamplingSettings,
        agent: api.Agent,
        deadline: Deadline,
    ) -> tuple[Batch, dict[str, float]]:
        """The multi-turn responses to `prompts` (n per prompt) and the figures."""
        parser = PARSERS[agent.tool_call_format]()
        if isinstance(parser, BracketParser):
            parser = BracketParser(agent.bracket_argument)
        sampling = dataclasses.replace(sampling, stop_strings=parser.stop_strings)
        n = sampling.responses_per_prompt
        request_id = uuid.uuid4().hex[:12]
        kwargs_column = prompts.non_tensors.get(TOOLS_KWARGS_COLUMN)
        samples = []
        for row, (ids, mask) in enumerate(
            zip(prompts["input_ids"], prompts["attention_mask"], strict=True)
        ):
            prompt_ids = ids[mask.bool()].tolist()
            row_kwargs = "" if kwargs_column is None else _kwargs_json(kwargs_column[row], row)
            for k in range(n):
                samples.append(
                    AgentSample(Trajectory(prompt_ids), f"{request_id}-{row}-{k}", row_kwargs)
                )
        client = self._client(agent.environment_app)

        async def generate(sequences: list[list[int]], budgets: list[int]) -> list[GeneratedTurn]:
            pairs = list(zip(sequences, budgets, strict=True))
            shares = [pairs[rank :: len(group)] for rank in range(len(group))]
            answers = await group.run_each(
                GENERATE_TURNS, shares, sampling=sampling, deadline=deadline.unix_s
            )
            turns: list[GeneratedTurn | None] = [None] * len(pairs)
            for rank, answered in enumerate(answers):
                for index, (ids, log_probs, cut) in zip(
                    range(rank, len(pairs), len(group)), answered, strict=True
                ):
                    turns[index] = GeneratedTurn(ids, log_probs, cut)
            return turns

        async def call_tool(session_id: str, call: ParsedCall, kwargs_json: str) -> ToolAnswer:
            request = environment_pb2.CallToolRequest(
                session_id=session_id,
                tool_name=call.name,
                arguments_json=call.arguments_json,
                tools_kwargs_json=kwargs_json,
            )
            try:
                answer = await client.call("CallTool", request, timeout_s=agent.tool_timeout_s)
            except grpc.aio.AioRpcError as error:
                if error.code() != grpc.StatusCode.DEADLINE_EXCEEDED:
                    raise
                return ToolAnswer(
                    f"Error: {call.name} did not answer within {agent.tool_timeout_s:g} s",
                    error="timeout",
                )
            return ToolAnswer(answer.observation, answer.step_reward, answer.done, answer.error)

        limits = AgentLimits(
            max_turns=agent.max_turns,
            max_tool_calls=agent.max_tool_calls,
            max_tool_response_tokens=agent.max_tool_response_tokens,
            max_response_tokens=sampling.max_new_tokens,
        )
        await run_agent_loop(
            samples, generate, call_tool, parser, self.deltas(), limits, agent.observation_role
        )
        return self._batch(prompts, samples, sampling), _metrics(samples)

    def _client(self, app: str) -> ServiceClient:
        if app not in self._clients:
            channel = open_channel(serve_proxy_address())
            self._clients[app] = ServiceClient(
                channel, environment_pb2_grpc.EnvironmentServiceStub, app, timeout_s=60.0
            )
        return self._clients[app]

    def _batch(
        self, prompts: Batch, samples: list[AgentSample], sampling: SamplingSettings
    ) -> Batch:
        n, width = sampling.responses_per_prompt, sampling.max_new_tokens
        rows = len(samples)
        pad = self.tokenizer.pad_token_id
        responses = torch.full((rows, width), pad, dtype=torch.long)
        response_mask = torch.zeros((rows, width), dtype=torch.long)
        attended = torch.zeros((rows, width), dtype=torch.long)
        log_probs = torch.zeros((rows, width), dtype=torch.float32)
        for i, sample in enumerate(samples):
            trajectory = sample.trajectory
            length = len(trajectory.response_ids)
            responses[i, :length] = torch.tensor(trajectory.response_ids, dtype=torch.long)
            response_mask[i, :length] = torch.tensor(trajectory.response_mask, dtype=torch.long)
            attended[i, :length] = 1
            log_probs[i, :length] = torch.tensor(trajectory.log_probs, dtype=torch.float32)
        repeated = prompts.index(torch.arange(len(prompts)).repeat_interleave(n))
        tensors = {
            "prompts": repeated["input_ids"].long(),
            "responses": responses,
            "response_mask": response_mask,
            "input_ids": torch.cat([repeated["input_ids"].long(), responses], dim=1),
            "attention_mask": torch.cat([repeated["attention_mask"].long(), attended], dim=1),
            "turns": torch.tensor([s.trajectory.turns for s in samples], dtype=torch.long),
            "tool_calls": torch.tensor([s.tool_calls for s in samples], dtype=torch.long),
            "tool_errors": torch.tensor(
                [sum(s.errors.values()) for s in samples], dtype=torch.long
            ),
            "tool_rewards": torch.tensor([s.tool_reward for s in samples], dtype=torch.float32),
        }
        if sampling.return_log_probs:
            tensors["rollout_log_probs"] = log_probs
        non_tensors = {
            **repeated.non_tensors,
            "response_text": [self._last_turn_text(s.trajectory) for s in samples],
            "ending": [s.ending or "" for s in samples],
        }
        return Batch(tensors=tensors, non_tensors=non_tensors)

    def _last_turn_text(self, trajectory: Trajectory) -> str:
        mask, ids = trajectory.response_mask, trajectory.response_ids
        end = max((i + 1 for i, m in enumerate(mask) if m), default=0)
        start = end
        while start > 0 and mask[start - 1]:
            start -= 1
        return self.tokenizer.decode(ids[start:end], skip_special_tokens=True)


def _kwargs_json(value: Any, row: int) -> str:
    """A row's tools_kwargs as the JSON the environment reads (a JSON object, or "")."""
    if value is None or value == "":
        return ""
    try:
        parsed = json.loads(value) if isinstance(value, str) else None
    except json.JSONDecodeError:
        parsed = None
    if not isinstance(parsed, dict):
        raise invalid_argument(
            f"prompts.non_tensors['{TOOLS_KWARGS_COLUMN}'][{row}]",
            "must be a JSON object by tool name (as text), or empty",
        )
    return value


def _metrics(samples: list[AgentSample]) -> dict[str, float]:
    """The request's agent figures: means per sample, sums, and counts by kind."""
    count = max(len(samples), 1)
    errors: Counter[str] = Counter()
    endings: Counter[str] = Counter()
    for sample in samples:
        errors.update(sample.errors)
        endings[sample.ending or "none"] += 1
    metrics = {
        "agent/samples": float(len(samples)),
        "agent/turns_mean": sum(s.trajectory.turns for s in samples) / count,
        "agent/tool_calls": float(sum(s.tool_calls for s in samples)),
        "agent/tool_errors": float(sum(errors.values())),
        "agent/tool_s": sum(s.tool_s for s in samples),
    }
    metrics.update({f"agent/errors_{kind}": float(n) for kind, n in errors.items()})
    metrics.update({f"agent/ending_{kind}": float(n) for kind, n in endings.items()})
    return metrics
