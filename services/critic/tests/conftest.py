"""Fixtures of the critic tests: sequence batches and an exported critic."""

from pathlib import Path

import pytest
import torch

from rlserve.core.batch import Batch

PAD_ID = 0


def sequence_batch(
    rows: int, prompt_len: int = 6, response_len: int = 5, seed: int = 0, vocab_size: int = 99
) -> Batch:
    """Left-padded prompts, right-padded responses (some empty), returns and old values."""
    generator = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(4, vocab_size, (rows, prompt_len + response_len), generator=generator)
    attention_mask = torch.ones_like(input_ids)
    prompt_pad = torch.randint(0, prompt_len - 1, (rows,), generator=generator)
    response_lens = torch.randint(0, response_len + 1, (rows,), generator=generator)
    response_lens[0] = response_len  # at least one full response
    for row in range(rows):
        attention_mask[row, : prompt_pad[row]] = 0
        attention_mask[row, prompt_len + response_lens[row] :] = 0
    input_ids[attention_mask == 0] = PAD_ID
    response_mask = attention_mask[:, prompt_len:].clone()
    return Batch(
        tensors={
            "input_ids": input_ids,
            "attention_mask": attention_mask,
            "responses": input_ids[:, prompt_len:].clone(),
            "response_mask": response_mask,
            "values": torch.randn(rows, response_len, generator=generator) * 0.1 * response_mask,
            "returns": torch.randn(rows, response_len, generator=generator) * response_mask,
        }
    )


def sequences_only(batch: Batch) -> Batch:
    return batch.select(["input_ids", "attention_mask", "responses", "response_mask"])


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
def make_batch():
    """sequence_batch(rows, prompt_len=6, response_len=5, seed=0) -> Batch."""
    return sequence_batch
