"""The embedded multi-turn task: "a*b+c=" prompts the tiny model answers with a
calculator it calls itself.

The tiny character model cannot multiply, but it can write the call "[calc: a*b]", read
the product the tool answers and add c itself. Its tokenizer's chat template renders a
tool's answer as "=<answer>;" and everything else as its bare text, so a whole episode
reads as one line: "7*8+5=[calc: 7*8]=56;61". The model's tokens are the call and the
answer (with EOS); "=56;" is the tool's (response mask 0).

The warm-up teaches that format on whole episodes (loss on the model's tokens only); its
accuracy check plays episodes in process, with the product computed here in place of
the environment service (`local_calculator`), so preparing the task needs no cluster.
The same task without tools (the single-turn baseline) is the addition task's shape:
"a*b+c=" answered directly.
"""

from __future__ import annotations

import random
import re

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from rlserve.core.embedded.task import exact_match

CHAT_TEMPLATE = (
    "{% for m in messages %}{% if m['role'] == 'tool' %}={{ m['content'] }};"
    "{% else %}{{ m['content'] }}{% endif %}{% endfor %}"
)
"""Tool answers as "=<answer>;", every other message as its text, no generation prompt."""
TOOL_NAME = "calc"
"""The name the model calls the calculator by (the run's tool of that name)."""
_CALL = re.compile(r"\[calc: (\d+)\*(\d+)\]")
_PROMPT = re.compile(r"(\d+)\*(\d+)\+(\d+)=")
IGNORE_INDEX = -100


def product_plus_rows(operand_max: int, train_rows: int, eval_rows: int, seed: int):
    """(train_rows, eval_rows) of distinct (a, b, c) with operands in 0..operand_max:
    {"prompt": "a*b+c=", "ground_truth": "<a*b+c>"}."""
    triples = [
        (a, b, c)
        for a in range(operand_max + 1)
        for b in range(operand_max + 1)
        for c in range(operand_max + 1)
    ]
    if train_rows + eval_rows > len(triples):
        raise ValueError(
            f"train + eval rows = {train_rows + eval_rows} exceed the {len(triples)} distinct "
            f"triples with operands 0..{operand_max}"
        )
    random.Random(seed).shuffle(triples)
    rows = [
        {"prompt": f"{a}*{b}+{c}=", "ground_truth": str(a * b + c)}
        for a, b, c in triples[: train_rows + eval_rows]
    ]
    return rows[:train_rows], rows[train_rows:]


def episode_segments(row: dict) -> list[tuple[str, bool]]:
    """A whole episode as (text, the model's?) segments after the prompt."""
    a, b, c = map(int, _PROMPT.fullmatch(row["prompt"]).groups())
    return [(f"[{TOOL_NAME}: {a}*{b}]", True), (f"={a * b};", False), (str(a * b + c), True)]


def encode_episodes(
    rows: list[dict], tokenizer: PreTrainedTokenizerBase
) -> list[tuple[list[int], list[int]]]:
    """(input ids, labels) per row: <bos> prompt, then the episode, labels only on the
    model's tokens (the call, the answer and <eos>)."""
    encoded = []
    for row in rows:
        ids = tokenizer(row["prompt"])["input_ids"]
        labels = [IGNORE_INDEX] * len(ids)
        for text, models in episode_segments(row):
            piece = tokenizer(text, add_special_tokens=False)["input_ids"]
            ids += piece
            labels += piece if models else [IGNORE_INDEX] * len(piece)
        ids.append(tokenizer.eos_token_id)
        labels.append(tokenizer.eos_token_id)
        encoded.append((ids, labels))
    return encoded


def local_calculator(turn: str) -> str:
    """What the run's calculator answers a turn's call, for the warm-up's checks only:
    the product of a "[calc: a*b]" call, else an error."""
    call = _CALL.search(turn)
    return str(int(call[1]) * int(call[2])) if call else "Error"


@torch.no_grad()
def episode_accuracy(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    rows: list[dict],
    max_new_tokens: int,
) -> float:
    """Greedy episodes: the first turn (stopped at "]" or EOS); when it called, the
    local calculator's answer and the model's second turn; the fraction whose last turn
    is the ground truth."""
    model.eval()
    prompts = [tokenizer(row["prompt"])["input_ids"] for row in rows]
    firsts = _greedy(model, tokenizer, prompts, max_new_tokens, stop_strings=["]"])
    texts = tokenizer.batch_decode(firsts, skip_special_tokens=True)
    called = [i for i, first in enumerate(firsts) if first[-1:] != [tokenizer.eos_token_id]]
    second = []
    for i in called:
        answer = tokenizer(f"={local_calculator(texts[i])};", add_special_tokens=False)
        second.append(prompts[i] + firsts[i] + answer["input_ids"])
    if second:
        answers = _greedy(model, tokenizer, second, max_new_tokens)
        answer_texts = tokenizer.batch_decode(answers, skip_special_tokens=True)
        for i, text in zip(called, answer_texts, strict=True):
            texts[i] = text
    return sum(
        exact_match(t, row["ground_truth"]) for t, row in zip(texts, rows, strict=True)
    ) / len(rows)


def _greedy(model, tokenizer, sequences, max_new_tokens, stop_strings=None) -> list[list[int]]:
    """Greedy continuations of left-padded `sequences`, each cut after EOS or a stop
    string (the engines' rule)."""
    width = max(map(len, sequences))
    input_ids = torch.full((len(sequences), width), tokenizer.pad_token_id)
    attention_mask = torch.zeros((len(sequences), width), dtype=torch.long)
    for row, ids in enumerate(sequences):
        input_ids[row, width - len(ids) :] = torch.tensor(ids)
        attention_mask[row, width - len(ids) :] = 1
    output = model.generate(
        input_ids=input_ids,
        attention_mask=attention_mask,
        max_new_tokens=max_new_tokens,
        do_sample=False,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        stop_strings=stop_strings,
        tokenizer=tokenizer if stop_strings else None,
    )
    continuations = []
    for row in output[:, width:].tolist():
        cut = []
        for token in row:
            cut.append(token)
            text = tokenizer.decode(cut, skip_special_tokens=True)
            if token == tokenizer.eos_token_id or any(s in text for s in stop_strings or ()):
                break
        continuations.append(cut)
    return continuations
