"""Reward service scaling on cheap CPU nodes: samples/s against a 50 ms HTTP scoring API.

    .venv/bin/python -m benchmarks.bench_reward_scaling                       # 1, 2, 4, 8
    .venv/bin/python -m benchmarks.bench_reward_scaling --replicas 1,2 --seconds 3 \
        --json-out /tmp/scaling.json

What it measures: how the reward service's throughput (samples scored per second,
through Serve's gRPC proxy, as a trainer calls it) grows with its replica count when the
reward is an external HTTP API — the case where replicas on cheap CPU nodes pay off,
because each replica can only keep `max_concurrency` API requests in flight.

Set-up, all on this machine and all torn down at the end:
- A simulated multi-node Ray cluster (`ray.cluster_utils.Cluster`, private temp dir):
  a head node without a pool label (Serve's controller and its one gRPC proxy,
  `proxy_location=HeadOnly`, live there) and `--cheap-nodes` worker nodes carrying the
  node label `rlserve.io/pool: cheap`, with CPUs for the largest replica count.
- A real HTTP scoring API (aiohttp, in its own process) answering every POST after
  `--api-latency-ms` (asyncio.sleep, so it serves any number of requests at once) with
  {"score": len(response_text)}; the benchmark checks every returned score against it.
- The reward app (`rlserve.reward.app:build_app`, kind `http`, `max_concurrency`
  requests per replica, `placement.label_selector` {rlserve.io/pool: cheap}), deployed
  through the trainer's declarative path (`rlserve.trainer.deploy.deploy_applications`)
  and redeployed with num_replicas = N for each N of `--replicas`.

Per N: wait until exactly N replicas are alive, read their nodes from the Ray state API
and fail unless every one is a cheap node; then keep `--inflight-per-replica` × N
ComputeReward calls of `--samples-per-call` samples in flight (grpc.aio, one channel,
`rlserve.core.rpc.ServiceClient` without retries) for `--warmup-s` plus `--seconds`.
Throughput = samples of the calls completed inside the timed window / its length.
Speed-up = throughput / throughput at 1 replica; efficiency = speed-up / N. The API
bound N × max_concurrency / latency is what the replicas could do at most; the table
also shows the API's largest number of requests in flight (N × max_concurrency when the
replicas are kept busy). A second table shows the CPU cores the replicas, Serve's proxy
and controller, the API and this process (the client) used during the window, and how
busy the whole machine was (other jobs included), to tell a client, proxy or CPU limit
from the service's own.
"""

import argparse
import asyncio
import json
import math
import multiprocessing
import os
import shutil
import statistics
import sys
import tempfile
import time
import urllib.request
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

POOL_LABEL = "rlserve.io/pool"
POOL_VALUE = "cheap"
APP_NAME = "reward"
IMPORT_PATH = "rlserve.reward.app:build_app"
REPLICA_CLASS = "RewardDeployment"


# --- the scoring API ----------------------------------------------------------------------


def _run_api_server(port: int, latency_s: float, ready: Any) -> None:
    """Process entry: the HTTP scoring API on 127.0.0.1:port until terminated."""
    from aiohttp import web

    stats = {"requests": 0, "in_flight": 0, "max_in_flight": 0}

    async def score(request: web.Request) -> web.Response:
        payload = await request.json()
        stats["requests"] += 1
        stats["in_flight"] += 1
        stats["max_in_flight"] = max(stats["max_in_flight"], stats["in_flight"])
        try:
            await asyncio.sleep(latency_s)
        finally:
            stats["in_flight"] -= 1
        return web.json_response({"score": float(len(payload["response_text"]))})

    async def get_stats(request: web.Request) -> web.Response:
        return web.json_response({**stats, "cpu_s": time.process_time()})

    async def reset_stats(request: web.Request) -> web.Response:
        stats["max_in_flight"] = stats["in_flight"]
        return web.json_response({})

    async def main() -> None:
        app = web.Application()
        app.add_routes(
            [
                web.post("/score", score),
                web.get("/stats", get_stats),
                web.post("/stats/reset", reset_stats),
            ]
        )
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        # The default backlog (128) is plenty, but 8 replicas open their pools at once.
        await web.TCPSite(runner, "127.0.0.1", port, backlog=1024).start()
        ready.set()
        await asyncio.Event().wait()

    asyncio.run(main())


class ApiServer:
    """The scoring API in a child process, so it does not share the client's GIL."""

    def __init__(self, latency_s: float) -> None:
        from rlserve.core.cluster import free_port

        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}/score"
        context = multiprocessing.get_context("spawn")
        self._ready = context.Event()
        self._process = context.Process(
            target=_run_api_server, args=(self.port, latency_s, self._ready), daemon=True
        )
        self._process.start()
        self.pid = self._process.pid

    def wait_ready(self, timeout_s: float = 60.0) -> None:
        if not self._ready.wait(timeout=timeout_s):
            raise RuntimeError(f"the scoring API did not start within {timeout_s:g} s")

    def stats(self) -> dict[str, float]:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/stats", timeout=10) as reply:
            return json.loads(reply.read())

    def reset_max_in_flight(self) -> None:
        request = urllib.request.Request(
            f"http://127.0.0.1:{self.port}/stats/reset", data=b"", method="POST"
        )
        urllib.request.urlopen(request, timeout=10).close()

    def stop(self) -> None:
        if self._process.is_alive():
            self._process.terminate()
        self._process.join(timeout=10)


# --- the cluster ---------------------------------------------------------------------------


@dataclass
class SimulatedCluster:
    cluster: Any
    """ray.cluster_utils.Cluster."""
    head_node_id: str
    cheap_node_ids: list[str]
    grpc_address: str
    state_api_url: str
    """The head's dashboard, which serves the state API (list_actors)."""
    temp_dir: Path


def start_cluster(cheap_nodes: int, cpus_per_cheap_node: int, head_cpus: int) -> SimulatedCluster:
    """Head (no pool label) + cheap labelled nodes, Ray connected, Serve started."""
    import ray
    from ray.cluster_utils import Cluster

    from rlserve.core.cluster import apply_ray_env_defaults, free_port, start_serve_on_a_free_port

    apply_ray_env_defaults()
    # An inherited address would point the driver and the state API at another cluster.
    for name in ("RAY_ADDRESS", "RAY_API_SERVER_ADDRESS"):
        os.environ.pop(name, None)
    # Short path: Ray's unix sockets live under it (108-byte limit). RAY_TMPDIR also moves
    # the "current cluster" address file Cluster writes, so no other Ray on the machine
    # (e.g. one started with ray.init(address="auto")) can pick this cluster up.
    temp_dir = Path(tempfile.mkdtemp(prefix="rlscale", dir="/tmp"))
    os.environ["RAY_TMPDIR"] = str(temp_dir)
    cluster = Cluster()
    try:
        cluster.add_node(  # the first node added is the head
            num_cpus=head_cpus,
            temp_dir=str(temp_dir / "ray"),  # where RAY_TMPDIR points Ray's default
            # The state API (list_actors, to see where replicas run) is served by it.
            include_dashboard=True,
            dashboard_port=free_port(),
        )
        for _ in range(cheap_nodes):
            cluster.add_node(num_cpus=cpus_per_cheap_node, labels={POOL_LABEL: POOL_VALUE})
        cluster.wait_for_nodes()
        ray.init(address=cluster.address, log_to_driver=False)
        head_node_id = ray.get_runtime_context().get_node_id()
        nodes = [node for node in ray.nodes() if node["Alive"]]
        cheap = [n["NodeID"] for n in nodes if n["Labels"].get(POOL_LABEL) == POOL_VALUE]
        head_labels = next(n["Labels"] for n in nodes if n["NodeID"] == head_node_id)
        # Proves the labels really reached Ray, so the placement check below means something.
        if len(cheap) != cheap_nodes or head_node_id in cheap or POOL_LABEL in head_labels:
            raise RuntimeError(
                f"node labels not as started: {len(cheap)} cheap of {cheap_nodes}, "
                f"head labels {head_labels}"
            )
        grpc_port = start_serve_on_a_free_port()
    except BaseException:
        ray.shutdown()
        cluster.shutdown()
        os.environ.pop("RAY_TMPDIR", None)
        shutil.rmtree(temp_dir, ignore_errors=True)
        raise
    state_api_url = cluster.webui_url
    if "://" not in state_api_url:
        state_api_url = f"http://{state_api_url}"
    return SimulatedCluster(
        cluster, head_node_id, cheap, f"127.0.0.1:{grpc_port}", state_api_url, temp_dir
    )


def stop_cluster(sim: SimulatedCluster) -> None:
    import ray
    from ray import serve

    try:
        serve.shutdown()
    finally:
        ray.shutdown()
        sim.cluster.shutdown()
        os.environ.pop("RAY_TMPDIR", None)
        shutil.rmtree(sim.temp_dir, ignore_errors=True)


def alive_actors(state_api_url: str) -> list[Any]:
    """Every alive actor of the cluster (ray.util.state ActorState: class, node, pid)."""
    from ray.util.state import list_actors

    # An explicit address: without one Ray guesses among every cluster on the machine.
    return list_actors(
        address=state_api_url,
        filters=[("state", "=", "ALIVE")],
        limit=10_000,
        raise_on_missing_output=False,
    )


def replica_nodes(state_api_url: str) -> dict[str, str]:
    """Alive reward replicas: actor id -> node id."""
    actors = alive_actors(state_api_url)
    return {a.actor_id: a.node_id for a in actors if REPLICA_CLASS in a.class_name}


def deploy_reward(
    sim: SimulatedCluster, args: dict[str, Any], replicas: int, timeout_s: float
) -> dict[str, str]:
    """(Re)deploys the reward app with `replicas` replicas; returns their nodes once
    exactly that many are running (scaling down leaves stopping replicas for a while)."""
    from ray import serve

    from rlserve.trainer.deploy import deploy_applications

    app = {
        "name": APP_NAME,
        "route_prefix": f"/{APP_NAME}",
        "import_path": IMPORT_PATH,
        "args": {**args, "num_replicas": replicas},
    }
    deadline = time.monotonic() + timeout_s
    deploy_applications([app], timeout_s)
    while True:
        deployment = serve.status().applications[APP_NAME].deployments[REPLICA_CLASS]
        running = deployment.replica_states.get("RUNNING", 0)
        nodes = replica_nodes(sim.state_api_url)
        if (
            running == replicas == len(nodes)
            and sum(deployment.replica_states.values()) == replicas
        ):
            return nodes
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"{replicas} replicas not running after {timeout_s:.0f} s: "
                f"{deployment.replica_states}, {len(nodes)} alive actors"
            )
        time.sleep(0.5)


# --- the load ------------------------------------------------------------------------------


@dataclass
class Completion:
    done_s: float
    """time.monotonic() when the answer arrived."""
    latency_s: float
    samples: int


def _requests(samples_per_call: int, variants: int = 8) -> list[tuple[Any, list[float]]]:
    """A few distinct requests (encoded once) with the scores the API must answer."""
    from rlserve.core.batch import Batch
    from rlserve.core.codec import batch_to_proto
    from rlserve.v1 import reward_pb2

    out = []
    for variant in range(variants):
        texts = [f"{variant}+{row}=" + "7" * (row % 5) for row in range(samples_per_call)]
        batch = Batch(non_tensors={"response_text": texts, "ground_truth": ["7"] * len(texts)})
        request = reward_pb2.ComputeRewardRequest(batch=batch_to_proto(batch))
        out.append((request, [float(len(t)) for t in texts]))
    return out


async def _drive(
    grpc_address: str,
    inflight_calls: int,
    samples_per_call: int,
    warmup_s: float,
    seconds: float,
    call_timeout_s: float,
    on_window_edge: Any,
) -> tuple[list[Completion], float, float]:
    """Keeps `inflight_calls` ComputeReward calls in flight until the window ends,
    calling `on_window_edge()` (in a thread) when the window starts and when it ends.

    Returns every completion and the window's (start, end) on time.monotonic()."""
    from rlserve.core.codec import batch_from_proto
    from rlserve.core.rpc import RetryPolicy, ServiceClient, open_channel
    from rlserve.v1 import reward_pb2_grpc

    requests = _requests(samples_per_call)
    completions: list[Completion] = []
    channel = open_channel(grpc_address)
    # No retries: a failed call must fail the benchmark, not hide in a slower figure.
    client = ServiceClient(
        channel,
        reward_pb2_grpc.RewardServiceStub,
        APP_NAME,
        call_timeout_s,
        RetryPolicy(retries=0),
        direct=False,  # the proxy balances the replicas (and 1 replica is the baseline)
    )
    start_s = time.monotonic()
    window_start_s = start_s + warmup_s
    window_end_s = window_start_s + seconds

    async def caller(index: int) -> None:
        call = index
        while time.monotonic() < window_end_s:
            request, expected = requests[call % len(requests)]
            call += inflight_calls
            sent_s = time.monotonic()
            response = await client.call("ComputeReward", request)
            done_s = time.monotonic()
            scores = batch_from_proto(response.batch)["scores"].tolist()
            if scores != expected:
                raise AssertionError(f"wrong scores from the service: {scores} != {expected}")
            completions.append(Completion(done_s, done_s - sent_s, len(expected)))

    async def window_marker() -> None:
        for edge_s in (window_start_s, window_end_s):
            await asyncio.sleep(max(0.0, edge_s - time.monotonic()))
            await asyncio.to_thread(on_window_edge)

    try:
        await asyncio.gather(window_marker(), *(caller(i) for i in range(inflight_calls)))
    finally:
        await channel.close()
    return completions, window_start_s, window_end_s


_CLOCK_TICKS_PER_S = os.sysconf("SC_CLK_TCK")


def _process_cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process so far (0 if it is gone)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            # Fields after the command name, which may itself contain spaces.
            fields = stat.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / _CLOCK_TICKS_PER_S


def _machine_ticks() -> tuple[int, int]:
    """(busy, total) CPU clock ticks of the whole machine so far, every process."""
    with open("/proc/stat") as stat:
        ticks = [int(value) for value in stat.readline().split()[1:9]]
    idle = ticks[3] + ticks[4]  # idle + iowait
    return sum(ticks) - idle, sum(ticks)


CPU_GROUPS = ("replicas", "proxy", "controller", "api", "client")
"""Processes whose CPU use the benchmark reports: reward replicas, Serve's gRPC proxy
and controller, the scoring API, this process (the gRPC client)."""


def _cpu_snapshot(pids: dict[str, list[int]]) -> dict[str, float]:
    snapshot = {group: sum(_process_cpu_s(pid) for pid in pids[group]) for group in pids}
    snapshot["machine_busy"], snapshot["machine_total"] = _machine_ticks()
    return snapshot


def _cores_used(before: dict[str, float], after: dict[str, float], window_s: float) -> dict:
    cores = {group: (after[group] - before[group]) / window_s for group in CPU_GROUPS}
    total = after["machine_total"] - before["machine_total"]
    cores["machine_busy"] = (after["machine_busy"] - before["machine_busy"]) / total if total else 0
    return cores


@dataclass
class Row:
    replicas: int
    samples_per_s: float
    speedup: float
    """samples_per_s / that of 1 replica (0 when 1 replica was not measured)."""
    efficiency: float
    """speedup / replicas."""
    api_bound_samples_per_s: float
    """replicas × max_concurrency / API latency: the most the replicas can score."""
    calls: int
    samples: int
    window_s: float
    call_p50_s: float
    call_p95_s: float
    inflight_calls: int
    api_max_in_flight: int
    """Most API requests in flight at once (warm-up and window)."""
    cores: dict[str, float]
    """CPU cores used during the window per CPU_GROUPS entry, and machine_busy: the
    share of all the machine's CPUs busy (every process, other jobs' too)."""
    replica_nodes: list[str] = field(default_factory=list)
    on_cheap_nodes: bool = False


def measure(
    sim: SimulatedCluster,
    api: ApiServer,
    args: dict[str, Any],
    replicas: int,
    *,
    inflight_per_replica: int,
    samples_per_call: int,
    warmup_s: float,
    seconds: float,
    deploy_timeout_s: float,
    api_latency_s: float,
) -> Row:
    deploy_start_s = time.monotonic()
    nodes = deploy_reward(sim, args, replicas, deploy_timeout_s)
    on_cheap = all(node in sim.cheap_node_ids for node in nodes.values())
    print(
        f"  {replicas} replica(s) running after {time.monotonic() - deploy_start_s:.1f} s "
        "on nodes "
        + ", ".join(sorted(node[:8] for node in nodes.values()))
        + (" (all cheap)" if on_cheap else " — NOT ALL CHEAP"),
        file=sys.stderr,
    )
    if not on_cheap:
        outside = sorted(set(nodes.values()) - set(sim.cheap_node_ids))
        raise RuntimeError(f"replicas outside the cheap pool: {outside}")
    actors = alive_actors(sim.state_api_url)
    pids = {
        "replicas": [a.pid for a in actors if a.actor_id in nodes],
        "proxy": [a.pid for a in actors if "ProxyActor" in a.class_name],
        "controller": [a.pid for a in actors if "ServeController" in a.class_name],
        "api": [api.pid],
        "client": [os.getpid()],
    }
    snapshots: list[dict[str, float]] = []

    def on_window_edge() -> None:
        snapshots.append(_cpu_snapshot(pids))

    api.reset_max_in_flight()
    inflight_calls = inflight_per_replica * replicas
    completions, window_start_s, window_end_s = asyncio.run(
        _drive(
            sim.grpc_address,
            inflight_calls,
            samples_per_call,
            warmup_s,
            seconds,
            call_timeout_s=60.0,
            on_window_edge=on_window_edge,
        )
    )
    in_window = [c for c in completions if window_start_s <= c.done_s <= window_end_s]
    if not in_window:
        raise RuntimeError(f"no call completed inside the {seconds} s window")
    latencies = sorted(c.latency_s for c in in_window)
    samples = sum(c.samples for c in in_window)
    # Replicas must not have moved or restarted during the load.
    nodes_after = replica_nodes(sim.state_api_url)
    if nodes_after != nodes:
        raise RuntimeError(f"replicas changed during the run: {nodes} -> {nodes_after}")
    max_concurrency = args["kinds"]["http"]["max_concurrency"]
    return Row(
        replicas=replicas,
        samples_per_s=samples / seconds,
        speedup=0.0,
        efficiency=0.0,
        api_bound_samples_per_s=replicas * max_concurrency / api_latency_s,
        calls=len(in_window),
        samples=samples,
        window_s=seconds,
        call_p50_s=statistics.median(latencies),
        call_p95_s=latencies[min(len(latencies) - 1, int(0.95 * len(latencies)))],
        inflight_calls=inflight_calls,
        api_max_in_flight=int(api.stats()["max_in_flight"]),
        cores=_cores_used(snapshots[0], snapshots[1], seconds),
        replica_nodes=sorted(nodes.values()),
        on_cheap_nodes=on_cheap,
    )


def format_table(rows: list[Row]) -> str:
    lines = [
        "replicas   samples/s   speed-up   efficiency   API bound   call p50 s   call p95 s   "
        "API max in flight",
        "--------   ---------   --------   ----------   ---------   ----------   ----------   "
        "-----------------",
    ]
    for r in rows:
        lines.append(
            f"{r.replicas:8d}   {r.samples_per_s:9.1f}   {r.speedup:7.2f}×   "
            f"{100 * r.efficiency:9.1f}%   {r.api_bound_samples_per_s:9.0f}   "
            f"{r.call_p50_s:10.3f}   {r.call_p95_s:10.3f}   {r.api_max_in_flight:17d}"
        )
    return "\n".join(lines)


def format_cpu_table(rows: list[Row]) -> str:
    """Where the CPU went during each window, to tell a client, proxy or CPU limit from
    the service's own."""
    lines = [
        "replicas   cores: " + "  ".join(f"{g:>10s}" for g in CPU_GROUPS) + "   machine busy",
        "--------   ------ " + "  ".join("-" * 10 for _ in CPU_GROUPS) + "   ------------",
    ]
    for r in rows:
        lines.append(
            f"{r.replicas:8d}          "
            + "  ".join(f"{r.cores[g]:10.2f}" for g in CPU_GROUPS)
            + f"   {100 * r.cores['machine_busy']:11.0f}%"
        )
    return "\n".join(lines)


# --- command line --------------------------------------------------------------------------


def _replica_counts(text: str) -> list[int]:
    counts = [int(part) for part in text.split(",") if part.strip()]
    if not counts or any(c < 1 for c in counts):
        raise argparse.ArgumentTypeError(f"comma-separated positive counts; got {text!r}")
    return counts


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--replicas", type=_replica_counts, default=[1, 2, 4, 8])
    parser.add_argument("--seconds", type=float, default=10.0, help="timed window per count")
    parser.add_argument("--warmup-s", type=float, default=2.0, help="untimed load first")
    parser.add_argument("--samples-per-call", type=int, default=16)
    parser.add_argument(
        "--inflight-per-replica", type=int, default=3, help="calls in flight per replica"
    )
    parser.add_argument(
        "--max-concurrency", type=int, default=4, help="API requests in flight per replica"
    )
    parser.add_argument("--api-latency-ms", type=float, default=50.0)
    parser.add_argument("--cheap-nodes", type=int, default=4)
    parser.add_argument("--cpus-per-replica", type=float, default=1.0)
    parser.add_argument("--deploy-timeout-s", type=float, default=180.0)
    parser.add_argument("--json-out", type=Path, help="also write settings and rows here")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    api_latency_s = args.api_latency_ms / 1000
    # Logical CPUs only (the work is waiting on the API): enough for the largest count.
    cpus_per_cheap_node = math.ceil(max(args.replicas) * args.cpus_per_replica / args.cheap_nodes)
    settings = {
        "api_latency_s": api_latency_s,
        "max_concurrency_per_replica": args.max_concurrency,
        "samples_per_call": args.samples_per_call,
        "inflight_calls_per_replica": args.inflight_per_replica,
        "cheap_nodes": args.cheap_nodes,
        "cpus_per_cheap_node": cpus_per_cheap_node,
        "cpus_per_replica": args.cpus_per_replica,
        "warmup_s": args.warmup_s,
        "window_s": args.seconds,
        "machine_cpus": os.cpu_count(),
    }
    print(f"settings: {json.dumps(settings)}", file=sys.stderr)
    api = ApiServer(api_latency_s)
    rows: list[Row] = []
    sim = None
    try:
        print("starting the simulated cluster ...", file=sys.stderr)
        sim = start_cluster(args.cheap_nodes, cpus_per_cheap_node, head_cpus=1)
        print(
            f"  head {sim.head_node_id[:8]} (no pool label), cheap nodes "
            + ", ".join(node[:8] for node in sorted(sim.cheap_node_ids)),
            file=sys.stderr,
        )
        api.wait_ready()  # started first, so it came up while the cluster did
        reward_args = {
            "kinds": {
                "http": {
                    "url": api.url,
                    "max_concurrency": args.max_concurrency,
                    "timeout_s": 10.0,
                    "retries": 0,
                }
            },
            "max_ongoing_requests": max(8, 2 * args.inflight_per_replica),
            "num_cpus_per_replica": args.cpus_per_replica,
            "placement": {"label_selector": {POOL_LABEL: POOL_VALUE}},
        }
        for replicas in args.replicas:
            row = measure(
                sim,
                api,
                reward_args,
                replicas,
                inflight_per_replica=args.inflight_per_replica,
                samples_per_call=args.samples_per_call,
                warmup_s=args.warmup_s,
                seconds=args.seconds,
                deploy_timeout_s=args.deploy_timeout_s,
                api_latency_s=api_latency_s,
            )
            rows.append(row)
            print(
                f"  {replicas} replica(s): {row.samples_per_s:.1f} samples/s, "
                f"API max in flight {row.api_max_in_flight}, "
                f"machine CPU busy {100 * row.cores['machine_busy']:.0f}%",
                file=sys.stderr,
            )
    finally:
        if sim is not None:
            stop_cluster(sim)
        api.stop()
    base = next((r.samples_per_s for r in rows if r.replicas == 1), None)
    for row in rows:
        if base:
            row.speedup = row.samples_per_s / base
            row.efficiency = row.speedup / row.replicas
    print(
        f"\nreward service scaling: HTTP API at {args.api_latency_ms:g} ms per request, "
        f"max_concurrency {args.max_concurrency} per replica, {args.samples_per_call} samples "
        f"per call, {args.inflight_per_replica} calls in flight per replica, "
        f"{args.seconds:g} s window; {args.cheap_nodes} cheap nodes × "
        f"{cpus_per_cheap_node:g} logical CPUs on a {os.cpu_count()}-core machine"
    )
    print(format_table(rows))
    print(f"\nCPU cores used during the window ({os.cpu_count()} on this machine):")
    print(format_cpu_table(rows))
    eight = next((r for r in rows if r.replicas == 8), None)
    if eight is not None and base:
        verdict = "met" if eight.speedup >= 7 else "MISSED"
        print(f"target 8 replicas ≥ 7× one: {eight.speedup:.2f}× ({verdict})")
    print("every replica ran on a cheap node: " + str(all(r.on_cheap_nodes for r in rows)))
    if args.json_out:
        args.json_out.write_text(
            json.dumps({"settings": settings, "rows": [asdict(r) for r in rows]}, indent=1)
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
