"""A Ray head on this machine for benchmarks that run `rlserve train` on a running
cluster: deploy/ray/start-head.sh on loopback, under a process group of its own, so
stopping it (by signalling that group) leaves any other Ray on the machine alone."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from rlserve.core.cluster import free_port

REPO = Path(__file__).resolve().parent.parent
HEAD_START_TIMEOUT_S = 120


def start_head(temp_dir: Path, env: dict[str, str]) -> tuple[subprocess.Popen, int]:
    """A single-node Ray head (deploy/ray/start-head.sh --block) on loopback; returns the
    blocking process and the GCS port once the cluster answers."""
    ray_port = free_port()
    head_env = {
        **env,
        "RAY": str(Path(sys.executable).parent / "ray"),
        "RAY_PORT": str(ray_port),
        "NODE_IP": "127.0.0.1",
        "NUM_CPUS": "16",  # as `rlserve train` gives its own local cluster
        "DASHBOARD_PORT": str(free_port()),
        "TEMP_DIR": str(temp_dir),
    }
    head = subprocess.Popen(
        ["bash", str(REPO / "deploy/ray/start-head.sh"), "--block"],
        env=head_env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    deadline = time.monotonic() + HEAD_START_TIMEOUT_S
    while time.monotonic() < deadline:
        if head.poll() is not None:
            raise RuntimeError(f"start-head.sh exited with {head.returncode}")
        probe = subprocess.run(
            [head_env["RAY"], "status", f"--address=127.0.0.1:{ray_port}"],
            env=head_env,
            capture_output=True,
        )
        if probe.returncode == 0:
            return head, ray_port
        time.sleep(1)
    raise TimeoutError(f"the Ray head did not answer within {HEAD_START_TIMEOUT_S} s")


def stop_head(head: subprocess.Popen) -> None:
    os.killpg(head.pid, signal.SIGTERM)
    try:
        head.wait(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(head.pid, signal.SIGKILL)
        head.wait()
