"""MiniBatchPlan: how one update's rows become optimizer steps, for the actor and the critic.

An update (UpdateActor, UpdateCritic) carries a batch of rows and trains `epochs` passes
over it in mini-batches of `mini_batch_samples` rows, one optimizer step each. The plan
is made once, in the controller, over the request's global rows:

- **Global order.** Each epoch is a fresh permutation of the rows (seeded, so a retry or
  a restored service plans the same), cut into mini-batches
  (rlserve.core.training.minibatch_indices). Mini-batch j of epoch e is the same set of
  rows whatever the number of ranks.
- **Equal shares.** Rank r trains on slice r of every mini-batch (`share`), so the ranks
  together cover exactly that mini-batch and N ranks train what one would.
- **Global loss units.** Each mini-batch's response tokens and sequences with a token,
  over every rank (`tokens`, `sequences`): what a worker divides its micro-batch's loss
  sum by, so that the split over ranks and micro-batches does not change the gradient
  (a micro-batch's loss is weighted by its own units over the mini-batch's).

A rank receives its rows in one of two forms: `ordered_shares` (its rows in training
order, the count columns beside them: the ActorWorker's form, rows repeated per epoch)
and `rank_updates` (the rows it uses once each, plus per mini-batch their local indices
and the global units: the CriticWorker's RankUpdate).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rlserve.core.batch import Batch
from rlserve.core.training import minibatch_indices

TOKENS_COLUMN = "mini_batch_tokens"
SEQUENCES_COLUMN = "mini_batch_sequences"
"""Per-row columns of `ordered_shares`: the row's mini-batch's global loss units."""


def loss_units(response_mask: torch.Tensor, loss_agg_mode: str) -> int:
    """What a loss of `loss_agg_mode` averages over in these rows: response tokens
    ("token-mean"), or sequences with at least one (the sequence modes)."""
    if loss_agg_mode == "token-mean":
        return int(response_mask.sum())
    return int(response_mask.bool().any(dim=1).sum())


def units_of(response_mask: torch.Tensor) -> tuple[int, int]:
    """(response tokens, sequences with a response token) of these rows."""
    mask = response_mask.bool()
    return int(mask.sum()), int(mask.any(dim=1).sum())


def count_columns(
    tokens: list[int], sequences: list[int], share_rows: int
) -> dict[str, torch.Tensor]:
    """The per-row count columns of a rank whose k-th block of `share_rows` rows is its
    share of mini-batch k (float32, as the workers read them)."""
    return {
        TOKENS_COLUMN: torch.tensor(tokens, dtype=torch.float32).repeat_interleave(share_rows),
        SEQUENCES_COLUMN: torch.tensor(sequences, dtype=torch.float32).repeat_interleave(
            share_rows
        ),
    }


@dataclass(frozen=True)
class MiniBatchSlice:
    """A rank's rows of one global mini-batch."""

    rows: torch.Tensor
    """Row indices into the rank's batch, int64 [mini_batch_samples / ranks]."""
    global_units: int
    """Loss units (see loss_units) of the whole mini-batch, over all ranks."""


@dataclass(frozen=True)
class RankUpdate:
    """What one rank trains on in one update (the `rank_updates` form)."""

    batch: Batch
    """The rows this rank uses, each once."""
    mini_batches: list[MiniBatchSlice]
    """In optimizer-step order (epoch-major)."""


@dataclass(frozen=True)
class MiniBatchPlan:
    """The mini-batches of one update, their shares per rank and their loss units."""

    ranks: int
    mini_batches: tuple[torch.Tensor, ...]
    """Global row indices of each mini-batch, in optimizer-step order (epoch-major)."""
    tokens: tuple[int, ...]
    """Response tokens of each mini-batch, over all ranks."""
    sequences: tuple[int, ...]
    """Sequences with a response token in each mini-batch, over all ranks."""

    @classmethod
    def of(
        cls,
        response_mask: torch.Tensor,
        mini_batch_samples: int,
        ranks: int,
        epochs: int,
        seed: int,
    ) -> MiniBatchPlan:
        """The plan for a batch whose response mask [rows, R] is given. The caller has
        checked (with a field-naming error) that rows tile the mini-batches; ranks must
        divide a mini-batch (the services' configs check it)."""
        rows = response_mask.shape[0]
        if rows % mini_batch_samples or mini_batch_samples % ranks:
            raise ValueError(
                f"{rows} rows, mini-batches of {mini_batch_samples} and {ranks} ranks do "
                "not tile: rows must be a multiple of the mini-batch, and it of the ranks"
            )
        mini_batches = tuple(
            indices for _, indices in minibatch_indices(rows, mini_batch_samples, epochs, seed)
        )
        units = [units_of(response_mask[indices]) for indices in mini_batches]
        return cls(
            ranks=ranks,
            mini_batches=mini_batches,
            tokens=tuple(tokens for tokens, _ in units),
            sequences=tuple(sequences for _, sequences in units),
        )

    @property
    def share_rows(self) -> int:
        """Rows of one rank's share of a mini-batch."""
        return len(self.mini_batches[0]) // self.ranks

    def share(self, index: int, rank: int) -> torch.Tensor:
        """Global row indices of rank `rank`'s share of mini-batch `index`."""
        size = self.share_rows
        return self.mini_batches[index][rank * size : (rank + 1) * size]

    def units(self, index: int, loss_agg_mode: str) -> int:
        """Mini-batch `index`'s global loss units (see loss_units)."""
        return self.tokens[index] if loss_agg_mode == "token-mean" else self.sequences[index]

    def rank_rows(self, rank: int) -> torch.Tensor:
        """Rank `rank`'s global row indices in training order: its share of every
        mini-batch, epoch by epoch."""
        return torch.cat([self.share(index, rank) for index in range(len(self.mini_batches))])

    def ordered_shares(self, batch: Batch, with_counts: bool) -> list[Batch]:
        """Each rank's rows of `batch` in training order; `with_counts` adds the count
        columns (TOKENS_COLUMN, SEQUENCES_COLUMN) of each row's mini-batch."""
        shares = [batch.index(self.rank_rows(rank)) for rank in range(self.ranks)]
        if not with_counts:
            return shares
        columns = count_columns(list(self.tokens), list(self.sequences), self.share_rows)
        return [Batch({**s.tensors, **columns}, s.non_tensors, s.meta) for s in shares]

    def rank_updates(self, batch: Batch, loss_agg_mode: str) -> list[RankUpdate]:
        """Each rank's RankUpdate: the rows of `batch` it uses, each once, and per
        mini-batch their indices in it with the mini-batch's global units."""
        updates = []
        for rank in range(self.ranks):
            parts = [self.share(index, rank) for index in range(len(self.mini_batches))]
            needed = torch.unique(torch.cat(parts))
            local = torch.full((len(batch),), -1, dtype=torch.int64)
            local[needed] = torch.arange(len(needed))
            slices = [
                MiniBatchSlice(local[part], self.units(index, loss_agg_mode))
                for index, part in enumerate(parts)
            ]
            updates.append(RankUpdate(batch=batch.index(needed), mini_batches=slices))
        return updates

    def in_request_order(self, parts: list[Batch], rows: int) -> Batch:
        """One batch of the ranks' per-row results (each rank's part in its `rank_rows`
        order), row i where the request had it. One epoch only: every row once."""
        tensors = {}
        for key in parts[0].tensors:
            first = parts[0][key]
            merged = first.new_zeros((rows, *first.shape[1:]))
            for rank, part in enumerate(parts):
                merged[self.rank_rows(rank)] = part[key]
            tensors[key] = merged
        return Batch(tensors=tensors)
