"""Where a run's numbers go: JSONL (one line per step), TensorBoard scalars, a PNG.

JSONL is the record of truth (resume appends to it, tests read it); TensorBoard is for
watching; the PNG (reward and held-out accuracy per step) is drawn at the end of a run.
"""

import json
import os
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # no display on training machines
import matplotlib.pyplot as plt


class MetricsLog:
    """Appends per-step metrics to run_dir/metrics.jsonl and TensorBoard."""

    def __init__(self, run_dir: Path, tensorboard: bool = True):
        self.path = run_dir / "metrics.jsonl"
        self.writer = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(log_dir=str(run_dir / "tensorboard"))

    def write(self, step: int, metrics: dict[str, float]) -> None:
        with self.path.open("a") as out:
            out.write(json.dumps({"step": step, **metrics}, sort_keys=True) + "\n")
            out.flush()
            os.fsync(out.fileno())  # a step's line is on disk before the next step runs
        if self.writer is not None:
            for key, value in metrics.items():
                self.writer.add_scalar(key, value, step)
            self.writer.flush()

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


def read_metrics(path: Path) -> list[dict]:
    with path.open() as lines:
        return [json.loads(line) for line in lines if line.strip()]


def repair_torn_tail(path: Path) -> str | None:
    """Cuts a torn last line (a write the machine did not finish) off `path`; returns
    what was cut, as a message, or None when the file is whole or absent.

    Raises:
        ValueError: a line before the last is not a JSON object (not a torn write: the
            file was edited or damaged), naming the line and the fix.
    """
    if not path.exists():
        return None
    data = path.read_bytes()
    lines = data.split(b"\n")
    whole, tail = lines[:-1], lines[-1]  # tail: what follows the last newline
    for number, line in enumerate(whole, start=1):
        if line.strip() and not _is_record(line):
            if number == len(whole) and not tail.strip():
                tail = line  # the last line itself is torn (its newline made it)
                whole = whole[:-1]
                break
            raise ValueError(
                f"{path}: line {number} is not a JSON record; fix or remove that line "
                "(every line is one step's metrics), then resume again"
            )
    if not tail.strip():
        return None
    if _is_record(tail):  # whole but for its newline: the next append would join it
        with path.open("ab") as out:
            out.write(b"\n")
            os.fsync(out.fileno())
        return None
    kept = b"".join(line + b"\n" for line in whole)
    with path.open("r+b") as out:
        out.truncate(len(kept))
        os.fsync(out.fileno())
    records = sum(1 for line in whole if line.strip())
    return (
        f"{path}: dropped a torn last line ({len(tail)} bytes, a write cut short); "
        f"kept the {records} whole records before it"
    )


def _is_record(line: bytes) -> bool:
    try:
        return isinstance(json.loads(line), dict)
    except ValueError:
        return False


def truncate_after(path: Path, step: int) -> None:
    """Drops records of steps after `step` (a resumed run re-runs them)."""
    if path.exists():
        kept = [r for r in read_metrics(path) if r["step"] <= step]
        path.write_text("".join(json.dumps(r, sort_keys=True) + "\n" for r in kept))


def plot_curves(records: list[dict], png_path: Path) -> None:
    """Reward mean per step and held-out accuracy where measured, one figure."""
    figure, reward_axis = plt.subplots(figsize=(7, 4))
    steps = [r["step"] for r in records if "reward_mean" in r]
    reward_axis.plot(
        steps,
        [r["reward_mean"] for r in records if "reward_mean" in r],
        label="reward mean (train)",
        color="tab:blue",
    )
    reward_axis.set_xlabel("PPO step")
    reward_axis.set_ylabel("reward mean")
    accuracy_axis = reward_axis.twinx()
    evaluated = [r for r in records if "eval_accuracy" in r]
    accuracy_axis.plot(
        [r["step"] for r in evaluated],
        [100 * r["eval_accuracy"] for r in evaluated],
        "o-",
        label="held-out accuracy (%)",
        color="tab:orange",
    )
    accuracy_axis.set_ylabel("held-out accuracy (%)")
    figure.legend(loc="lower right")
    figure.tight_layout()
    figure.savefig(png_path, dpi=100)
    plt.close(figure)
