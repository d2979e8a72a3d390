"""Held-out exact-match accuracy with greedy decoding (transformers generate)."""

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from rlserve.core.embedded.task import exact_match


@torch.no_grad()
def greedy_accuracy(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    rows: list[dict],
    max_new_tokens: int,
    batch_prompts: int = 500,
) -> float:
    """Fraction of rows whose greedy response equals the ground truth exactly."""
    model.eval()
    correct = 0
    for start in range(0, len(rows), batch_prompts):
        chunk = rows[start : start + batch_prompts]
        inputs = tokenizer([row["prompt"] for row in chunk], return_tensors="pt", padding=True)
        output = model.generate(
            **inputs,
            max_new_tokens=max_new_tokens,
            do_sample=False,
            pad_token_id=tokenizer.pad_token_id,
            eos_token_id=tokenizer.eos_token_id,
        )
        responses = tokenizer.batch_decode(
            output[:, inputs["input_ids"].shape[1] :], skip_special_tokens=True
        )
        correct += sum(
            exact_match(text, row["ground_truth"])
            for text, row in zip(responses, chunk, strict=True)
        )
    return correct / len(rows)
