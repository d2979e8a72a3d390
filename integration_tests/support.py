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
from rlserve.core.run_config import RunConfig
from rlserve.trainer.deploy import deploy_services, service_args
from rlserve.trainer.metrics import read_metrics
from rlserve.trainer.run import RunInputs, train_on_services

TRACED_SERVICES = {
    "rlserve-trainer",
    "rlserve-rollout",
    "rlserve-reference",
    "rlserve-critic",
    "rlserve-reward",
}
"""service.name of every process a traced PPO step crosses."""


def tiny_run_config(run_dir: Path, **sections) -> RunConfig:
    """A run of a few fast steps; `sections` override whole sections' fields."""
    data = {
        "rollout": {"max_new_tokens": 3, "eval_prompts": 32, "eval_every_steps": 0},
        "actor": {"ppo_mini_batch_prompts": 8, "micro_batch_samples": 8, "ppo_epochs": 1},
        "critic": {"ppo_mini_batch_prompts": 8, "micro_batch_samples": 8, "ppo_epochs": 1},
        "trainer": {
            "total_steps": 3,
            "prompts_per_step": 16,
            "checkpoint_every_steps": 0,
            "run_dir": str(run_dir),
            "control_port": None,
        },
    }
    for section, fields in sections.items():
        data.setdefault(section, {}).update(fields)
    return validate_config(RunConfig, data)


def run_inputs(embedded) -> RunInputs:
    """The run inputs of the session's warmed-up embedded model (conftest `embedded`)."""
    return RunInputs(str(embedded.model_dir), str(embedded.train_path), str(embedded.eval_path))


def fresh_services(config: RunConfig, inputs: RunInputs) -> None:
    """Redeploys from scratch so each test starts from the initial weights."""
    from ray import serve

    for role in ("rollout", "critic", "reference", "reward", "environment"):
        serve.delete(role)
    deploy_services(service_args(config, inputs.model_dir), timeout_s=300)


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
