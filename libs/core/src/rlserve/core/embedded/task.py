"""The synthetic verifiable task: two-number addition, "23+45=" -> "68".

Rows use the flat prompt / ground_truth layout that rlserve reads from jsonl or parquet.
Train and held-out sets are disjoint sets of (a, b) pairs.
"""

import json
import random
from pathlib import Path


def addition_rows(operand_max: int, train_pairs: int, eval_pairs: int, seed: int):
    """Returns (train_rows, eval_rows), each a list of {"prompt", "ground_truth"} dicts."""
    all_pairs = [(a, b) for a in range(operand_max + 1) for b in range(operand_max + 1)]
    if train_pairs + eval_pairs > len(all_pairs):
        raise ValueError(
            f"train_pairs + eval_pairs = {train_pairs + eval_pairs} exceeds the "
            f"{len(all_pairs)} distinct pairs with operands 0..{operand_max}"
        )
    random.Random(seed).shuffle(all_pairs)
    rows = [{"prompt": f"{a}+{b}=", "ground_truth": str(a + b)} for a, b in all_pairs]
    return rows[:train_pairs], rows[train_pairs : train_pairs + eval_pairs]


def exact_match(response_text: str, ground_truth: str) -> bool:
    """The task's score: the response is the answer, surrounding whitespace aside."""
    return response_text.strip() == ground_truth.strip()


def write_jsonl(rows: list[dict], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as out:
        out.writelines(json.dumps(row) + "\n" for row in rows)


def read_jsonl(path: Path) -> list[dict]:
    with path.open() as lines:
        return [json.loads(line) for line in lines if line.strip()]
