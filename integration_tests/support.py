"""Helpers for whole-stack tests."""

import asyncio
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from rlserve.core.config import validate_config
from rlserve.core.rpc import ServiceClient, open_channel
from rlserve.core.run_config import RunConfig
from rlserve.trainer.deploy import deploy_services, service_args
from rlserve.trainer.metrics import read_metrics
from rlserve.trainer.run import RunInputs, train_on_services
from rlserve.v1 import critic_pb2, critic_pb2_grpc, rollout_pb2, rollout_pb2_grpc

TRACED_SERVICES = {
    "rlserve-trainer",
    "rlserve-rollout",
    "rlserve-reference",
    "rlserve-critic",
    "rlserve-reward",
}
"""service.name of every process a traced PPO step crosses."""


def tiny_run_config(run_dir: Path, runs_root: Path | None = None, **sections) -> RunConfig:
    """A run of a few fast steps whose trainer.run_dir (the root of its runs, and the
    services' checkpoint_root) is `runs_root`, by default `run_dir` itself; `sections`
    override whole sections' fields."""
    data = {
        "rollout": {"max_new_tokens": 3, "eval_prompts": 32, "eval_every_steps": 0},
        "actor": {"ppo_mini_batch_prompts": 8, "micro_batch_samples": 8, "ppo_epochs": 1},
        "critic": {"ppo_mini_batch_prompts": 8, "micro_batch_samples": 8, "ppo_epochs": 1},
        "trainer": {
            "total_steps": 3,
            "prompts_per_step": 16,
            "checkpoint_every_steps": 0,
            "run_dir": str(runs_root or run_dir),
            "control_port": None,
        },
    }
    for section, fields in sections.items():
        data.setdefault(section, {}).update(fields)
    return validate_config(RunConfig, data)


def session_runs_root(tmp_path: Path) -> Path:
    """The runs root all tests can share: pytest's base directory of the session, above
    every tmp_path. Under one root the services keep one checkpoint_root, and so the
    same settings from test to test: what deployed_services needs to reuse them."""
    return tmp_path.parent


def run_inputs(embedded) -> RunInputs:
    """The run inputs of the session's warmed-up embedded model (conftest `embedded`)."""
    return RunInputs(str(embedded.model_dir), str(embedded.train_path), str(embedded.eval_path))


SERVICE_ROLES = ("rollout", "critic", "reference", "reward", "environment")


def fresh_services(config: RunConfig, inputs: RunInputs) -> None:
    """Redeploys from scratch: new replicas at the initial weights, for tests that call
    the services before any run or count on replicas no earlier test touched."""
    from ray import serve

    for role in SERVICE_ROLES:
        serve.delete(role)
    deploy_services(service_args(config, inputs.model_dir), timeout_s=300)


def deployed_services(config: RunConfig, inputs: RunInputs, address: str) -> None:
    """The services `config` runs, at their initial weights: apps already deployed with
    its settings are kept and reset (what a run does with services an earlier run
    trained; test_service_reuse checks that it computes what fresh replicas do), the
    others replaced. A redeploy takes 30-50 s on this machine kind, a reset under 1 s."""
    from ray import serve

    apps = service_args(config, inputs.model_dir)
    for role in set(SERVICE_ROLES) - apps.keys():
        serve.delete(role)
    deploy_services(apps, timeout_s=300, replace_different=True)
    asyncio.run(_reset(address, [role for role in RESETTABLE if role in apps]))


RESETTABLE = {
    "rollout": (rollout_pb2_grpc.RolloutServiceStub, rollout_pb2.RolloutServiceResetRequest),
    "critic": (critic_pb2_grpc.CriticServiceStub, critic_pb2.CriticServiceResetRequest),
}
"""The stateful services and their Reset: back to the deployed initial weights."""


async def _reset(address: str, roles: list[str]) -> None:
    channel = open_channel(address)
    try:
        for role in roles:
            stub, request = RESETTABLE[role]
            client = ServiceClient(channel, stub, role, timeout_s=120)
            try:
                await client.call("Reset", request())
            finally:
                await client.close()
    finally:
        await channel.close()


REPLAYED_METRICS = [
    "reward_mean",
    "kl_mean",
    "entropy_mean",
    "actor/pg_loss",
    "critic/vf_loss",
    "response_length_mean",
    "weights_version",
]
"""What a replayed step must reproduce: it sees the same prompts, sampling seeds,
weights and optimizer state as the step it repeats."""


def assert_same_step_metrics(expected: list[dict], got: list[dict]) -> None:
    """Step records of a resumed or recovered run equal an uninterrupted run's (float noise
    aside), step by step."""
    assert [r["step"] for r in got] == [r["step"] for r in expected]
    for want, have in zip(expected, got, strict=True):
        for key in REPLAYED_METRICS:
            assert have[key] == pytest.approx(want[key], rel=1e-4, abs=1e-6), (have["step"], key)


REPO_ROOT = Path(__file__).resolve().parents[1]


def run_benchmark(module: str, *args: str, timeout_s: float) -> subprocess.CompletedProcess:
    """`python -m <module> <args>` from the repository root, output captured, failing
    the test (with the output's tail) unless it exits 0. Its environment lacks what would
    make it join the test session's Ray: a benchmark starts its own cluster."""
    joining = ("RAY_ADDRESS", "RAY_API_SERVER_ADDRESS", "RAY_TMPDIR")
    result = subprocess.run(
        [sys.executable, "-m", module, *args],
        cwd=REPO_ROOT,
        env={key: value for key, value in os.environ.items() if key not in joining},
        capture_output=True,
        text=True,
        timeout=timeout_s,
    )
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    return result


class BackgroundRun:
    """train_on_services in a thread, so a test can act on the cluster mid-run."""

    def __init__(self, config: RunConfig, inputs: RunInputs, run_dir: Path, address: str):
        self.metrics_path = run_dir / "metrics.jsonl"
        self.summary = None
        self.error: BaseException | None = None

        def train() -> None:
            try:
                self.summary = asyncio.run(
                    train_on_services(config, inputs, run_dir, address, show_progress=False)
                )
            except BaseException as error:  # raised in the test's thread
                self.error = error

        self.thread = threading.Thread(target=train, daemon=True)
        self.thread.start()

    def trained_steps(self) -> int:
        """The highest step trained so far (0 before the first)."""
        if not self.metrics_path.exists():
            return 0
        records = read_metrics(self.metrics_path)
        return max((r["step"] for r in records if "reward_mean" in r), default=0)

    def wait_for_steps(self, steps: int, timeout_s: float = 600) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and self.thread.is_alive():
            if self.trained_steps() >= steps:
                return
            time.sleep(0.1)
        if self.error is not None:  # the run's own failure says more than a missing step
            raise AssertionError(f"the run stopped before step {steps}") from self.error
        raise AssertionError(f"the run did not reach step {steps}")

    def finished(self, timeout_s: float = 600):
        """The run's summary once it ends; its error raised here if it failed."""
        self.thread.join(timeout=timeout_s)
        assert not self.thread.is_alive(), "the run did not finish"
        if self.error is not None:
            raise self.error
        return self.summary
