"""Reward service under load: 64 concurrent clients for 60 s, rule and HTTP kinds.

    .venv/bin/python -m benchmarks.bench_reward_load                    # the issue's setting
    .venv/bin/python -m benchmarks.bench_reward_load --clients 8 --seconds 5 --json-out x.json

Set-up, all on this machine and torn down at the end: a private local Ray cluster with
Serve (token auth on, as `rlserve train` runs it), a real HTTP scoring API in its own
process (`bench_reward_scaling.ApiServer`: answers {"score": len(response_text)} after
--api-latency-ms), and the reward app (`rlserve.reward.app:build_app`, --replicas
replicas, the service's default max_ongoing_requests) deployed once per kind: `rule`
(gsm8k) and `http`.

Per kind: each of --clients clients (its own gRPC channel to Serve's proxy, `ServiceClient`
without retries, the cluster's token) sends ComputeReward calls of --samples-per-call samples
back to back for --seconds and checks every score against the one it must be. A call
that fails, times out or answers a wrong score counts as an error (the run goes on).
Latency is per call, as the client sees it (Serve queues calls beyond the replicas'
max_ongoing_requests, so it includes that wait). Replica memory is each replica's
resident set, measured from outside (rlserve.core.resources) after one warm-up call and
again after the load.
"""

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import grpc

from benchmarks.bench_reward_scaling import ApiServer

APP = "reward"
_MIB = 1 << 20


@dataclass
class LoadRow:
    kind: str
    clients: int
    seconds: float
    calls: int
    errors: int
    error_kinds: dict[str, int]
    calls_per_s: float
    samples_per_s: float
    p50_ms: float
    p99_ms: float
    max_ms: float
    replica_mib_start: float
    replica_mib_end: float


def _requests(kind: str, samples: int, variants: int = 8) -> list[tuple[Any, list[float]]]:
    """Distinct requests (encoded once) with the scores they must get."""
    from rlserve.core.batch import Batch
    from rlserve.core.codec import batch_to_proto
    from rlserve.v1 import reward_pb2

    out = []
    for variant in range(variants):
        answers = [str(variant * 100 + row) for row in range(samples)]
        # every other response is right: the rule's scores are 1 and 0 in turn
        texts = [
            f"step {row}: {answer} + 0 #### {answer if row % 2 == 0 else answer + '1'}"
            for row, answer in enumerate(answers)
        ]
        batch = Batch(non_tensors={"response_text": texts, "ground_truth": answers})
        if kind == "rule":
            expected = [1.0 if row % 2 == 0 else 0.0 for row in range(samples)]
        else:
            expected = [float(len(text)) for text in texts]
        out.append((reward_pb2.ComputeRewardRequest(batch=batch_to_proto(batch)), expected))
    return out


def _replica_mib() -> float:
    from rlserve.core.resources import service_memory

    return sum(p.resident_bytes for p in service_memory() if p.app == APP) / _MIB


def deploy(kinds: dict[str, Any], replicas: int, max_ongoing_requests: int | None) -> None:
    from rlserve.trainer.deploy import deploy_applications

    args: dict[str, Any] = {"kinds": kinds, "num_replicas": replicas}
    if max_ongoing_requests is not None:
        args["max_ongoing_requests"] = max_ongoing_requests
    app = {
        "name": APP,
        "route_prefix": f"/{APP}",
        "import_path": "rlserve.reward.app:build_app",
        "args": args,
    }
    deploy_applications([app], timeout_s=300)


async def _load(
    address: str, kind: str, clients: int, samples: int, seconds: float, timeout_s: float
) -> tuple[list[float], Counter, float]:
    """(latencies of the calls that succeeded, errors by kind, window seconds)."""
    from rlserve.core.codec import batch_from_proto
    from rlserve.core.rpc import RetryPolicy, ServiceClient, open_channel
    from rlserve.v1 import reward_pb2_grpc

    requests = _requests(kind, samples)
    latencies: list[float] = []
    errors: Counter = Counter()
    channels = [open_channel(address) for _ in range(clients)]
    started = time.monotonic()
    ends = started + seconds

    async def client(index: int) -> None:
        # No retries: a failure must show as an error, not as a slower call.
        service = ServiceClient(
            channels[index],
            reward_pb2_grpc.RewardServiceStub,
            APP,
            timeout_s,
            RetryPolicy(retries=0),
            direct=False,  # through Serve's proxy, as callers off the cluster come in
        )
        call = index
        while time.monotonic() < ends:
            request, expected = requests[call % len(requests)]
            call += 1
            sent = time.monotonic()
            try:
                response = await service.call("ComputeReward", request)
            except grpc.aio.AioRpcError as error:
                errors[error.code().name] += 1
                continue
            scores = batch_from_proto(response.batch)["scores"].tolist()
            if scores != expected:
                errors["wrong scores"] += 1
                continue
            latencies.append(time.monotonic() - sent)

    try:
        await asyncio.gather(*(client(index) for index in range(clients)))
    finally:
        for channel in channels:
            await channel.close()
    return latencies, errors, time.monotonic() - started


def latency_ms(latencies_s: list[float]) -> tuple[float, float, float]:
    """(p50, p99, max) in ms of the calls' latencies (NaN without any)."""
    ordered = sorted(1000 * s for s in latencies_s) or [float("nan")]
    return (
        statistics.median(ordered),
        ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))],
        ordered[-1],
    )


def measure(address: str, kind: str, args: argparse.Namespace) -> LoadRow:
    # one client for a second first: the replica's first calls pay for imports and caches
    asyncio.run(_load(address, kind, 1, args.samples_per_call, 1.0, args.call_timeout_s))
    memory_start = _replica_mib()
    latencies, errors, window_s = asyncio.run(
        _load(address, kind, args.clients, args.samples_per_call, args.seconds, args.call_timeout_s)
    )
    memory_end = _replica_mib()
    p50_ms, p99_ms, max_ms = latency_ms(latencies)
    calls = len(latencies) + sum(errors.values())
    return LoadRow(
        kind=kind,
        clients=args.clients,
        seconds=round(window_s, 1),
        calls=calls,
        errors=sum(errors.values()),
        error_kinds=dict(errors),
        calls_per_s=len(latencies) / window_s,
        samples_per_s=len(latencies) * args.samples_per_call / window_s,
        p50_ms=p50_ms,
        p99_ms=p99_ms,
        max_ms=max_ms,
        replica_mib_start=memory_start,
        replica_mib_end=memory_end,
    )


def format_table(rows: list[LoadRow]) -> str:
    lines = [
        "| kind | clients | s | calls | errors | calls/s | samples/s | p50 ms | p99 ms | "
        "max ms | replica MiB start → end |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r.kind} | {r.clients} | {r.seconds:g} | {r.calls} | {r.errors} | "
            f"{r.calls_per_s:.0f} | {r.samples_per_s:.0f} | {r.p50_ms:.1f} | {r.p99_ms:.1f} | "
            f"{r.max_ms:.1f} | {r.replica_mib_start:.0f} → {r.replica_mib_end:.0f} |"
        )
    return "\n".join(lines)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=64)
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--samples-per-call", type=int, default=16)
    parser.add_argument("--replicas", type=int, default=1)
    parser.add_argument(
        "--max-ongoing-requests", type=int, help="per replica (default: the service's)"
    )
    parser.add_argument("--api-latency-ms", type=float, default=20.0)
    parser.add_argument("--call-timeout-s", type=float, default=30.0)
    parser.add_argument("--kinds", default="rule,http", help="comma-separated: rule, http")
    parser.add_argument("--json-out", type=Path)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    import ray
    from ray import serve

    from rlserve.core import auth
    from rlserve.core.cluster import start_local_ray, start_serve_on_a_free_port

    api = ApiServer(args.api_latency_ms / 1000)
    if auth.expected_token() is None:
        os.environ[auth.TOKEN_ENV] = auth.generate_token()  # before Ray: replicas inherit it
    start_local_ray(num_cpus=max(4, os.cpu_count() or 1), log_to_driver=False)
    rows = []
    try:
        address = f"127.0.0.1:{start_serve_on_a_free_port()}"
        api.wait_ready()
        kinds = {
            "rule": {"rule": {"rule_name": "gsm8k"}},
            "http": {"http": {"url": api.url, "retries": 0}},
        }
        for kind in args.kinds.split(","):
            deploy(kinds[kind], args.replicas, args.max_ongoing_requests)
            rows.append(measure(address, kind, args))
            print(f"  {kind}: {rows[-1].calls} calls, {rows[-1].errors} errors", file=sys.stderr)
    finally:
        serve.shutdown()
        ray.shutdown()
        api.stop()
    print(
        f"\nreward service load: {args.clients} clients × {args.seconds:g} s, "
        f"{args.samples_per_call} samples per call, {args.replicas} replica(s), "
        f"HTTP API latency {args.api_latency_ms:g} ms, {os.cpu_count()} cores"
    )
    print(format_table(rows))
    if args.json_out:
        args.json_out.write_text(json.dumps([asdict(row) for row in rows], indent=1))
    return 1 if any(row.errors for row in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
