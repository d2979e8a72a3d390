"""Prompt datasets: jsonl or parquet rows -> tokenized prompt batches, resumable order.

Rows need a prompt and a ground truth. Flat rows ({"prompt": "...", "ground_truth":
"..."}) and VeRL's layout (prompt = chat messages, ground truth under
"reward_model.ground_truth") both work: keys may be dotted paths, and a chat prompt is
rendered with the tokenizer's chat template when it has one.
"""

import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import PreTrainedTokenizerBase

from rlserve.core.batch import Batch


@dataclass(frozen=True)
class PromptRow:
    prompt: str
    ground_truth: str


def _lookup(row: dict, dotted_key: str, path: Path, index: int) -> Any:
    value: Any = row
    for part in dotted_key.split("."):
        if not isinstance(value, dict) or part not in value:
            raise ValueError(
                f"{path}: row {index} has no {dotted_key!r} (keys: {sorted(row)}); set "
                "data.prompt_key / data.ground_truth_key to the right column"
            )
        value = value[part]
    return value


def _render_prompt(prompt: Any, tokenizer: PreTrainedTokenizerBase) -> str:
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and all(isinstance(m, dict) for m in prompt):
        if getattr(tokenizer, "chat_template", None):
            return tokenizer.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True)
        return "\n".join(str(message.get("content", "")) for message in prompt)
    raise ValueError(f"prompt must be text or a list of chat messages, got {type(prompt).__name__}")


def _read_records(path: Path) -> list[dict]:
    if path.suffix == ".jsonl":
        with path.open() as lines:
            return [json.loads(line) for line in lines if line.strip()]
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        return pq.read_table(path).to_pylist()
    raise ValueError(f"{path}: unknown format; use .jsonl or .parquet")


def load_prompt_rows(
    path: str | Path,
    tokenizer: PreTrainedTokenizerBase,
    prompt_key: str = "prompt",
    ground_truth_key: str = "ground_truth",
    max_prompt_tokens: int | None = None,
) -> list[PromptRow]:
    """Reads a dataset; drops prompts longer than max_prompt_tokens."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"dataset {path} does not exist")
    rows = []
    for index, record in enumerate(_read_records(path)):
        prompt = _render_prompt(_lookup(record, prompt_key, path, index), tokenizer)
        truth = str(_lookup(record, ground_truth_key, path, index))
        if max_prompt_tokens and len(tokenizer(prompt)["input_ids"]) > max_prompt_tokens:
            continue
        rows.append(PromptRow(prompt, truth))
    if not rows:
        raise ValueError(f"{path}: no usable rows (check keys and data.max_prompt_tokens)")
    return rows


def prompt_batch(rows: list[PromptRow], tokenizer: PreTrainedTokenizerBase) -> Batch:
    """Left-padded input_ids/attention_mask [B, P] + prompt_text/ground_truth columns."""
    encoded = tokenizer(
        [row.prompt for row in rows], padding=True, return_tensors="pt", padding_side="left"
    )
    return Batch(
        tensors={
            "input_ids": encoded["input_ids"].to(torch.int64),
            "attention_mask": encoded["attention_mask"].to(torch.int64),
        },
        non_tensors={
            "prompt_text": [row.prompt for row in rows],
            "ground_truth": [row.ground_truth for row in rows],
        },
    )


class PromptStream:
    """Endless shuffled passes over the rows; its position is saved for resume."""

    def __init__(self, rows: list[PromptRow], seed: int):
        self.rows = rows
        self.seed = seed
        self.epoch = 0
        self.position = 0
        self._order = self._epoch_order(0)

    def _epoch_order(self, epoch: int) -> list[int]:
        order = list(range(len(self.rows)))
        random.Random(f"{self.seed}:{epoch}").shuffle(order)
        return order

    def next_rows(self, count: int) -> list[PromptRow]:
        taken = []
        while len(taken) < count:
            if self.position == len(self._order):
                self.epoch, self.position = self.epoch + 1, 0
                self._order = self._epoch_order(self.epoch)
            taken.append(self.rows[self._order[self.position]])
            self.position += 1
        return taken

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.epoch, self.position = state["epoch"], state["position"]
        self._order = self._epoch_order(self.epoch)
