"""DAPO's dynamic sampling helpers: which groups are kept, and how rounds join."""

import pytest
import torch

from rlserve.core.batch import Batch
from rlserve.trainer.dynamic_sampling import concat_rounds, first_groups, informative_rows

PAD = 9


def test_informative_rows_by_hand():
    scores = torch.tensor([1.0, 1.0, 0.0, 1.0, 0.5, 0.5, 2.0])
    uids = [0, 0, 1, 1, 2, 2, 3]  # group 3 has one response: nothing to compare
    assert informative_rows(scores, uids).tolist() == [
        False,
        False,
        True,
        True,
        False,
        False,
        False,
    ]


@pytest.mark.parametrize("seed", range(5))
def test_informative_rows_match_a_loop(seed):
    generator = torch.Generator().manual_seed(seed)
    uids = torch.randint(0, 12, (60,), generator=generator).tolist()
    scores = torch.randint(0, 2, (60,), generator=generator).float()
    expected = [len({float(scores[j]) for j, u in enumerate(uids) if u == uid}) > 1 for uid in uids]
    assert informative_rows(scores, uids).tolist() == expected


def _round(prompt_width: int, uids: list[int], first_token: int) -> Batch:
    rows = len(uids)
    prompt = torch.full((rows, prompt_width), first_token)
    responses = torch.arange(rows * 3).reshape(rows, 3)
    return Batch(
        {
            "input_ids": torch.cat([prompt, responses], dim=1),
            "attention_mask": torch.ones(rows, prompt_width + 3, dtype=torch.int64),
            "responses": responses,
            "response_mask": torch.ones(rows, 3, dtype=torch.int64),
            "scores": torch.arange(rows, dtype=torch.float32),
        },
        {"uid": uids, "ground_truth": [str(u) for u in uids]},
        {"weights_version": 4},
    )


def test_rounds_join_left_padded_with_their_groups_apart():
    first, second = _round(2, [0, 0, 1, 1], 5), _round(4, [0, 0], 6)
    joined = concat_rounds([first, second], PAD)
    assert joined["uid"] == [0, 0, 1, 1, 2, 2]
    assert joined["ground_truth"] == ["0", "0", "1", "1", "0", "0"]
    assert joined["input_ids"].shape == (6, 7)
    assert joined["input_ids"][0].tolist() == [PAD, PAD, 5, 5, 0, 1, 2]
    assert joined["attention_mask"][0].tolist() == [0, 0, 1, 1, 1, 1, 1]
    assert joined["input_ids"][4].tolist() == [6, 6, 6, 6, 0, 1, 2]
    assert torch.equal(joined["responses"], torch.cat([first["responses"], second["responses"]]))
    assert joined["scores"].tolist() == [0, 1, 2, 3, 0, 1]
    assert joined.meta == {"weights_version": 4}


def test_first_groups_keeps_whole_groups_in_order():
    batch = _round(2, [3, 3, 1, 1, 7, 7], 5)
    kept = first_groups(batch, 2)
    assert kept["uid"] == [3, 3, 1, 1]
    assert kept["scores"].tolist() == [0, 1, 2, 3]
    assert first_groups(batch, 5)["uid"] == batch["uid"]
