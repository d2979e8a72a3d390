"""The checkpoint directory protocol: staged, committed by rename, never overwritten."""

import pytest

from rlserve.trainer.checkpoint import (
    STATE_FILE,
    checkpoint_dir,
    commit_checkpoint,
    complete_checkpoints,
    latest_checkpoint,
    prune_checkpoints,
    staging_dir,
    start_staging,
    write_trainer_state,
)


def _save(run_dir, step):
    staging = start_staging(run_dir, step)
    (staging / "rollout").mkdir()
    (staging / "rollout" / "weights").write_bytes(bytes([step]))
    write_trainer_state(staging, {"step": step})
    commit_checkpoint(staging, checkpoint_dir(run_dir, step))


def test_a_staged_checkpoint_is_invisible_until_committed(tmp_path):
    _save(tmp_path, 1)
    staging = start_staging(tmp_path, 2)
    write_trainer_state(staging, {"step": 2})  # complete, but not yet renamed
    assert latest_checkpoint(tmp_path) == checkpoint_dir(tmp_path, 1)
    commit_checkpoint(staging, checkpoint_dir(tmp_path, 2))
    assert latest_checkpoint(tmp_path) == checkpoint_dir(tmp_path, 2)
    assert not staging_dir(tmp_path, 2).exists()


def test_a_complete_checkpoint_is_never_replaced(tmp_path):
    _save(tmp_path, 3)
    staging = start_staging(tmp_path, 3)
    write_trainer_state(staging, {"step": 3, "other": True})
    with pytest.raises(FileExistsError, match="never overwritten"):
        commit_checkpoint(staging, checkpoint_dir(tmp_path, 3))
    assert (checkpoint_dir(tmp_path, 3) / "rollout" / "weights").read_bytes() == bytes([3])


def test_an_incomplete_directory_of_that_name_is_replaced(tmp_path):
    """What a crash mid-save of older code (writing in place) left behind."""
    leftover = checkpoint_dir(tmp_path, 4) / "rollout"
    leftover.mkdir(parents=True)
    (leftover / "torn").write_bytes(b"x")
    _save(tmp_path, 4)
    assert not (leftover / "torn").exists()
    assert (checkpoint_dir(tmp_path, 4) / STATE_FILE).exists()


def test_retention_keeps_the_newest_complete_checkpoints(tmp_path):
    for step in (2, 4, 6, 8):
        _save(tmp_path, step)
    start_staging(tmp_path, 10)  # a save in progress is no checkpoint and is not counted
    (tmp_path / "checkpoints" / "step_000001-notes").mkdir()  # nor is a stray directory
    removed = prune_checkpoints(tmp_path, keep=2)
    assert removed == [checkpoint_dir(tmp_path, 2), checkpoint_dir(tmp_path, 4)]
    assert complete_checkpoints(tmp_path) == [
        checkpoint_dir(tmp_path, 6),
        checkpoint_dir(tmp_path, 8),
    ]
    assert staging_dir(tmp_path, 10).exists()
    assert prune_checkpoints(tmp_path, keep=None) == []
