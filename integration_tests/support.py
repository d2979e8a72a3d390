"""Helpers for whole-stack tests."""

from pathlib import Path

from rlserve.core.config import validate_config
from rlserve.core.run_config import RunConfig


def tiny_run_config(run_dir: Path, **sections) -> RunConfig:
    """A run of a few fast steps; `sections` override whole sections' fields."""
    data = {
        "rollout": {"max_new_tokens": 3, "eval_prompts": 32, "eval_every_steps": 0},
        "actor": {"ppo_mini_batch_prompts": 8, "micro_batch_samples": 8, "ppo_epochs": 1},
        "critic": {"ppo_mini_batch_prompts": 8, "micro_batch_samples": 8, "ppo_epochs": 1},
        "trainer": {
            "total_steps": 3,
            "prompts_per_step": 16,
            "checkpoint_every_steps": 0,
            "run_dir": str(run_dir),
            "control_port": None,
        },
    }
    for section, fields in sections.items():
        data.setdefault(section, {}).update(fields)
    return validate_config(RunConfig, data)
