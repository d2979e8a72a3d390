"""Fixtures of the reference tests: sequence batches and a plain-transformers reference."""

import pytest
import torch

from rlserve.core.batch import Batch

PAD_ID = 0


def sequence_batch(
    rows: int, prompt_len: int = 6, response_len: int = 5, seed: int = 0, vocab_size: int = 99
) -> Batch:
    """Left-padded prompts, right-padded responses (some empty), pad id 0 where masked."""
    generator = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(4, vocab_size, (rows, prompt_len + response_len), generator=generator)
    attention_mask = torch.ones_like(input_ids)
    prompt_pad = torch.randint(0, prompt_len - 1, (rows,), generator=generator)
    response_lens = torch.randint(0, response_len + 1, (rows,), generator=generator)
    response_lens[0] = response_len
    for row in range(rows):
        attention_mask[row, : prompt_pad[row]] = 0
        attention_mask[row, prompt_len + response_lens[row] :] = 0
    input_ids[attention_mask == 0] = PAD_ID
    return Batch(
        tensors={
            "input_ids": input_ids,
            "attention_mask": attention_mask,
            "responses": input_ids[:, prompt_len:].clone(),
            "response_mask": attention_mask[:, prompt_len:].clone(),
        }
    )


def direct_log_probs(model, batch: Batch, temperature: float = 1.0) -> torch.Tensor:
    """The obvious version: each row alone, padding stripped, log-softmax of every position.

    Shape: (B, R), 0 outside response_mask.
    """
    input_ids, attention_mask = batch.tensors["input_ids"], batch.tensors["attention_mask"]
    response_mask = batch.tensors["response_mask"]
    rows, response_len = response_mask.shape
    prompt_len = input_ids.shape[1] - response_len
    out = torch.zeros(rows, response_len)
    with torch.no_grad():
        for row in range(rows):
            real = attention_mask[row].bool()
            ids = input_ids[row][real].unsqueeze(0)
            log_probs = torch.log_softmax(model(input_ids=ids).logits[0].float() / temperature, -1)
            first_response = int(real[:prompt_len].sum())  # index of response token 0 in ids
            for t in range(int(response_mask[row].sum())):
                token = int(batch.tensors["responses"][row, t])
                out[row, t] = log_probs[first_response + t - 1, token]
    return out


@pytest.fixture(scope="session")
def make_batch():
    """sequence_batch(rows, prompt_len=6, response_len=5, seed=0) -> Batch."""
    return sequence_batch


@pytest.fixture(scope="session")
def direct_reference():
    """direct_log_probs(model, batch, temperature=1.0) -> [B, R]."""
    return direct_log_probs
