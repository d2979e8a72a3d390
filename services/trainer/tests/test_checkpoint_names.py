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


def test_a_run_reached_through_a_symlink_is_named_inside_the_root(tmp_path):
    runs = tmp_path / "runs"
    (runs / "20261201-030000").mkdir(parents=True)
    link = tmp_path / "link"
    link.symlink_to(runs)
    for runs_dir, run_dir in ((link, runs / "20261201-030000"), (runs, link / "20261201-030000")):
        name = service_checkpoint_name(runs_dir, checkpoint_dir(run_dir, 2), "critic")
        assert name == "20261201-030000/checkpoints/step_000002/critic"
        assert checkpoint_path(services_checkpoint_root(runs_dir), name) == (
            checkpoint_dir(runs / "20261201-030000", 2) / "critic"
        )


def test_resuming_from_another_directory_fails_before_any_cluster(tmp_path, monkeypatch):
    """trainer.run_dir is relative in the default config: resumed from another working
    directory it names another root, which the services could not load the run from."""
    from rlserve.core.config import ConfigError, validate_config
    from rlserve.core.run_config import RunConfig
    from rlserve.trainer.checkpoint import write_trainer_state
    from rlserve.trainer.run import train

    run_dir = tmp_path / "first" / "runs" / "embedded_default" / "20261201-030000"
    checkpoint = checkpoint_dir(run_dir, 2)
    checkpoint.mkdir(parents=True)
    write_trainer_state(checkpoint, {"step": 2})
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")
    config = validate_config(RunConfig, {"trainer": {"run_dir": "runs/embedded_default"}})
    with pytest.raises(ConfigError, match=r"trainer\.run_dir.*not under trainer\.run_dir"):
        train(config, run_dir, resume=True)
