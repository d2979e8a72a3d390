"""Prompt datasets: jsonl or parquet rows -> tokenized prompt batches, resumable order.

Rows need a prompt and a ground truth. Flat rows ({"prompt": "...", "ground_truth":
"..."}) and VeRL's layout (prompt = chat messages, ground truth under
"reward_model.ground_truth") both work: keys may be dotted paths, and a chat prompt is
rendered with the tokenizer's chat template when it has one.

Prompts longer than max_prompt_tokens are dropped, cut from the left or the right, or
fail the load (`long_prompts`), and `load_prompt_rows` says how many it dropped or cut:
a dataset that loses most of its rows to the length limit should say so, not shrink
silently. Lengths count what the tokenizer produces for the prompt, special tokens its
post-processor adds (BOS) included, since that is what the rollout service receives.
"""

import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, get_args

import torch
from transformers import PreTrainedTokenizerBase

from rlserve.core.batch import Batch

LongPrompts = Literal["drop", "truncate_left", "truncate_right", "error"]
"""What to do with a prompt over max_prompt_tokens (run config: data.long_prompts)."""


@dataclass(frozen=True)
class PromptRow:
    prompt: str
    ground_truth: str
    tools_kwargs: str = ""
    """The row's arguments per tool (a JSON object by tool name), "" for none."""


@dataclass(frozen=True)
class PromptRows:
    """A loaded dataset, and what fitting it into max_prompt_tokens did to it."""

    rows: list[PromptRow]
    """The usable rows, in file order."""
    dropped: int
    """Rows left out because their prompt was too long (long_prompts="drop")."""
    truncated: int
    """Rows kept with a cut prompt (long_prompts="truncate_left" / "truncate_right")."""
    longest_tokens: int
    """The file's longest prompt in tokens, BOS included, before any cut (0: no rows)."""


_MISSING = object()


def _lookup(row: dict, dotted_key: str, path: Path, index: int, default: Any = _MISSING) -> Any:
    value: Any = row
    for part in dotted_key.split("."):
        if not isinstance(value, dict) or part not in value:
            if default is not _MISSING:
                return default
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


def _tools_kwargs(record: dict, key: str, path: Path, index: int) -> str:
    """A row's tools_kwargs as JSON text ("" when it has none): an object by tool name,
    given as one or as its JSON text."""
    value = _lookup(record, key, path, index, default=None)
    if value is None or value == "":
        return ""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError:
            value = None
    if not isinstance(value, dict):
        raise ValueError(
            f"{path}: row {index}: {key!r} must be an object of arguments by tool name "
            "(or its JSON text); fix the row or set data.tools_kwargs_key to the right column"
        )
    return json.dumps(value)


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
    long_prompts: LongPrompts = "drop",
    tools_kwargs_key: str = "tools_kwargs",
) -> PromptRows:
    """Reads a dataset; fits prompts into max_prompt_tokens as long_prompts says.

    None for max_prompt_tokens keeps every prompt whole. Error messages name the run
    config's data.* settings, since that is where these arguments come from.
    """
    if long_prompts not in get_args(LongPrompts):
        raise ValueError(
            f"data.long_prompts: must be one of {get_args(LongPrompts)}; got {long_prompts!r}"
        )
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"dataset {path} does not exist")
    records = _read_records(path)
    prompts = [
        _render_prompt(_lookup(record, prompt_key, path, index), tokenizer)
        for index, record in enumerate(records)
    ]
    truths = [
        str(_lookup(record, ground_truth_key, path, index)) for index, record in enumerate(records)
    ]
    tools_kwargs = [
        _tools_kwargs(record, tools_kwargs_key, path, index) for index, record in enumerate(records)
    ]
    # One batch call: the Rust tokenizers encode it in parallel, row by row is far slower.
    lengths = [len(ids) for ids in tokenizer(prompts)["input_ids"]] if prompts else []
    longest = max(lengths, default=0)
    too_long = [i for i, n in enumerate(lengths) if max_prompt_tokens and n > max_prompt_tokens]
    if too_long and long_prompts == "error":
        first = too_long[0]
        raise ValueError(
            f"{path}: row {first} has a prompt of {lengths[first]} tokens, more than "
            f"data.max_prompt_tokens={max_prompt_tokens} ({len(too_long)} of {len(prompts)} "
            f"rows are; the longest has {longest}); raise data.max_prompt_tokens to {longest}, "
            "or set data.long_prompts to drop, truncate_left or truncate_right"
        )
    rows, dropped, truncated = [], 0, 0
    long_rows = set(too_long)
    for index, (prompt, truth, kwargs) in enumerate(
        zip(prompts, truths, tools_kwargs, strict=True)
    ):
        if index in long_rows:
            if long_prompts == "drop":
                dropped += 1
                continue
            assert max_prompt_tokens is not None  # long_rows is empty without a limit
            keep_end = long_prompts == "truncate_left"
            prompt = _truncate_prompt(prompt, tokenizer, max_prompt_tokens, keep_end)
            if not prompt:
                raise ValueError(
                    f"{path}: row {index}: data.max_prompt_tokens={max_prompt_tokens} leaves "
                    "no room for the prompt next to the special tokens the tokenizer adds "
                    "(BOS); raise data.max_prompt_tokens"
                )
            truncated += 1
        rows.append(PromptRow(prompt, truth, kwargs))
    if not rows:
        raise ValueError(
            f"{path}: no usable rows ({len(prompts)} read, {dropped} of them longer than "
            f"data.max_prompt_tokens={max_prompt_tokens}); check the keys, raise "
            "data.max_prompt_tokens or set data.long_prompts=truncate_left"
        )
    return PromptRows(rows, dropped=dropped, truncated=truncated, longest_tokens=longest)


def _truncate_prompt(
    prompt: str, tokenizer: PreTrainedTokenizerBase, max_tokens: int, keep_end: bool
) -> str:
    """The prompt cut to its last (keep_end) or first tokens, so it encodes to <= max_tokens.

    "" when nothing fits next to the special tokens the tokenizer adds.

    Cuts the prompt's own tokens, leaving room for the special tokens the tokenizer adds
    around them (BOS). Decoding a cut and encoding it again need not give the same ids
    (merges across the cut, half a multi-byte character), so the cut is re-encoded and
    shortened until it fits. A cut through a multi-byte character decodes to U+FFFD;
    one more token goes then, so the prompt keeps whole characters only.
    """
    content = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    added = len(tokenizer(prompt)["input_ids"]) - len(content)
    budget = max_tokens - added
    while budget > 0:
        kept = content[-budget:] if keep_end else content[:budget]
        # Special tokens inside the prompt (chat-template markers) are part of its text.
        text = tokenizer.decode(kept, skip_special_tokens=False, clean_up_tokenization_spaces=False)
        if text.count("\ufffd") > prompt.count("\ufffd"):
            budget -= 1
            continue
        excess = len(tokenizer(text)["input_ids"]) - max_tokens
        if excess <= 0:
            return text
        budget -= excess
    return ""


def prompt_batch(rows: list[PromptRow], tokenizer: PreTrainedTokenizerBase) -> Batch:
    """Left-padded input_ids/attention_mask [B, P] + prompt_text/ground_truth columns,
    and tools_kwargs when some row has them."""
    encoded = tokenizer(
        [row.prompt for row in rows], padding=True, return_tensors="pt", padding_side="left"
    )
    non_tensors = {
        "prompt_text": [row.prompt for row in rows],
        "ground_truth": [row.ground_truth for row in rows],
    }
    if any(row.tools_kwargs for row in rows):
        non_tensors["tools_kwargs"] = [row.tools_kwargs for row in rows]
    return Batch(
        tensors={
            "input_ids": encoded["input_ids"].to(torch.int64),
            "attention_mask": encoded["attention_mask"].to(torch.int64),
        },
        non_tensors=non_tensors,
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
