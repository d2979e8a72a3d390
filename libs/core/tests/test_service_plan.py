"""MiniBatchPlan: one plan of an update's mini-batches for the actor's and the critic's form."""

import pytest
import torch

from rlserve.core.batch import Batch
from rlserve.core.service.plan import MiniBatchPlan, loss_units

MASK = torch.tensor(
    [[1, 1, 0], [1, 0, 0], [0, 0, 0], [1, 1, 1], [1, 1, 1], [1, 0, 0], [1, 0, 0], [0, 0, 0]]
)


def test_shares_tile_each_mini_batch_whatever_the_rank_count():
    one = MiniBatchPlan.of(MASK, 4, ranks=1, epochs=2, seed=7)
    two = MiniBatchPlan.of(MASK, 4, ranks=2, epochs=2, seed=7)
    assert len(one.mini_batches) == 4  # 8 rows / 4 × 2 epochs
    for index, rows in enumerate(one.mini_batches):
        assert torch.equal(torch.cat([two.share(index, 0), two.share(index, 1)]), rows)
        assert one.units(index, "token-mean") == int(MASK[rows].sum())
        assert one.units(index, "seq-mean-token-mean") == int(MASK[rows].any(1).sum())
        assert one.units(index, "token-mean") == loss_units(MASK[rows], "token-mean")
    assert (one.tokens, one.sequences) == (two.tokens, two.sequences)
    for epoch in range(2):
        rows = torch.cat(one.mini_batches[epoch * 2 : epoch * 2 + 2])
        assert sorted(rows.tolist()) == list(range(8))
    with pytest.raises(ValueError, match="do not tile"):
        MiniBatchPlan.of(MASK, 3, ranks=1, epochs=1, seed=0)


def test_the_two_forms_carry_the_same_rows_and_units():
    batch = Batch({"response_mask": MASK, "row": torch.arange(8)})
    plan = MiniBatchPlan.of(MASK, 4, ranks=2, epochs=2, seed=3)
    for rank, (ordered, update) in enumerate(
        zip(plan.ordered_shares(batch, True), plan.rank_updates(batch, "token-mean"), strict=True)
    ):
        assert torch.equal(ordered["row"], plan.rank_rows(rank))
        assert len(update.batch) == len(set(plan.rank_rows(rank).tolist()))  # each row once
        trained = torch.cat([update.batch["row"][part.rows] for part in update.mini_batches])
        assert torch.equal(trained, ordered["row"])
        expected = torch.tensor(plan.tokens, dtype=torch.float32).repeat_interleave(2)
        assert torch.equal(ordered["mini_batch_tokens"], expected)
        assert [part.global_units for part in update.mini_batches] == list(plan.tokens)
    assert "mini_batch_tokens" not in plan.ordered_shares(batch, False)[0].tensors


def test_single_pass_results_come_back_in_request_order():
    plan = MiniBatchPlan.of(MASK, 8, ranks=2, epochs=1, seed=1)
    parts = [Batch({"row": plan.rank_rows(rank) * 10}) for rank in range(2)]
    assert plan.in_request_order(parts, 8)["row"].tolist() == [i * 10 for i in range(8)]
