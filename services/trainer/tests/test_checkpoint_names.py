"""The trainer names service checkpoints relative to the root it deploys them with."""

import os

import pytest

from rlserve.core.checkpoint_paths import checkpoint_path
from rlserve.trainer.checkpoint import (
    checkpoint_dir,
    service_checkpoint_name,
    services_checkpoint_root,
)


def test_names_are_relative_to_the_runs_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    runs = "runs/embedded_default"  # relative, as in the default run config
    assert services_checkpoint_root(runs) == os.path.join(tmp_path, "runs", "embedded_default")
    run_dir = tmp_path / "runs" / "embedded_default" / "20261201-030000"
    name = service_checkpoint_name(runs, checkpoint_dir(run_dir, 10), "rollout")
    assert name == "20261201-030000/checkpoints/step_000010/rollout"
    # what the service makes of it: the same directory, inside its root
    root = services_checkpoint_root(runs)
    assert checkpoint_path(root, name) == (checkpoint_dir(run_dir, 10) / "rollout").resolve()


def test_a_run_outside_the_runs_directory_is_named_in_the_error(tmp_path):
    with pytest.raises(ValueError, match=r"not under trainer\.run_dir"):
        service_checkpoint_name(tmp_path / "runs", tmp_path / "elsewhere" / "step_000001", "critic")
