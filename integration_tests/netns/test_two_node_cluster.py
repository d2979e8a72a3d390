"""A real two-node cluster: a head and a cheap worker in network namespaces of their own,
joined by a veth pair, started by deploy/ray/start-head.sh and start-worker.sh with their
own copies of the token files. Checks where reward runs, that a run completes across
both nodes, that a node without the token is refused, and that each node listens only on
the sockets docs/reliability-and-security.md documents.

Needs root and iproute2 (`ip netns`); run with `RLSERVE_NETNS_TESTS=1 pytest
integration_tests/netns` (`make test` does, as a session of its own).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
VENV_BIN = Path(sys.executable).parent
# 198.18.0.0/15 is reserved for benchmarking networks: never a real peer's address.
HEAD_IP, WORKER_IP = "198.18.0.1", "198.18.0.2"
GCS_PORT, SERVE_GRPC_PORT = 6379, 9000
START_TIMEOUT_S, RUN_TIMEOUT_S = 120, 420


def _root_with_netns() -> str | None:
    if os.geteuid() != 0:
        return "needs root to create network namespaces"
    if shutil.which("ip") is None:
        return "needs iproute2's `ip`"
    return None


_missing = _root_with_netns()
if _missing and os.environ.get("CI"):
    raise RuntimeError(f"the two-node network-namespace tests cannot run in CI: {_missing}")
pytestmark = pytest.mark.skipif(_missing is not None, reason=_missing or "")


def _run(*command: str, timeout_s: float = 30, check: bool = True, **kwargs):
    return subprocess.run(
        command, check=check, timeout=timeout_s, capture_output=True, text=True, **kwargs
    )


@dataclass(frozen=True)
class Node:
    netns: str
    ip: str
    home: Path
    temp_dir: Path

    def run(
        self,
        *command: str,
        env: dict[str, str] | None = None,
        timeout_s: float = 60,
    ) -> subprocess.CompletedProcess:
        """Runs `command` inside this node's namespace with its HOME (its token files)."""
        full_env = {
            "PATH": f"{VENV_BIN}:/usr/sbin:/usr/bin:/sbin:/bin",
            "HOME": str(self.home),
            "RAY_AUTH_MODE": "token",
            "RLSERVE_AUTH_TOKEN_FILE": str(self.home / ".rlserve" / "auth_token"),
            **(env or {}),
        }
        return _run(
            "ip",
            "netns",
            "exec",
            self.netns,
            "env",
            "-i",
            *(f"{k}={v}" for k, v in full_env.items()),
            *command,
            timeout_s=timeout_s,
            check=False,
            cwd=REPO,
        )

    def start(self, script: str, *args: str, pool: str, num_cpus: int) -> None:
        """Starts this node's Ray with one of deploy/ray's scripts."""
        started = self.run(
            f"deploy/ray/{script}",
            *args,
            env={
                "NODE_IP": self.ip,
                "POOL": pool,
                "NUM_CPUS": str(num_cpus),
                "TEMP_DIR": str(self.temp_dir),
                "OBJECT_STORE_BYTES": str(200 * 2**20),
                "RAY": str(VENV_BIN / "ray"),
            },
            timeout_s=START_TIMEOUT_S,
        )
        assert started.returncode == 0, started.stderr[-3000:]


@dataclass(frozen=True)
class TwoNodes:
    head: Node
    worker: Node
    root: Path


def _kill_namespace(netns: str) -> None:
    pids = _run("ip", "netns", "pids", netns, check=False).stdout.split()
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(int(pid), 9)
    _run("ip", "netns", "del", netns, check=False)


@pytest.fixture(scope="module")
def two_nodes() -> Iterator[TwoNodes]:
    suffix = f"{os.getpid() % 100000}"
    head_ns, worker_ns = f"rlsh{suffix}", f"rlsw{suffix}"
    root = Path(tempfile.mkdtemp(prefix="rlnn"))
    head = Node(head_ns, HEAD_IP, root / "head", root / "rh")
    worker = Node(worker_ns, WORKER_IP, root / "worker", root / "rw")
    try:
        for netns in (head_ns, worker_ns):
            _run("ip", "netns", "add", netns)
            _run("ip", "-n", netns, "link", "set", "lo", "up")
        _run("ip", "link", "add", f"v{head_ns}", "type", "veth", "peer", "name", f"v{worker_ns}")
        for node in (head, worker):
            device = f"v{node.netns}"
            _run("ip", "link", "set", device, "netns", node.netns)
            _run("ip", "-n", node.netns, "addr", "add", f"{node.ip}/24", "dev", device)
            _run("ip", "-n", node.netns, "link", "set", device, "up")
            node.home.mkdir()
        head.start("start-head.sh", pool="gpu", num_cpus=4)
        # The worker's own copies of the two token files start-head.sh wrote.
        for name in (".ray", ".rlserve"):
            shutil.copytree(head.home / name, worker.home / name)
        worker.start("start-worker.sh", f"{HEAD_IP}:{GCS_PORT}", pool="cheap", num_cpus=2)
        yield TwoNodes(head, worker, root)
    finally:
        for netns in (worker_ns, head_ns):
            _kill_namespace(netns)
        _run("ip", "link", "del", f"v{head_ns}", check=False)
        shutil.rmtree(root, ignore_errors=True)


PROBE = """
import json, ray
from ray.util.state import list_actors
ray.init(address="{address}", logging_level="error", log_to_driver=False)
ips = {{n["NodeID"]: n["NodeManagerAddress"] for n in ray.nodes() if n["Alive"]}}
pools = {{n["NodeManagerAddress"]: n["Labels"].get("rlserve.io/pool") for n in ray.nodes()
         if n["Alive"]}}
actors = [(a.class_name, ips.get(a.node_id), a.name or "")
          for a in list_actors(filters=[("state", "=", "ALIVE")], limit=1000)]
print(json.dumps({{"pools": pools, "actors": actors}}))
"""


def _cluster_view(nodes: TwoNodes) -> dict:
    probe = nodes.head.run(
        "python", "-c", PROBE.format(address=f"{HEAD_IP}:{GCS_PORT}"), timeout_s=60
    )
    assert probe.returncode == 0, probe.stderr[-3000:]
    return json.loads(probe.stdout.strip().splitlines()[-1])


RUN_YAML = """
trainer:
  total_steps: 2
  prompts_per_step: 8
  checkpoint_every_steps: 0
  ray_address: {head}:{gcs}
  serve_grpc_port: {serve}
  run_dir: {run_dir}
model: {{tiny: {{sft_max_steps: 50}}}}
placement:
  pools:
    global_pool: {{label_selector: {{rlserve.io/pool: gpu}}}}
    reward_pool: {{label_selector: {{rlserve.io/pool: cheap}}}}
  roles:
    rollout: {{pool: global_pool, worker_resources: {{CPU: 1}}}}
    critic: {{pool: global_pool, worker_resources: {{CPU: 1}}}}
    reference: {{pool: global_pool, worker_resources: {{CPU: 1}}}}
    reward: {{pool: reward_pool, worker_resources: {{CPU: 1}}}}
"""


@pytest.fixture(scope="module")
def finished_run(two_nodes: TwoNodes) -> subprocess.CompletedProcess:
    config = two_nodes.root / "run.yaml"
    config.write_text(
        RUN_YAML.format(
            head=HEAD_IP, gcs=GCS_PORT, serve=SERVE_GRPC_PORT, run_dir=two_nodes.root / "runs"
        )
    )
    return two_nodes.head.run("rlserve", "train", "--config", str(config), timeout_s=RUN_TIMEOUT_S)


def test_a_run_completes_across_both_nodes_with_reward_on_the_worker(two_nodes, finished_run):
    assert finished_run.returncode == 0, finished_run.stdout[-3000:] + finished_run.stderr[-3000:]
    assert "rlserve run finished: 2 PPO steps" in finished_run.stdout
    metrics = list((two_nodes.root / "runs").glob("*/metrics.jsonl"))
    assert len(metrics) == 1 and len(metrics[0].read_text().splitlines()) >= 2
    view = _cluster_view(two_nodes)
    assert view["pools"] == {HEAD_IP: "gpu", WORKER_IP: "cheap"}
    where: dict[str, set[str]] = {}
    for class_name, ip, name in view["actors"]:
        where.setdefault("reward" if "RewardDeployment" in name else class_name, set()).add(ip)
    # The services stay deployed after the run; their workers are where the pools say.
    assert where["reward"] == {WORKER_IP}, where
    for worker in ("ActorWorker", "CriticWorker", "ReferenceWorker"):
        assert where[worker] == {HEAD_IP}, where


def test_a_node_without_the_token_is_refused(two_nodes, finished_run):
    intruder_home = two_nodes.root / "intruder"
    intruder_home.mkdir()
    node_count = len(_cluster_view(two_nodes)["pools"])
    intruder = Node(
        two_nodes.worker.netns, WORKER_IP, intruder_home, two_nodes.root / "intruder-ray"
    )
    for env in ({"RAY_AUTH_TOKEN": "0" * 64}, {"RAY_AUTH_MODE": "disabled"}):
        joined = intruder.run(
            "ray",
            "start",
            f"--address={HEAD_IP}:{GCS_PORT}",
            f"--node-ip-address={WORKER_IP}",
            f"--temp-dir={intruder.temp_dir}",
            "--num-cpus=1",
            "--disable-usage-stats",
            env=env,
            timeout_s=START_TIMEOUT_S,
        )
        assert joined.returncode != 0, (env, joined.stdout[-2000:])
    assert len(_cluster_view(two_nodes)["pools"]) == node_count
    # The deploy script stops before Ray when the head's token file was not copied.
    scripted = Node(two_nodes.worker.netns, WORKER_IP, intruder_home, intruder_home)
    refused = scripted.run(
        "deploy/ray/start-worker.sh",
        f"{HEAD_IP}:{GCS_PORT}",
        env={"POOL": "cheap", "RAY": str(VENV_BIN / "ray")},
    )
    assert refused.returncode == 2
    assert "no token file" in refused.stderr and "auth_token" in refused.stderr


# docs/reliability-and-security.md, "What listens where", as rules: which process may listen on
# which ports, on which node, and which of them only on 127.0.0.1. Ray's worker ports are
# 10002-19999; the worker groups also hold ephemeral ports (torch.distributed's), and so
# does every replica that loads torch (one port each, its opener not identified).
RAY_WORKER_PORTS = range(10002, 20000)
EPHEMERAL = range(32768, 61000)
DIRECT_INGRESS_GRPC, DIRECT_INGRESS_HTTP = range(40000, 41000), range(30000, 31000)


def _documented(process: str, host: str, port: int, head: bool) -> bool:
    loopback = host in ("127.0.0.1", "::ffff:127.0.0.1")
    if process == "gcs_server":
        return head and port == GCS_PORT
    if process in ("raylet", "ray::DashboardAgent", "ray::RuntimeEnvAgent"):
        return True
    if process == "dashboard":
        return head and (loopback if port == 8265 else port in EPHEMERAL)
    if process == "autoscaler":
        return head and port in EPHEMERAL
    if process == "ray_client_server":
        return head and port == 10001 and not host.startswith("*")
    if process == "ray::ProxyActor":
        return head and (port == SERVE_GRPC_PORT or port in RAY_WORKER_PORTS or loopback)
    if process == "ray::ServeController":
        return head and port in RAY_WORKER_PORTS
    if process == "ray::ServeReplica":
        if port in DIRECT_INGRESS_HTTP:
            return loopback
        return port in RAY_WORKER_PORTS or port in DIRECT_INGRESS_GRPC or port in EPHEMERAL
    if process in ("ray::ActorWorker", "ray::CriticWorker", "ray::ReferenceWorker"):
        return port in RAY_WORKER_PORTS or port in EPHEMERAL or loopback
    return False


def _process_name(pid: int) -> str:
    argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
    text = " ".join(argv)
    if "dashboard/dashboard.py" in text:
        return "dashboard"
    if "autoscaler/_private/monitor.py" in text:
        return "autoscaler"
    if "ray.util.client.server" in text:
        return "ray_client_server"
    name = argv[0].strip()
    if "gcs_server" in name:
        return "gcs_server"
    if name.endswith("raylet"):
        return "raylet"
    # "ray::ServeReplica:reward:RewardDeployment", "ray::ServeController.listen_for_change"
    if not name.startswith("ray::"):
        return name
    return "ray::" + name[len("ray::") :].split(":")[0].split(".")[0]


def _listening(node: Node) -> list[tuple[str, str, int]]:
    listed = _run("ip", "netns", "exec", node.netns, "ss", "-ltnpH").stdout
    sockets = []
    for line in listed.splitlines():
        fields = line.split()
        host, _, port = fields[3].rpartition(":")
        pid = int(fields[5].split("pid=")[1].split(",")[0])
        sockets.append((_process_name(pid), host.strip("[]"), int(port)))
    return sockets


def test_each_node_listens_only_where_documented(two_nodes, finished_run):
    assert finished_run.returncode == 0
    head_sockets, worker_sockets = _listening(two_nodes.head), _listening(two_nodes.worker)
    for node, sockets, head in (
        (two_nodes.head, head_sockets, True),
        (two_nodes.worker, worker_sockets, False),
    ):
        assert sockets, node
        undocumented = [s for s in sockets if not _documented(*s, head=head)]
        assert not undocumented, f"{node.netns}: {undocumented}"
    assert ("dashboard", "127.0.0.1", 8265) in head_sockets
    assert any(p == "ray::ProxyActor" and port == SERVE_GRPC_PORT for p, _, port in head_sockets)
    assert any(
        p == "ray::ServeReplica" and port in DIRECT_INGRESS_GRPC for p, _, port in worker_sockets
    )
