"""The trainer's own checkpoint state and the run directory's checkpoint layout.

run_dir/checkpoints/step_000010/
    trainer_state.json   step, prompt stream position, KL controller, RNG, versions
    rollout/  critic/    written by the services' SaveCheckpoint RPCs
A checkpoint counts only once trainer_state.json exists: it is written last, so a crash
mid-save leaves an incomplete directory that `latest_checkpoint` skips.
"""

import json
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


def latest_checkpoint(run_dir: Path) -> Path | None:
    complete = sorted(
        p for p in (run_dir / "checkpoints").glob("step_*") if (p / STATE_FILE).exists()
    )
    return complete[-1] if complete else None
