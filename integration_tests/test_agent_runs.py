"""Whole multi-turn runs on the session's cluster.

- Tools that fail, each run ending as its config asks with the failures counted in its
  metrics: a hung tool (timeout), a tool raising errors, and the environment replica
  SIGKILLed mid-run.
- One-step-off generation with rollout correction on multi-turn batches.

The policy is the tiny model taught one tool-using conversation (agent_support.py):
every response calls "calc" once, so every sample meets the fault. GRPO without a KL
term, so the runs deploy the rollout, reward and environment services only.
"""

import asyncio
import os
import signal
import time
from pathlib import Path

import pytest
from ray import serve

from integration_tests.agent_support import agent_run_config
from integration_tests.support import (
    BackgroundRun,
    deployed_services,
    fresh_services,
    session_runs_root,
)
from rlserve.core.placement import serve_replicas
from rlserve.trainer.metrics import read_metrics
from rlserve.trainer.run import RunInputs, train_on_services

pytestmark = pytest.mark.slow

SAMPLES = 4 * 2  # agent_run_config's prompts per step x responses per prompt


@pytest.fixture(scope="module", autouse=True)
def no_environment_left(serve_cluster):
    yield
    serve.delete("environment")


def _train(config, inputs: RunInputs, run_dir: Path, address: str):
    deployed_services(config, inputs, address)
    return asyncio.run(train_on_services(config, inputs, run_dir, address, show_progress=False))


def _steps(run_dir: Path) -> list[dict]:
    return [r for r in read_metrics(run_dir / "metrics.jsonl") if "reward_mean" in r]


def _every_sample_called_once(step: dict) -> None:
    assert step["samples"] == SAMPLES  # never short
    assert step["generate/agent/samples"] == SAMPLES
    assert step["generate/agent/tool_calls"] == SAMPLES


def test_a_hung_tool_times_out_and_zero_reward_scores_its_responses_0(
    serve_cluster, agent_inputs, tmp_path
):
    calc = {"tool": "integration_tests.agent_tools:Hang", "timeout_s": 0.5}
    config = agent_run_config(
        tmp_path,
        calc,
        "zero_reward",
        reward_rule="integration_tests.agent_tools:score_every_response_1",
        runs_root=session_runs_root(tmp_path),
    )
    started = time.monotonic()
    summary = _train(config, agent_inputs, tmp_path, serve_cluster.grpc_address)
    assert summary.steps == 3
    for step in _steps(tmp_path):
        _every_sample_called_once(step)
        assert step["generate/agent/errors_timeout"] == SAMPLES
        assert step["generate/agent/tool_errors"] == SAMPLES
        assert step["reward_mean"] == 0.0
    # the calls waited their 0.5 s, not the tool's hour
    assert time.monotonic() - started < 600


def test_a_raising_tool_is_an_error_observation_and_drop_sample_trains_on_nothing(
    serve_cluster, agent_inputs, tmp_path
):
    calc = {"tool": "integration_tests.agent_tools:Broken"}
    summary = _train(
        agent_run_config(tmp_path, calc, "drop_sample", runs_root=session_runs_root(tmp_path)),
        agent_inputs,
        tmp_path,
        serve_cluster.grpc_address,
    )
    assert summary.steps == 3
    for step in _steps(tmp_path):
        _every_sample_called_once(step)
        assert step["generate/agent/errors_tool_error"] == SAMPLES
        assert step["agent/dropped_samples"] == SAMPLES
        assert step["actor/pg_loss"] == 0.0  # every advantage dropped


def test_a_killed_environment_replica_is_absorbed_and_the_run_goes_on(
    serve_cluster, agent_inputs, tmp_path
):
    """The calculator's replica SIGKILLed after step 2: Serve replaces it; calls made
    meanwhile are retried or queued, or answered as counted errors ("continue" keeps
    their responses); the run finishes every step, and its last steps' calls are all
    answered by the new replica."""
    total_steps = 8
    config = agent_run_config(tmp_path, {"tool": "calculator"}, "continue", total_steps)
    fresh_services(config, agent_inputs)
    run = BackgroundRun(config, agent_inputs, tmp_path, serve_cluster.grpc_address)
    run.wait_for_steps(2, timeout_s=300)
    (replica,) = serve_replicas("environment")
    os.kill(replica["pid"], signal.SIGKILL)
    assert run.finished().steps == total_steps
    steps = _steps(tmp_path)
    assert [s["step"] for s in steps] == list(range(1, total_steps + 1))
    for step in steps:
        assert step["samples"] == SAMPLES and step["generate/agent/samples"] == SAMPLES
        errors = sum(v for k, v in step.items() if k.startswith("generate/agent/errors_"))
        assert errors == step.get("generate/agent/tool_errors", 0.0)  # every failure counted
    last = steps[-1]
    assert last["generate/agent/tool_calls"] == SAMPLES
    assert last.get("generate/agent/tool_errors", 0.0) == 0.0
    assert last["reward_mean"] > 0
    (new_replica,) = serve_replicas("environment")
    assert new_replica["pid"] != replica["pid"]


def test_one_step_off_with_rollout_correction_runs_on_multi_turn_batches(
    serve_cluster, agent_inputs, tmp_path
):
    """Step 1 generates with the weights the trainer scores (version 0): the engine's
    log-probs and the trainer's agree on the model's tokens, so the observation tokens
    (engine log-prob 0, mask 0) must be out of the correction, or its mismatch would be
    large. Later steps generate one version behind and are corrected."""
    config = agent_run_config(
        tmp_path,
        {"tool": "calculator"},
        total_steps=4,
        rollout_mode="one_step_off",
        runs_root=session_runs_root(tmp_path),
    )
    summary = _train(config, agent_inputs, tmp_path, serve_cluster.grpc_address)
    assert summary.steps == 4
    steps = _steps(tmp_path)
    for step in steps:
        _every_sample_called_once(step)
        assert step.get("generate/agent/tool_errors", 0.0) == 0.0
        assert 0.0 < step["rollout_is/is_weight_mean"] < 2.0
    assert abs(steps[0]["rollout_is/mismatch_kl"]) < 1e-3
