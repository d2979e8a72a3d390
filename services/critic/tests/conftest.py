"""Fixtures of the critic tests: sequence batches and an exported critic."""

import functools
from pathlib import Path

import pytest
import torch


@pytest.fixture(scope="session")
def critic_model_dir(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An exported critic (token-classification layout) whose head is not zero."""
    from rlserve.critic.model import load_value_model, save_value_model

    model = load_value_model(tiny_model_dir)
    torch.manual_seed(1)
    torch.nn.init.normal_(model.value_head.weight, std=0.5)
    torch.nn.init.constant_(model.value_head.bias, 0.25)
    directory = tmp_path_factory.mktemp("critic_model")
    save_value_model(model, model.state_dict(), directory)
    return directory


@pytest.fixture(scope="session")
def make_batch(sequence_batch):
    """sequence_batch(rows, prompt_len=6, response_len=5, seed=0) -> Batch, with the
    critic's old values and returns."""
    return functools.partial(sequence_batch, targets=True)
