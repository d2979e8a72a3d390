"""Checkpoint paths stay under the service's root; unusable directories are named."""

import os

import grpc
import pytest

from rlserve.core.checkpoint_paths import checkpoint_path, prepare_save_dir, require_load_dir
from rlserve.core.serving import RpcError

INVALID = grpc.StatusCode.INVALID_ARGUMENT
PRECONDITION = grpc.StatusCode.FAILED_PRECONDITION


def refused(call, *args) -> RpcError:
    with pytest.raises(RpcError) as error:
        call(*args)
    return error.value


def test_relative_names_resolve_inside_the_root(tmp_path):
    assert checkpoint_path(str(tmp_path), "step_000010/rollout") == (
        tmp_path.resolve() / "step_000010" / "rollout"
    )
    assert checkpoint_path(str(tmp_path), "./a/./b") == tmp_path.resolve() / "a" / "b"
    (tmp_path / "real").mkdir()
    (tmp_path / "inside").symlink_to(tmp_path / "real")  # a symlink within the root is fine
    assert checkpoint_path(str(tmp_path), "inside/x") == tmp_path.resolve() / "real" / "x"


@pytest.mark.parametrize(
    ("name", "problem"),
    [
        ("", "is empty"),
        ("a\x00b", "contains a NUL byte"),
        ("/etc/cron.d", "is absolute"),
        ("/proc/self/mem", "is absolute"),
        ("../outside", "climbs out with '..'"),
        ("step/../../outside", "climbs out with '..'"),
        (".", "names the checkpoint root itself"),
        ("escape/x", "outside the checkpoint root through a symlink"),
    ],
)
def test_names_that_could_leave_the_root_are_invalid_argument(tmp_path, name, problem):
    root = tmp_path / "root"
    root.mkdir()
    (root / "escape").symlink_to(tmp_path)
    error = refused(checkpoint_path, str(root), name)
    assert error.code == INVALID
    assert error.message.startswith("location.path: ") and problem in error.message
    assert "relative to the service's checkpoint root" in error.message


@pytest.mark.parametrize(
    ("name", "problem"),
    [
        ("a" * 256, "has a component of 256 bytes; this filesystem allows 255"),
        ("step/" + "é" * 128, "has a component of 256 bytes"),  # bytes, not characters
        ("/".join(["d" * 200] * 25), "makes a path of"),
    ],
)
def test_names_over_the_filesystem_limits_are_invalid_argument(tmp_path, name, problem):
    error = refused(checkpoint_path, str(tmp_path), name)
    assert error.code == INVALID
    assert error.message.startswith("location.path: ") and problem in error.message
    assert len(error.message) < 300  # the name is shortened, not echoed whole


def test_names_at_the_limits_resolve(tmp_path):
    assert checkpoint_path(str(tmp_path), "a" * 255).name == "a" * 255


def test_a_service_without_a_root_refuses_checkpoints():
    error = refused(checkpoint_path, None, "step_1/rollout")
    assert error.code == PRECONDITION and "checkpoint_root" in error.message


def test_save_dir_is_created_or_named_with_the_reason(tmp_path):
    prepare_save_dir(tmp_path / "a" / "b")
    assert (tmp_path / "a" / "b").is_dir()
    (tmp_path / "file").write_text("x")
    for target, reason in (
        (tmp_path / "file", "it is a file"),
        (tmp_path / "file" / "below", f"{tmp_path / 'file'} is a file"),
    ):
        error = refused(prepare_save_dir, target)
        assert error.code == PRECONDITION
        assert error.message.startswith(f"location.path: cannot save a checkpoint at {target}")
        assert reason in error.message


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes anywhere")
def test_unwritable_save_dir_is_failed_precondition(tmp_path):
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    error = refused(prepare_save_dir, locked / "ckpt")
    assert error.code == PRECONDITION and "cannot create it" in error.message


def test_load_dir_must_exist_as_a_directory(tmp_path):
    require_load_dir(tmp_path, "rollout checkpoint")
    error = refused(require_load_dir, tmp_path / "missing", "rollout checkpoint")
    assert error.code == PRECONDITION and "no rollout checkpoint at" in error.message
    (tmp_path / "file").write_text("x")
    error = refused(require_load_dir, tmp_path / "file", "rollout checkpoint")
    assert error.code == PRECONDITION and "is a file" in error.message
