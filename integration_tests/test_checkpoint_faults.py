"""A checkpoint save that fails part-way, on a real filesystem that fills up: the run
keeps its last complete checkpoint and resumes from it.

The run directory lives on a small tmpfs mounted for the test (this needs root, as the
CI machines run); the services write their real DeepSpeed/safetensors checkpoints there.
"""

import asyncio
import os
import shutil
import subprocess
import time
from pathlib import Path

import grpc
import pytest

from integration_tests.support import deployed_services, run_inputs, tiny_run_config
from rlserve.trainer.checkpoint import checkpoint_dir, latest_checkpoint, staging_dir
from rlserve.trainer.metrics import read_metrics
from rlserve.trainer.run import train_on_services

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("mount") is None, reason="mounting a tmpfs needs root"
)
ROOMY_BYTES = 512 * 2**20


def _mount(path: Path, size_bytes: int, remount: bool = False) -> None:
    options = f"size={size_bytes}" + (",remount" if remount else "")
    subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)], check=True)


def _used_bytes(path: Path) -> int:
    stats = os.statvfs(path)
    return (stats.f_blocks - stats.f_bfree) * stats.f_frsize


def _tree_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def test_a_save_that_fills_the_disk_leaves_the_last_checkpoint_to_resume(
    serve_cluster, embedded, tmp_path
):
    disk = tmp_path / "disk"
    disk.mkdir()
    _mount(disk, ROOMY_BYTES)
    try:
        run_dir = disk / "run"
        run_dir.mkdir()
        inputs = run_inputs(embedded)

        def run(total_steps, resume_from=None):
            config = tiny_run_config(
                disk,
                trainer={"total_steps": total_steps, "checkpoint_every_steps": 1},
                rollout={"eval_prompts": 8},
            )
            if resume_from is None:
                deployed_services(config, inputs, serve_cluster.grpc_address)
            return asyncio.run(
                train_on_services(
                    config, inputs, run_dir, serve_cluster.grpc_address, resume_from, False
                )
            )

        run(1)
        first = checkpoint_dir(run_dir, 1)
        assert latest_checkpoint(run_dir) == first
        # room for half of step 2's checkpoint: its save fails part-way
        _mount(disk, _used_bytes(disk) + _tree_bytes(first) // 2, remount=True)
        with pytest.raises(grpc.aio.AioRpcError) as failed:
            run(2, resume_from=first)
        assert failed.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "writing failed" in failed.value.details()
        assert "MiB free on its filesystem" in failed.value.details()
        assert latest_checkpoint(run_dir) == first
        assert not checkpoint_dir(run_dir, 2).exists()
        assert staging_dir(run_dir, 2).exists()

        _mount(disk, ROOMY_BYTES, remount=True)
        summary = run(2, resume_from=latest_checkpoint(run_dir))
        assert Path(summary.checkpoint) == latest_checkpoint(run_dir) == checkpoint_dir(run_dir, 2)
        assert not staging_dir(run_dir, 2).exists()
        steps = [r["step"] for r in read_metrics(run_dir / "metrics.jsonl") if "reward_mean" in r]
        assert steps == [1, 2]
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=False)


SAVE_FAULT_APP = "critic-save-fault"


def _critic_info(stub):
    from rlserve.core.rpc import call_metadata
    from rlserve.v1 import critic_pb2

    return stub.GetInfo(
        critic_pb2.CriticServiceGetInfoRequest(),
        metadata=call_metadata(SAVE_FAULT_APP),
        timeout=10,
    ).info


def test_a_save_failing_on_rank_0_fails_in_seconds_and_the_replica_is_replaced(
    serve_cluster, tiny_model_dir, tmp_path
):
    """Two critic ranks and a disk too small for rank 0's model files: rank 1 goes on into
    DeepSpeed's save collectives and would wait there for the process group's 30-minute
    timeout. The call fails at once naming the write, the service reports itself broken,
    and Serve replaces the replica (fresh workers, initial weights)."""
    from ray import serve

    from rlserve.core.rpc import call_metadata
    from rlserve.critic.app import build_app
    from rlserve.v1 import critic_pb2, critic_pb2_grpc

    disk = tmp_path / "disk"
    disk.mkdir()
    _mount(disk, 16 * 2**10)  # a few pages: no room for the model's safetensors
    args = {
        "model_path": str(tiny_model_dir),
        "checkpoint_root": str(disk),
        "workers": 2,
        "num_cpus_per_worker": 1,
    }
    serve.run(build_app(args), name=SAVE_FAULT_APP, route_prefix=f"/{SAVE_FAULT_APP}")
    channel = serve_cluster.channel()
    stub = critic_pb2_grpc.CriticServiceStub(channel)
    try:
        pids = sorted(worker.pid for worker in _critic_info(stub).workers)
        assert len(pids) == 2
        started = time.monotonic()
        with pytest.raises(grpc.RpcError) as failed:
            stub.SaveCheckpoint(
                critic_pb2.CriticServiceSaveCheckpointRequest(location={"path": "step_1"}),
                metadata=call_metadata(SAVE_FAULT_APP),
                timeout=300,
            )
        assert time.monotonic() - started < 60
        assert failed.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "writing failed" in failed.value.details()
        assert "marked broken" in failed.value.details()

        # broken until Serve replaces it; then fresh workers answer
        problems, deadline = [], time.monotonic() + 180
        while time.monotonic() < deadline:
            try:
                info = _critic_info(stub)
            except grpc.RpcError as error:
                problems.append(f"{error.code().name}: {error.details()}")
            else:
                new_pids = sorted(worker.pid for worker in info.workers)
                if not set(new_pids) & set(pids):
                    break
            time.sleep(0.5)
        else:
            raise AssertionError(f"the replica was not replaced; GetInfo said {problems[-3:]}")
        assert any("SaveCheckpoint failed part-way" in problem for problem in problems), problems
        assert info.weights_version == 0 and len(new_pids) == 2
    finally:
        channel.close()
        serve.delete(SAVE_FAULT_APP)
        subprocess.run(["umount", "-l", str(disk)], check=False)
