"""The README's main command end to end: `rlserve train` with no arguments learns.

Slow (minutes): it builds the embedded default, starts its own local Ray cluster and
Serve, deploys the four services and runs PPO, exactly as a new user would.
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

RLSERVE = [sys.executable, "-m", "rlserve.trainer.cli", "train"]


def _train(tmp_path: Path, *overrides: str) -> dict:
    completed = subprocess.run(
        [*RLSERVE, f"trainer.run_dir={tmp_path}", *overrides],
        capture_output=True,
        text=True,
        timeout=1800,
    )
    assert completed.returncode == 0, completed.stderr[-4000:]
    (run_dir,) = [p for p in tmp_path.iterdir() if p.is_dir()]
    summary = json.loads((run_dir / "summary.json").read_text())
    print(completed.stdout)
    return summary


def test_ppo_raises_held_out_accuracy_by_20_points_within_10_minutes(tmp_path):
    summary = _train(tmp_path)
    assert summary["accuracy_after"] >= summary["accuracy_before"] + 0.20, summary
    assert summary["total_s"] < 600, summary
    assert Path(summary["curves_png"]).stat().st_size > 0
    assert (Path(summary["checkpoint"]) / "rollout" / "model" / "model.safetensors").exists()


def test_grpo_without_critic_also_improves(tmp_path):
    summary = _train(
        tmp_path,
        "trainer.total_steps=10",
        "algorithm.adv_estimator=grpo",
        "algorithm.kl_ctrl.kl_coef=0",
        "trainer.prompts_per_step=64",
        "rollout.responses_per_prompt=8",
        "actor.lr=1e-4",
        "actor.use_kl_loss=true",
        "actor.kl_loss_coef=0.04",
        "actor.ppo_mini_batch_prompts=16",
    )
    assert summary["accuracy_after"] >= summary["accuracy_before"] + 0.05, summary
