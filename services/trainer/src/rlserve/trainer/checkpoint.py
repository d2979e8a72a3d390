"""The trainer's own checkpoint state and the run directory's checkpoint layout.

run_dir/checkpoints/step_000010/
    trainer_state.json   step, prompt stream position, KL controller, RNG, versions
    rollout/  critic/    written by the services' SaveCheckpoint RPCs
A checkpoint is written whole under a staging name (checkpoints/.partial-step_000010),
fsynced, then renamed into place, and never written again: a save that fails part-way
leaves only the staging directory, which `latest_checkpoint` never reads and the next
save clears. `prune_checkpoints` keeps the newest `trainer.keep_checkpoints`.

The services write rollout/ and critic/ themselves, confined to their checkpoint_root:
the run config's `trainer.run_dir` (absolute), which holds every run of that config. The
trainer deploys them with that root (`services_checkpoint_root`) and names each
checkpoint relative to it (`service_checkpoint_name`: "<run>/checkpoints/step_.../rollout").

`save_checkpoint` and `load_service_checkpoints` are a checkpoint's round trip through
the services; the trainer adds (and takes back) its own state.
"""

import asyncio
import json
import logging
import os
import random
import re
import shutil
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import torch

from rlserve.core.rpc import ServiceClient
from rlserve.v1 import critic_pb2, rollout_pb2

STATE_FILE = "trainer_state.json"
_STAGING_PREFIX = ".partial-"
_CHECKPOINT_NAME = re.compile(r"step_\d{6,}")

logger = logging.getLogger(__name__)


def checkpoint_dir(run_dir: Path, step: int) -> Path:
    return run_dir / "checkpoints" / f"step_{step:06d}"


def staging_dir(run_dir: Path, step: int) -> Path:
    """Where the checkpoint of `step` is written before `commit_checkpoint` renames it."""
    final = checkpoint_dir(run_dir, step)
    return final.with_name(_STAGING_PREFIX + final.name)


def start_staging(run_dir: Path, step: int) -> Path:
    """An empty staging directory for `step`; what a failed save left there is removed."""
    staging = staging_dir(run_dir, step)
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    return staging


def commit_checkpoint(staging: Path, final: Path) -> None:
    """Makes every file under `staging` durable, then renames it to `final` (atomic on one
    filesystem) and makes the rename durable.

    Raises:
        FileExistsError: `final` is already a complete checkpoint; it is never replaced.
    """
    if (final / STATE_FILE).exists():
        raise FileExistsError(f"checkpoint {final} already exists and is never overwritten")
    _fsync_tree(staging)
    # An incomplete directory of that name can only be from a crash of older code
    # (it wrote in place); it holds no usable state.
    shutil.rmtree(final, ignore_errors=True)
    os.rename(staging, final)
    _fsync_path(final.parent)


def prune_checkpoints(run_dir: Path, keep: int | None) -> list[Path]:
    """Removes all but the newest `keep` complete checkpoints (None keeps all); the
    removed directories."""
    if keep is None:
        return []
    removed = complete_checkpoints(run_dir)[:-keep]
    for directory in removed:
        shutil.rmtree(directory)
    return removed


def _fsync_tree(root: Path) -> None:
    for directory, _, files in os.walk(root):
        for name in files:
            _fsync_path(Path(directory) / name)
        _fsync_path(Path(directory))


def _fsync_path(path: Path) -> None:
    descriptor = os.open(path, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def rng_state() -> dict[str, Any]:
    return {"python": repr(random.getstate()), "torch": torch.get_rng_state().tolist()}


def restore_rng(state: dict[str, Any]) -> None:
    import ast

    random.setstate(ast.literal_eval(state["python"]))
    torch.set_rng_state(torch.tensor(state["torch"], dtype=torch.uint8))


def write_trainer_state(directory: Path, state: dict[str, Any]) -> None:
    (directory / STATE_FILE).write_text(json.dumps(state, indent=1))


def read_trainer_state(directory: Path) -> dict[str, Any]:
    return json.loads((directory / STATE_FILE).read_text())


def services_checkpoint_root(runs_dir: str | Path) -> str:
    """The services' checkpoint_root for a run config's `trainer.run_dir`: as an absolute
    path (made so against the trainer's working directory), symlinks kept."""
    return os.path.abspath(runs_dir)


def service_checkpoint_name(runs_dir: str | Path, directory: Path, role: str) -> str:
    """`directory/role` named relative to the services' checkpoint root.

    Raises:
        ValueError: `directory` is not under `runs_dir` (a run moved elsewhere: resume it
            with trainer.run_dir set to the directory that now holds it).
    """
    # Both with symlinks resolved, as the services resolve their root: a run reached
    # through a link (or the root through one) names the same directory either way.
    root = Path(os.path.realpath(services_checkpoint_root(runs_dir)))
    target = Path(os.path.realpath(directory / role))
    try:
        return str(target.relative_to(root))
    except ValueError:
        raise ValueError(
            f"checkpoint {target} is not under trainer.run_dir {root}, the only directory "
            "the services read and write checkpoints in; set trainer.run_dir to the "
            "directory that holds this run"
        ) from None


def complete_checkpoints(run_dir: Path) -> list[Path]:
    """The run's complete checkpoints, oldest first."""
    return sorted(
        p
        for p in (run_dir / "checkpoints").glob("step_*")
        if _CHECKPOINT_NAME.fullmatch(p.name) and (p / STATE_FILE).exists()
    )


def latest_checkpoint(run_dir: Path) -> Path | None:
    complete = complete_checkpoints(run_dir)
    return complete[-1] if complete else None


async def save_checkpoint(
    run_dir: Path,
    runs_dir: str | Path,
    keep: int | None,
    step: int,
    rollout: ServiceClient,
    critic: ServiceClient | None,
    trainer_state: Callable[[Path], Awaitable[dict[str, Any]]],
) -> Path:
    """Writes the checkpoint of `step` once: a step already saved (the last periodic
    save, asked for again at the end) is kept as it is. The services save theirs first,
    concurrently; then `trainer_state(directory)` writes what the trainer keeps beside
    them and returns its trainer_state.json. Keeps the newest `keep` checkpoints
    (trainer.keep_checkpoints; `runs_dir`: trainer.run_dir)."""
    final = checkpoint_dir(run_dir, step)
    if final in complete_checkpoints(run_dir):
        return final
    directory = start_staging(run_dir, step)
    saves = [
        rollout.call(
            "SaveCheckpoint",
            rollout_pb2.RolloutServiceSaveCheckpointRequest(
                location={"path": service_checkpoint_name(runs_dir, directory, "rollout")}
            ),
        )
    ]
    if critic is not None:
        saves.append(
            critic.call(
                "SaveCheckpoint",
                critic_pb2.CriticServiceSaveCheckpointRequest(
                    location={"path": service_checkpoint_name(runs_dir, directory, "critic")}
                ),
            )
        )
    await asyncio.gather(*saves)
    write_trainer_state(directory, await trainer_state(directory))
    commit_checkpoint(directory, final)
    for removed in prune_checkpoints(run_dir, keep):
        logger.info("removed %s (trainer.keep_checkpoints)", removed)
    return final


async def load_service_checkpoints(
    directory: Path,
    runs_dir: str | Path,
    rollout: ServiceClient,
    critic: ServiceClient | None,
    weights_version: int,
) -> None:
    """Loads checkpoint `directory` into the rollout and critic services, concurrently.

    Raises:
        RuntimeError: the rollout restored other weights than `weights_version`, the
            version the checkpoint's trainer state names.
    """
    loads = [
        rollout.call(
            "LoadCheckpoint",
            rollout_pb2.RolloutServiceLoadCheckpointRequest(
                location={"path": service_checkpoint_name(runs_dir, directory, "rollout")}
            ),
        )
    ]
    if critic is not None:
        loads.append(
            critic.call(
                "LoadCheckpoint",
                critic_pb2.CriticServiceLoadCheckpointRequest(
                    location={"path": service_checkpoint_name(runs_dir, directory, "critic")}
                ),
            )
        )
    rollout_state, *_ = await asyncio.gather(*loads)
    if rollout_state.weights_version != weights_version:
        raise RuntimeError(
            f"checkpoint {directory} is inconsistent: rollout restored weights version "
            f"{rollout_state.weights_version}, trainer state says {weights_version}"
        )
