"""Environment service under load: 64 concurrent clients for 60 s, per tool.

    .venv/bin/python -m benchmarks.bench_environment_load                  # the issue's setting
    .venv/bin/python -m benchmarks.bench_environment_load --clients 8 --seconds 5 --tools calculator

Set-up, all on this machine and torn down at the end: a private local Ray cluster with
Serve (token auth on, as `rlserve train` runs it) and the environment app
(`rlserve.environment.app:build_app`, --replicas replicas, the service's default
max_ongoing_requests) with the calculator and the sandboxed Python executor.

Per tool: each of --clients clients (its own gRPC channel to Serve's proxy,
`ServiceClient` without retries, the cluster's token) sends CallTool calls back to back
for --seconds, each in its own session of the client, and checks every observation
against the one it must be (the calculator: a product of the call's numbers; Python: the
printed sum). A call that fails, times out, answers an error or a wrong observation
counts as an error (the run goes on). Latency is per call, as the client sees it.
Replica memory is the replicas' resident set, measured from outside
(rlserve.core.resources) after a warm-up second and again after the load: a service
whose sessions or sandboxes leaked would grow.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path

import grpc

from benchmarks.bench_reward_load import latency_ms

APP = "environment"
_MIB = 1 << 20


@dataclass
class LoadRow:
    tool: str
    clients: int
    seconds: float
    calls: int
    errors: int
    error_kinds: dict[str, int]
    calls_per_s: float
    p50_ms: float
    p99_ms: float
    max_ms: float
    replica_mib_start: float
    replica_mib_end: float


def _call(tool: str, client: int, call: int) -> tuple[str, str]:
    """(arguments_json, the observation it must answer) of one call."""
    a, b = client + 2, call % 97 + 3
    if tool == "python":
        return json.dumps({"code": f"print({a} + {b})"}), f"{a + b}\n"
    return json.dumps({"expression": f"{a}*{b}"}), str(a * b)


def _replica_mib() -> float:
    from rlserve.core.resources import service_memory

    return sum(p.resident_bytes for p in service_memory() if p.app == APP) / _MIB


async def _load(
    address: str, tool: str, clients: int, seconds: float, timeout_s: float
) -> tuple[list[float], Counter, float]:
    """(latencies of the calls answered right, errors by kind, window seconds)."""
    from rlserve.core.rpc import RetryPolicy, ServiceClient, open_channel
    from rlserve.v1 import environment_pb2, environment_pb2_grpc

    latencies: list[float] = []
    errors: Counter = Counter()
    channels = [open_channel(address) for _ in range(clients)]
    started = time.monotonic()
    ends = started + seconds

    async def client(index: int) -> None:
        # No retries: a failure must show as an error, not as a slower call.
        service = ServiceClient(
            channels[index],
            environment_pb2_grpc.EnvironmentServiceStub,
            APP,
            timeout_s,
            RetryPolicy(retries=0),
            direct=False,  # through Serve's proxy, as callers off the cluster come in
        )
        call = 0
        while time.monotonic() < ends:
            arguments, expected = _call(tool, index, call)
            request = environment_pb2.CallToolRequest(
                session_id=f"client-{index}-{call}", tool_name=tool, arguments_json=arguments
            )
            call += 1
            sent = time.monotonic()
            try:
                answer = await service.call("CallTool", request)
            except grpc.aio.AioRpcError as error:
                errors[error.code().name] += 1
                continue
            if answer.error or answer.observation != expected:
                errors[answer.error or "wrong observation"] += 1
                continue
            latencies.append(time.monotonic() - sent)

    try:
        await asyncio.gather(*(client(index) for index in range(clients)))
    finally:
        for channel in channels:
            await channel.close()
    return latencies, errors, time.monotonic() - started


def measure(address: str, tool: str, args: argparse.Namespace) -> LoadRow:
    asyncio.run(_load(address, tool, 1, 1.0, args.call_timeout_s))  # warm-up
    memory_start = _replica_mib()
    latencies, errors, window_s = asyncio.run(
        _load(address, tool, args.clients, args.seconds, args.call_timeout_s)
    )
    memory_end = _replica_mib()
    p50_ms, p99_ms, max_ms = latency_ms(latencies)
    return LoadRow(
        tool=tool,
        clients=args.clients,
        seconds=round(window_s, 1),
        calls=len(latencies) + sum(errors.values()),
        errors=sum(errors.values()),
        error_kinds=dict(errors),
        calls_per_s=len(latencies) / window_s,
        p50_ms=p50_ms,
        p99_ms=p99_ms,
        max_ms=max_ms,
        replica_mib_start=memory_start,
        replica_mib_end=memory_end,
    )


def format_table(rows: list[LoadRow]) -> str:
    lines = [
        "| tool | clients | s | calls | errors | calls/s | p50 ms | p99 ms | max ms | "
        "replica MiB start → end |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r.tool} | {r.clients} | {r.seconds:g} | {r.calls} | {r.errors} | "
            f"{r.calls_per_s:.0f} | {r.p50_ms:.1f} | {r.p99_ms:.1f} | {r.max_ms:.1f} | "
            f"{r.replica_mib_start:.0f} → {r.replica_mib_end:.0f} |"
        )
    return "\n".join(lines)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=64)
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--replicas", type=int, default=1)
    parser.add_argument("--call-timeout-s", type=float, default=30.0)
    parser.add_argument("--tools", default="calculator,python", help="comma-separated")
    parser.add_argument("--json-out", type=Path)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    import ray
    from ray import serve

    from rlserve.core import auth
    from rlserve.core.cluster import start_local_ray, start_serve_on_a_free_port
    from rlserve.trainer.deploy import deploy_applications

    if auth.expected_token() is None:
        os.environ[auth.TOKEN_ENV] = auth.generate_token()  # before Ray: replicas inherit it
    start_local_ray(num_cpus=max(4, os.cpu_count() or 1), log_to_driver=False)
    rows = []
    try:
        address = f"127.0.0.1:{start_serve_on_a_free_port()}"
        tools = {name: {"tool": name} for name in args.tools.split(",")}
        app = {
            "name": APP,
            "route_prefix": f"/{APP}",
            "import_path": "rlserve.environment.app:build_app",
            "args": {"tools": tools, "num_replicas": args.replicas},
        }
        deploy_applications([app], timeout_s=300)
        for tool in tools:
            rows.append(measure(address, tool, args))
            print(f"  {tool}: {rows[-1].calls} calls, {rows[-1].errors} errors", file=sys.stderr)
    finally:
        serve.shutdown()
        ray.shutdown()
    print(
        f"\nenvironment service load: {args.clients} clients × {args.seconds:g} s, "
        f"{args.replicas} replica(s), {os.cpu_count()} CPUs\n"
    )
    print(format_table(rows))
    if args.json_out:
        args.json_out.write_text(json.dumps([asdict(row) for row in rows], indent=1))
    return 0 if all(row.errors == 0 for row in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
