"""Redeploying one service while a PPO run uses it: `rlserve service deploy` replaces the
reward service's replicas with a changed config mid-run, every step before, during and
after succeeds, and the other services are not touched. The run is long and stopped
through the trainer's own control service (TrainerService.Stop) a few steps after the
redeploy, so the redeploy lands mid-run however slow the machine is."""

import os
import stat
import subprocess
import sys
from pathlib import Path

import grpc
import ray
import yaml

from integration_tests.support import BackgroundRun, fresh_services, run_inputs, tiny_run_config
from rlserve.core import auth
from rlserve.core.placement import serve_replicas
from rlserve.core.rpc import call_metadata
from rlserve.trainer.deploy import declared_applications
from rlserve.trainer.metrics import read_metrics
from rlserve.v1 import trainer_pb2, trainer_pb2_grpc

TOTAL_STEPS = 500  # an upper bound: the test stops the run
STEPS_AFTER_REDEPLOY = 3


def _replica_ids(app: str) -> set[str]:
    return {replica["replica_id"] for replica in serve_replicas(app)}


def test_reward_redeployed_mid_run_and_no_step_fails(serve_cluster, embedded, tmp_path):
    config = tiny_run_config(tmp_path, trainer={"total_steps": TOTAL_STEPS, "control_port": 0})
    inputs = run_inputs(embedded)
    fresh_services(config, inputs)
    untouched = {role: _replica_ids(role) for role in ("rollout", "critic", "reference")}
    old_reward = _replica_ids("reward")
    assert len(old_reward) == 1

    # The new reward config: two replicas and a different batch limit (a constructor
    # argument, so Serve must start new replicas rather than adjust the old one).
    reward_app = declared_applications()["reward"]
    reward_app["args"].update(num_replicas=2, max_batch_samples=1000)
    serve_file = tmp_path / "reward.yaml"
    serve_file.write_text(yaml.safe_dump({"applications": [reward_app]}))

    run = BackgroundRun(config, inputs, tmp_path, serve_cluster.grpc_address)
    run.wait_for_steps(2)
    address = ray.get_runtime_context().gcs_address
    cli = [str(Path(sys.executable).parent / "rlserve"), "service", "--address", address]
    deployed = subprocess.run(
        [*cli, "--timeout-s", "300", "deploy", str(serve_file)],
        capture_output=True,
        text=True,
        timeout=400,
    )
    assert deployed.returncode == 0, deployed.stderr[-3000:]
    steps_at_redeploy_end = run.trained_steps()
    run.wait_for_steps(steps_at_redeploy_end + STEPS_AFTER_REDEPLOY)
    # from another shell: `rlserve run status RUN_DIR` finds the trainer and its token
    assert stat.S_IMODE((tmp_path / "control_token").stat().st_mode) == 0o600
    status_command = subprocess.run(
        [str(Path(sys.executable).parent / "rlserve"), "run", "status", str(tmp_path)],
        capture_output=True, text=True, timeout=120, env=_without_token(),
    )  # fmt: skip
    assert status_command.returncode == 0, status_command.stderr
    assert status_command.stdout.startswith("RUN_STATE_RUNNING: step "), status_command.stdout
    control = grpc.insecure_channel((tmp_path / "control_address").read_text().strip())
    trainer = trainer_pb2_grpc.TrainerServiceStub(control)
    status = trainer.GetStatus(
        trainer_pb2.GetStatusRequest(), metadata=call_metadata(None), timeout=30
    )
    assert status.state == trainer_pb2.RUN_STATE_RUNNING and status.total_steps == TOTAL_STEPS
    health = {service.role: service for service in status.services}
    assert sorted(health) == ["critic", "reference", "reward", "rollout"]
    assert all(service.healthy for service in health.values()), status.services
    assert health["rollout"].weights_version >= steps_at_redeploy_end
    stop_after = trainer.Stop(
        trainer_pb2.StopRequest(checkpoint=False), metadata=call_metadata(None), timeout=30
    ).after_step
    summary = run.finished()
    control.close()
    records = read_metrics(tmp_path / "metrics.jsonl")
    steps = [r["step"] for r in records if "reward_mean" in r]  # training records only
    final = summary.steps
    # Stop lands after the step in progress (or, at a step boundary, before the next one).
    assert final in (stop_after - 1, stop_after)
    assert steps == list(range(1, final + 1))
    assert 2 <= steps_at_redeploy_end <= final - STEPS_AFTER_REDEPLOY

    new_reward = _replica_ids("reward")
    assert len(new_reward) == 2 and not (new_reward & old_reward)
    assert declared_applications()["reward"]["args"]["max_batch_samples"] == 1000
    for role, replicas in untouched.items():
        assert _replica_ids(role) == replicas, f"{role} was redeployed"


def _without_token() -> dict[str, str]:
    """This environment minus the token: the command must take it from the run dir."""
    return {k: v for k, v in os.environ.items() if k not in (auth.TOKEN_ENV, auth.TOKEN_FILE_ENV)}
