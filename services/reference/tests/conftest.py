"""Fixtures of the reference tests: sequence batches and a plain-transformers reference."""

import pytest
import torch

from rlserve.core.batch import Batch


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
def make_batch(sequence_batch):
    """sequence_batch(rows, prompt_len=6, response_len=5, seed=0) -> Batch."""
    return sequence_batch


@pytest.fixture(scope="session")
def direct_reference():
    """direct_log_probs(model, batch, temperature=1.0) -> [B, R]."""
    return direct_log_probs
