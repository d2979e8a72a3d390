"""The trainer's own checkpoint state and the run directory's checkpoint layout.

run_dir/checkpoints/step_000010/
    trainer_state.json   step, prompt stream position, KL controller, RNG, versions
    rollout/  critic/    written by the services' SaveCheckpoint RPCs
A checkpoint counts only once trainer_state.json exists: it is written last, so a crash
mid-save leaves an incomplete directory that `latest_checkpoint` skips.

The services write rollout/ and critic/ themselves, confined to their checkpoint_root:
the run config's `trainer.run_dir` (absolute), which holds every run of that config. The
trainer deploys them with that root (`services_checkpoint_root`) and names each
checkpoint relative to it (`service_checkpoint_name`: "<run>/checkpoints/step_.../rollout").
"""

import json
import os
import random
from pathlib import Path
from typing import Any

import torch

STATE_FILE = "trainer_state.json"


def checkpoint_dir(run_dir: Path, step: int) -> Path:
    return run_dir / "checkpoints" / f"step_{step:06d}"


def rng_state() -> dict[str, Any]:
    return {"python": repr(random.getstate()), "torch": torch.get_rng_state().tolist()}


def restore_rng(state: dict[str, Any]) -> None:
    import ast

    random.setstate(ast.literal_eval(state["python"]))
    torch.set_rng_state(torch.tensor(state["torch"], dtype=torch.uint8))


def write_trainer_state(directory: Path, state: dict[str, Any]) -> None:
    tmp = directory / (STATE_FILE + ".tmp")
    tmp.write_text(json.dumps(state, indent=1))
    tmp.replace(directory / STATE_FILE)


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


def latest_checkpoint(run_dir: Path) -> Path | None:
    complete = sorted(
        p for p in (run_dir / "checkpoints").glob("step_*") if (p / STATE_FILE).exists()
    )
    return complete[-1] if complete else None
