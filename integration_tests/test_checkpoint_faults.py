"""A checkpoint save that fails part-way, on a real filesystem that fills up: the run
keeps its last complete checkpoint and resumes from it.

The run directory lives on a small tmpfs mounted for the test (this needs root, as the
CI machines run); the services write their real DeepSpeed/safetensors checkpoints there.
"""

import asyncio
import os
import shutil
import subprocess
from pathlib import Path

import grpc
import pytest

from integration_tests.support import fresh_services, run_inputs, tiny_run_config
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
                fresh_services(config, inputs)
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
