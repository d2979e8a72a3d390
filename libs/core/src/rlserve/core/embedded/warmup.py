"""Supervised warm-up: teaches the tiny model the answer format so PPO starts from a
policy that is right sometimes.

Loss is on the answer and <eos> only: the prompt is given, never predicted.

With a `StopAtAccuracy`, the warm-up checks greedy accuracy on rows it never trains on
every few steps and stops as soon as it reaches the target, so where RL starts is set
by construction rather than by how a seed's float rounding happens to fall: a fixed
step count ended anywhere between 7% and 57% over seeds and CPUs, because the loss sits
on a plateau for a seed-dependent number of steps before it drops.
"""

import random
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from rlserve.core.embedded.evaluate import greedy_accuracy

IGNORE_INDEX = -100


def encode_sft_rows(
    rows: list[dict], tokenizer: PreTrainedTokenizerBase
) -> list[tuple[list[int], list[int]]]:
    """(input ids, labels) per row: <bos> prompt answer <eos>, labels only on the answer."""
    encoded = []
    for row in rows:
        prompt_ids = tokenizer(row["prompt"])["input_ids"]
        answer_ids = tokenizer(row["ground_truth"], add_special_tokens=False)["input_ids"]
        answer_ids = [*answer_ids, tokenizer.eos_token_id]
        encoded.append((prompt_ids + answer_ids, [IGNORE_INDEX] * len(prompt_ids) + answer_ids))
    return encoded


def collate_sft(
    examples: list[tuple[list[int], list[int]]], pad_id: int
) -> dict[str, torch.Tensor]:
    """Right-padded input_ids / attention_mask / labels."""
    width = max(len(ids) for ids, _ in examples)
    batch = {
        "input_ids": torch.full((len(examples), width), pad_id),
        "attention_mask": torch.zeros(len(examples), width, dtype=torch.long),
        "labels": torch.full((len(examples), width), IGNORE_INDEX),
    }
    for row, (ids, labels) in enumerate(examples):
        batch["input_ids"][row, : len(ids)] = torch.tensor(ids)
        batch["attention_mask"][row, : len(ids)] = 1
        batch["labels"][row, : len(labels)] = torch.tensor(labels)
    return batch


@dataclass(frozen=True)
class StopAtAccuracy:
    """Stop the warm-up once greedy accuracy on `rows` reaches `target`."""

    rows: list[dict]
    """Rows to check on; keep them out of the training rows."""
    target: float
    """Accuracy (0..1) at which to stop."""
    every_steps: int
    max_new_tokens: int


@dataclass
class WarmupResult:
    target: float | None
    """The StopAtAccuracy target, None without one."""
    steps: int = 0
    """Optimizer steps taken."""
    losses: list[float] = field(default_factory=list)
    """The loss of every step."""
    checks: list[tuple[int, float]] = field(default_factory=list)
    """(step, accuracy) of every accuracy check."""

    @property
    def reached_target(self) -> bool:
        return self.target is not None and bool(self.checks) and self.checks[-1][1] >= self.target


def supervised_warmup(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    rows: list[dict],
    steps: int,
    batch_size: int,
    lr: float,
    seed: int,
    stop: StopAtAccuracy | None = None,
    encode: Callable[[list[dict], PreTrainedTokenizerBase], list] = encode_sft_rows,
    accuracy: Callable[..., float] = greedy_accuracy,
) -> WarmupResult:
    """Trains in place with AdamW for `steps` steps, or fewer when `stop` is reached.
    `encode` turns rows into (ids, labels) and `accuracy` scores `stop`'s rows (the
    single-turn task's by default; the tool task passes its episodes')."""
    examples = encode(rows, tokenizer)
    sampler = random.Random(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    result = WarmupResult(target=stop.target if stop else None)
    for step in range(1, steps + 1):
        model.train()
        batch = collate_sft(sampler.sample(examples, batch_size), tokenizer.pad_token_id)
        loss = model(**batch).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        result.losses.append(loss.item())
        result.steps = step
        if stop is not None and (step % stop.every_steps == 0 or step == steps):
            reached = accuracy(model, tokenizer, stop.rows, stop.max_new_tokens)
            result.checks.append((step, reached))
            if reached >= stop.target:
                break
    model.eval()
    return result
