"""The README's main command end to end: `rlserve train` with no arguments learns.

Slow (minutes): it builds the embedded default, starts its own local Ray cluster and
Serve, deploys the four services and runs PPO, exactly as a new user would.
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from rlserve.core.config import load_config
from rlserve.core.embedded.prepare import prepare_embedded_default
from rlserve.core.run_config import EMBEDDED_GRPO_CONFIG_PATH, RunConfig

pytestmark = pytest.mark.slow

RLSERVE = [sys.executable, "-m", "rlserve.trainer.cli", "train"]


def _train(tmp_path: Path, *overrides: str, config: Path | None = None) -> dict:
    options = [] if config is None else ["--config", str(config)]
    completed = subprocess.run(
        [*RLSERVE, *options, f"trainer.run_dir={tmp_path}", *overrides],
        capture_output=True,
        text=True,
        timeout=1800,
    )
    assert completed.returncode == 0, completed.stderr[-4000:]
    # a clean run prints nothing alarming after its summary (Serve's shutdown once did)
    output = completed.stdout + completed.stderr
    assert "graceful_shutdown failed" not in output and "killed by `ray.kill`" not in output
    (run_dir,) = [p for p in tmp_path.iterdir() if p.is_dir()]
    summary = json.loads((run_dir / "summary.json").read_text())
    print(completed.stdout)
    return summary


WARMUP_BAND = (0.22, 0.55)
"""Where the default warm-up leaves held-out accuracy on every seed: RL starts from
30-40% whatever the seed or the CPU's rounding (a fixed 400 steps ended anywhere
between 7% and 57%)."""
PPO_SEEDS = [2, 3]


@pytest.mark.parametrize("seed", PPO_SEEDS)
def test_ppo_raises_held_out_accuracy_by_20_points_within_10_minutes(seed, tmp_path):
    """The default run on two seeds other than the demo's 0. On this machine kind they
    gained +37.4 and +41.8 points (+20 after 24 s of RL); seeds 0 and 1 gain only
    +21 to +23, too close to the bar for a test (see benchmarks/bench_learning.py).
    Its warm-up lands in the band too (test_warmup_lands_in_its_band checks the others)."""
    summary = _train(tmp_path, f"trainer.seed={seed}")
    assert summary["seed"] == seed
    assert summary["warmup_reached_target"], summary
    assert WARMUP_BAND[0] <= summary["warmup_accuracy"] <= WARMUP_BAND[1], summary
    assert summary["accuracy_after"] >= summary["accuracy_before"] + 0.20, summary
    assert summary["total_s"] < 600, summary
    assert Path(summary["curves_png"]).stat().st_size > 0
    assert (Path(summary["checkpoint"]) / "rollout" / "model" / "model.safetensors").exists()


def test_grpo_without_critic_also_improves(tmp_path):
    summary = _train(tmp_path, "trainer.total_steps=10", config=EMBEDDED_GRPO_CONFIG_PATH)
    assert summary["accuracy_after"] >= summary["accuracy_before"] + 0.05, summary
    # the start-up's phases, each timed, in the order they ran (no critic in GRPO)
    phases = list(summary["phases_s"])
    startup = ["process_start", "prepare", "ray_start", "serve_start", "deploy"]
    assert phases[: len(startup)] == startup, phases
    assert {"deploy/rollout", "deploy/reference", "deploy/reward"} <= set(phases), phases
    assert "deploy/critic" not in phases
    assert all(seconds >= 0 for seconds in summary["phases_s"].values())
    before_steps = sum(summary["phases_s"][p] for p in startup)
    assert before_steps <= summary["startup_s"] < summary["total_s"], summary


@pytest.mark.parametrize("seed", [seed for seed in range(5) if seed not in PPO_SEEDS])
def test_warmup_lands_in_its_band_on_every_seed(seed, tmp_path):
    """The default warm-up stops at its target accuracy on held-out training pairs, in
    WARMUP_BAND: seeds 0-4, those the PPO runs above don't warm up already."""
    config = load_config(RunConfig)
    built = prepare_embedded_default(
        tmp_path,
        tiny=config.model.tiny,
        task=config.data.arithmetic,
        seed=seed,
        max_new_tokens=config.rollout.max_new_tokens,
        eval_prompts=config.rollout.eval_prompts,
    )
    assert built.warmup_reached_target, built
    assert built.warmup_steps < config.model.tiny.sft_max_steps, built
    # Measured on the run's held-out pairs (not the pairs the warm-up checked on).
    assert WARMUP_BAND[0] <= built.warmup_accuracy <= WARMUP_BAND[1], built
