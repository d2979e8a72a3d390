"""Real kills (SIGKILL, as the kernel's or Ray's memory monitor would) of service processes:
Serve replaces a replica whose worker died, and a PPO run that loses services mid-way
recovers from its last checkpoint and ends with the metrics of an uninterrupted run."""

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest

from integration_tests.support import (
    BackgroundRun,
    assert_same_step_metrics,
    deployed_services,
    fresh_services,
    run_inputs,
    session_runs_root,
    tiny_run_config,
)
from rlserve.core.config import dump_config
from rlserve.core.placement import serve_replicas
from rlserve.core.rpc import ServiceClient, call_metadata, open_channel
from rlserve.trainer import doctor
from rlserve.trainer.metrics import read_metrics
from rlserve.trainer.run import train_on_services
from rlserve.v1 import critic_pb2, critic_pb2_grpc, rollout_pb2, rollout_pb2_grpc

pytestmark = pytest.mark.slow

REPLACED_WITHIN_S = 120


def _client(address: str, stub_cls: type, app: str) -> ServiceClient:
    return ServiceClient(open_channel(address), stub_cls, app, timeout_s=30)


async def _info(client: ServiceClient, request: object):
    return (
        await client.stub.GetInfo(request, metadata=call_metadata(client.application), timeout=10)
    ).info


def _worker_pids(address: str, role: str) -> list[int]:
    stub, request = {
        "rollout": (
            rollout_pb2_grpc.RolloutServiceStub,
            rollout_pb2.RolloutServiceGetInfoRequest(),
        ),
        "critic": (critic_pb2_grpc.CriticServiceStub, critic_pb2.CriticServiceGetInfoRequest()),
    }[role]

    async def pids() -> list[int]:  # a grpc.aio channel belongs to the loop that made it
        info = await _info(_client(address, stub, role), request)
        return [worker.pid for worker in info.workers]

    return asyncio.run(pids())


def _doctor_sees_healthy_workers(address: str, worker_pids: list[int]) -> None:
    """`rlserve doctor`, run as a user would against this cluster, and its report."""
    import ray

    gcs_address = ray.get_runtime_context().gcs_address
    command = [sys.executable, "-m", "rlserve.trainer.cli", "doctor", "--address", gcs_address]
    done = subprocess.run([*command, "--target", address], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "ActorWorker" in done.stdout and "rollout" in done.stdout, done.stdout

    report = doctor.collect(address)
    rollout = next(app for app in report.apps if app.name == "rollout")
    assert rollout.healthy and rollout.info.weights_version == 0
    workers = [p for p in rollout.processes if p.kind == "ActorWorker"]
    assert sorted(p.pid for p in workers) == sorted(worker_pids)
    # a worker holds torch and a model: far more than an empty Python process
    assert all(p.resident_bytes > 100 * 2**20 for p in workers), workers
    assert [p.kind for p in rollout.processes].count("replica") == 1


def _doctor_sees_dead_worker(address: str) -> None:
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        report = doctor.collect(address)
        rollout = next(app for app in report.apps if app.name == "rollout")
        if rollout.problem:
            assert "UNAVAILABLE" in rollout.problem and "rank 1 worker died" in rollout.problem
            assert not report.healthy
            assert "! GetInfo: UNAVAILABLE" in doctor.format_report(report)
            return
        time.sleep(0.5)
    raise AssertionError("doctor never reported the dead worker")


def test_a_replica_whose_worker_died_answers_unavailable_then_is_replaced(
    serve_cluster, embedded, tmp_path
):
    config = tiny_run_config(tmp_path, actor={"workers": 2, "micro_batch_samples": 4})
    fresh_services(config, run_inputs(embedded))
    address = serve_cluster.grpc_address
    request = rollout_pb2.RolloutServiceGetInfoRequest()
    pids = _worker_pids(address, "rollout")
    _doctor_sees_healthy_workers(address, pids)
    os.kill(pids[1], signal.SIGKILL)
    _doctor_sees_dead_worker(address)

    async def watch() -> tuple[list[str], list[int]]:
        client = _client(address, rollout_pb2_grpc.RolloutServiceStub, "rollout")
        refusals: list[str] = []
        deadline = time.monotonic() + REPLACED_WITHIN_S
        while time.monotonic() < deadline:
            try:
                info = await _info(client, request)
            except grpc.aio.AioRpcError as error:
                refusals.append(f"{error.code().name}: {error.details()}")
            else:
                new_pids = [worker.pid for worker in info.workers]
                if not set(new_pids) & set(pids):
                    return refusals, new_pids
            await asyncio.sleep(0.5)
        raise AssertionError(f"rollout replica not replaced within {REPLACED_WITHIN_S} s")

    refusals, new_pids = asyncio.run(watch())
    # Before the replacement the replica says what is wrong instead of answering OK.
    assert any(r.startswith("UNAVAILABLE") and "rank 1 worker died" in r for r in refusals)
    assert len(new_pids) == 2
    # The new replica serves: a generation from fresh weights succeeds.
    from rlserve.core.codec import batch_to_proto
    from rlserve.core.modeling import load_tokenizer
    from rlserve.trainer.data import load_prompt_rows, prompt_batch

    tokenizer = load_tokenizer(str(embedded.model_dir))
    rows = load_prompt_rows(embedded.eval_path, tokenizer, "prompt", "ground_truth", 64, "drop")

    async def generate():
        client = _client(address, rollout_pb2_grpc.RolloutServiceStub, "rollout")
        return await client.call(
            "GenerateSequences",
            rollout_pb2.GenerateSequencesRequest(
                prompts=batch_to_proto(prompt_batch(rows.rows[:4], tokenizer)),
                sampling=rollout_pb2.SamplingParams(temperature=1.0, max_new_tokens=3),
            ),
        )

    response = asyncio.run(generate())
    assert response.batch.meta.weights_version == 0


def _kill_reward_replica() -> None:
    (replica,) = serve_replicas("reward")
    os.kill(replica["pid"], signal.SIGKILL)


TOTAL_STEPS = 6
CHECKPOINT_EVERY_STEPS = 2


def _steps(run_dir: Path) -> list[dict]:
    return [r for r in read_metrics(run_dir / "metrics.jsonl") if "reward_mean" in r]


@pytest.fixture(scope="module")
def uninterrupted(serve_cluster, embedded, tmp_path_factory) -> list[dict]:
    """Per-step metrics of the run both recovery tests must reproduce (a checkpoint's
    directory does not change what a step computes)."""
    runs = tmp_path_factory.mktemp("uninterrupted")
    config = _fault_run_config(runs, session_runs_root(runs))
    inputs = run_inputs(embedded)
    deployed_services(config, inputs, serve_cluster.grpc_address)
    asyncio.run(
        train_on_services(config, inputs, runs, serve_cluster.grpc_address, show_progress=False)
    )
    return _steps(runs)


def _fault_run_config(runs: Path, runs_root: Path | None = None, **trainer):
    return tiny_run_config(
        runs,
        runs_root,
        trainer={
            "total_steps": TOTAL_STEPS,
            "checkpoint_every_steps": CHECKPOINT_EVERY_STEPS,
            **trainer,
        },
    )


def _assert_same_steps(expected: list[dict], got: list[dict]) -> None:
    assert [r["step"] for r in got] == list(range(1, TOTAL_STEPS + 1))  # each step once
    assert_same_step_metrics(expected, got)


def test_a_run_that_loses_workers_and_a_replica_recovers_with_uninterrupted_metrics(
    serve_cluster, embedded, uninterrupted, tmp_path
):
    config = _fault_run_config(tmp_path, session_runs_root(tmp_path))
    inputs = run_inputs(embedded)
    address = serve_cluster.grpc_address
    deployed_services(config, inputs, address)
    run = BackgroundRun(config, inputs, tmp_path, address)
    kills = [
        (1, lambda: os.kill(_worker_pids(address, "critic")[0], signal.SIGKILL)),
        (3, lambda: os.kill(_worker_pids(address, "rollout")[0], signal.SIGKILL)),
        (4, _kill_reward_replica),
    ]
    for step, kill in kills:
        run.wait_for_steps(step, timeout_s=300)
        kill()
    summary = run.finished()
    for event in summary.recoveries:
        print(f"recovery: {event}")
    assert summary.steps == TOTAL_STEPS
    rollbacks = [event for event in summary.recoveries if event.rolled_back]
    assert len(rollbacks) >= 2, summary.recoveries
    for event in rollbacks:
        assert event.restored_step % CHECKPOINT_EVERY_STEPS == 0
        assert event.restored_step <= event.failed_step
    _assert_same_steps(uninterrupted, _steps(tmp_path))


def _serve_proxy_pid() -> int:
    import ray

    (proxy,) = [
        actor
        for actor in ray.util.list_named_actors(all_namespaces=True)
        if actor["name"].startswith("SERVE_PROXY_ACTOR")
    ]
    handle = ray.get_actor(proxy["name"], namespace=proxy["namespace"])
    return ray.get(handle.__ray_call__.remote(lambda _: os.getpid()), timeout=30)


def test_a_restart_of_serves_proxy_mid_run_rolls_nothing_back(
    serve_cluster, embedded, uninterrupted, tmp_path
):
    """Every call through Serve's proxy, which is SIGKILLed mid-run (Serve starts a new
    one within ~20 s), and later the reward replica (stateless): the stateful services
    kept their state both times, so the run waits and goes on from where it stood, with
    the metrics of an uninterrupted run and no checkpoint restored."""
    config = _fault_run_config(tmp_path, session_runs_root(tmp_path), call_routes="proxy")
    inputs = run_inputs(embedded)
    deployed_services(config, inputs, serve_cluster.grpc_address)
    run = BackgroundRun(config, inputs, tmp_path, serve_cluster.grpc_address)
    run.wait_for_steps(2, timeout_s=300)
    proxy_pid = _serve_proxy_pid()
    os.kill(proxy_pid, signal.SIGKILL)
    run.wait_for_steps(4, timeout_s=300)
    _kill_reward_replica()
    summary = run.finished()
    for event in summary.recoveries:
        print(f"recovery: {event}")
    assert _serve_proxy_pid() != proxy_pid  # the proxy was replaced
    assert set(summary.calls_by_route) == {"proxy"}
    # the proxy's outage outlives the calls' retries; Serve may queue the calls during
    # the reward replica's replacement, which then needs no recovery at all
    assert summary.recoveries, "the proxy's restart went unnoticed"
    assert not [event for event in summary.recoveries if event.rolled_back]
    _assert_same_steps(uninterrupted, _steps(tmp_path))


def _cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "rlserve.trainer.cli", *args]


def test_a_killed_trainer_resumes_with_every_step_once_and_uninterrupted_metrics(
    serve_cluster, embedded, uninterrupted, tmp_path
):
    """The trainer process SIGKILLed mid-run (services keep whatever they were doing);
    `rlserve resume` brings every service back to the last checkpoint and finishes."""
    import ray

    config = _fault_run_config(tmp_path)
    inputs = run_inputs(embedded)
    address = serve_cluster.grpc_address
    fresh_services(config, inputs)
    config_file = tmp_path / "run.yaml"
    config_file.write_text(dump_config(config))
    joins_this_cluster = [
        f"model.path={inputs.model_dir}",
        f"data.train_path={inputs.train_path}",
        f"data.eval_path={inputs.eval_path}",
        f"trainer.ray_address={ray.get_runtime_context().gcs_address}",
        f"trainer.serve_grpc_port={address.rsplit(':', 1)[1]}",
    ]
    log_path = tmp_path / "trainer.log"
    with log_path.open("w") as log:
        trainer = subprocess.Popen(
            _cli("train", "--config", str(config_file), *joins_this_cluster),
            stdout=log,
            stderr=log,
        )
        try:
            deadline = time.monotonic() + 300
            while trainer.poll() is None and time.monotonic() < deadline:
                metrics = list(tmp_path.glob("*/metrics.jsonl"))
                if metrics and any(
                    r["step"] >= 3 and "reward_mean" in r for r in read_metrics(metrics[0])
                ):
                    break
                time.sleep(0.1)
            assert trainer.poll() is None, log_path.read_text()[-3000:]
            trainer.kill()
        finally:
            trainer.wait()
    (run_dir,) = [p.parent for p in tmp_path.glob("*/metrics.jsonl")]
    resumed = subprocess.run(
        _cli("resume", str(run_dir)), capture_output=True, text=True, timeout=600
    )
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    _assert_same_steps(uninterrupted, _steps(run_dir))
