"""What the algos tests share: mask layouts (right and left padding, gaps, an empty row)
over several seeds, prompt groups of size 1..4, policy batches with garbage outside the
mask, and the plain-loop references several modules' tests compare against.

Each helper is also a fixture of its own name: test modules cannot import a conftest.
"""

from __future__ import annotations

import math

import pytest
import torch

SEEDS = (0, 1, 2)
MASK_KINDS = ("right_padded", "left_padded", "gaps", "random_with_empty_row")


def make_mask(kind: str, gen: torch.Generator, batch: int = 5, length: int = 7) -> torch.Tensor:
    """A (batch, length) bool response mask of the given layout, >= 2 valid tokens."""
    lengths = torch.randint(1, length + 1, (batch,), generator=gen)
    positions = torch.arange(length)[None, :]
    if kind == "right_padded":
        mask = positions < lengths[:, None]
    elif kind == "left_padded":
        mask = positions >= (length - lengths)[:, None]
    elif kind == "gaps":
        # a run of tokens, then a hole (e.g. tool output), then another run
        mask = torch.zeros(batch, length, dtype=torch.bool)
        for row in range(batch):
            start = int(torch.randint(0, 2, (1,), generator=gen))
            hole = int(torch.randint(start + 1, length - 1, (1,), generator=gen))
            mask[row, start:hole] = True
            mask[row, hole + 1 :] = True
    elif kind == "random_with_empty_row":
        mask = torch.rand(batch, length, generator=gen) < 0.6
        mask[0] = False
        mask[1, :2] = True
    else:
        raise AssertionError(kind)
    mask[-1, :2] = True  # at least two valid tokens in the batch, for whitening
    return mask


def all_masks(batch: int = 5, length: int = 7):
    """(seed, kind, generator, mask) for every seed and mask layout."""
    for seed in SEEDS:
        for kind in MASK_KINDS:
            gen = torch.Generator().manual_seed(seed)
            yield seed, kind, gen, make_mask(kind, gen, batch, length)


def make_groups(gen: torch.Generator, num_groups: int = 4) -> torch.Tensor:
    """Shuffled int64 group ids with group sizes 1..4 and arbitrary (non-dense) ids."""
    sizes = torch.randint(1, 5, (num_groups,), generator=gen).tolist()
    sizes[0] = 1  # always a singleton
    ids = [1000 + 7 * g for g, size in enumerate(sizes) for _ in range(size)]
    perm = torch.randperm(len(ids), generator=gen)
    return torch.tensor(ids, dtype=torch.int64)[perm]


def mask_for(batch: int, gen: torch.Generator, length: int = 6) -> torch.Tensor:
    kinds = MASK_KINDS[:3]
    kind = kinds[int(torch.randint(0, len(kinds), (1,), generator=gen))]
    return make_mask(kind, gen, batch, length)


def ref_whiten(rows: list[list[float]], mask: list[list[bool]]) -> list[list[float]]:
    """Plain-loop whitening over all valid entries (unbiased variance, eps 1e-8)."""
    valid = [
        x for row, mrow in zip(rows, mask, strict=True) for x, m in zip(row, mrow, strict=True) if m
    ]
    mean = sum(valid) / len(valid)
    var = sum((x - mean) ** 2 for x in valid) / (len(valid) - 1)
    return [
        [(x - mean) / math.sqrt(var + 1e-8) if m else 0.0 for x, m in zip(row, mrow, strict=True)]
        for row, mrow in zip(rows, mask, strict=True)
    ]


def close(actual, expected, atol: float = 1e-6) -> None:
    expected = torch.as_tensor(expected, dtype=actual.dtype)
    torch.testing.assert_close(actual, expected, atol=atol, rtol=1e-5)


def random_group_batch(seed):
    gen = torch.Generator().manual_seed(seed)
    group_ids = make_groups(gen)
    batch = group_ids.numel()
    # few distinct values so ties (std 0 groups) happen too
    scores = torch.randint(0, 3, (batch,), generator=gen).to(torch.float64)
    scores += 0.1 * torch.randn(batch, generator=gen, dtype=torch.float64) * (seed % 2)
    return scores, group_ids, mask_for(batch, gen)


def policy_batch(gen, mask, spread_=0.5):
    """(old, new, adv) float64 with nan garbage outside the mask."""
    old = -torch.rand(mask.shape, generator=gen, dtype=torch.float64) * 3
    new = old + spread_ * torch.randn(mask.shape, generator=gen, dtype=torch.float64)
    adv = torch.randn(mask.shape, generator=gen, dtype=torch.float64)
    for t in (old, new, adv):
        t[~mask] = float("nan")
    return old, new.requires_grad_(), adv


def ref_weights(mask, mode):
    """Per-token weight of the aggregate, for token-mean / seq-mean-token-mean."""
    rows = [sum(r) for r in mask]
    if mode == "token-mean":
        n = sum(rows)
        return [[1 / n if m else 0.0 for m in r] for r in mask]
    seqs = sum(1 for n in rows if n)
    return [[1 / (seqs * n) if m else 0.0 for m in r] for r, n in zip(mask, rows, strict=True)]


def ref_loss_and_grad(losses, grads, mask, mode):
    """The aggregate of per-token losses and its gradient w.r.t. log_probs.

    ``grads[b][t]`` is d(Σ_t' losses[b][t']) / d log_probs[b][t], the row's summed loss
    differentiated by one token; weighting it by the token's weight is exact because
    both modes tested weigh all tokens of a row the same."""
    weights = ref_weights(mask, mode)
    value = sum(
        w * x
        for wr, lr, mr in zip(weights, losses, mask, strict=True)
        for w, x, m in zip(wr, lr, mr, strict=True)
        if m
    )
    grad = [
        [w * g if m else 0.0 for w, g, m in zip(wr, gr, mr, strict=True)]
        for wr, gr, mr in zip(weights, grads, mask, strict=True)
    ]
    return value, grad


def check_policy_loss(fn, kwargs, ref_tokens, msg, probabilities=False):
    """Runs fn over every seed and mask layout against a per-row loop reference.

    ``ref_tokens(old_row, new_row, adv_row, mask_row)`` returns the row's per-token
    losses and grads as :func:`ref_loss_and_grad` takes them. ``probabilities``: keep
    the new log-probs <= 0 (losses that read the probabilities themselves)."""
    for seed, kind, gen, mask in all_masks():
        old, new, adv = policy_batch(gen, mask)
        if probabilities:
            new = new.detach().clamp(max=-1e-3).requires_grad_()
        for mode in ("token-mean", "seq-mean-token-mean"):
            new.grad = None
            loss, metrics = fn(old, new, adv, mask, loss_agg_mode=mode, **kwargs)
            loss.backward()
            losses, grads = [], []
            for ro, rn, ra, rm in zip(
                old.tolist(), new.detach().tolist(), adv.tolist(), mask.tolist(), strict=True
            ):
                row_losses, row_grads = ref_tokens(ro, rn, ra, rm)
                losses.append(row_losses)
                grads.append(row_grads)
            value, grad = ref_loss_and_grad(losses, grads, mask.tolist(), mode)
            where = f"{msg} seed={seed} {kind} {mode}"
            torch.testing.assert_close(
                loss.detach(), torch.tensor(value, dtype=torch.float64), msg=where
            )
            torch.testing.assert_close(new.grad, torch.tensor(grad, dtype=torch.float64), msg=where)
            assert set(metrics) >= {"pg_loss", "pg_clipfrac", "ppo_kl", "pg_clipfrac_lower"}


@pytest.fixture(name="close", scope="session")
def _close_fixture():
    """close(actual, expected, atol=1e-6): assert_close to a number or nested list."""
    return close


@pytest.fixture(name="make_mask", scope="session")
def _make_mask_fixture():
    """make_mask(kind, gen, batch=5, length=7) -> (batch, length) bool mask."""
    return make_mask


@pytest.fixture(name="all_masks", scope="session")
def _all_masks_fixture():
    """all_masks(batch=5, length=7) -> (seed, kind, generator, mask) per seed and layout."""
    return all_masks


@pytest.fixture(name="make_groups", scope="session")
def _make_groups_fixture():
    """make_groups(gen, num_groups=4) -> shuffled group ids, sizes 1..4."""
    return make_groups


@pytest.fixture(name="mask_for", scope="session")
def _mask_for_fixture():
    """mask_for(batch, gen, length=6) -> a mask of a random layout, no empty row."""
    return mask_for


@pytest.fixture(name="ref_whiten", scope="session")
def _ref_whiten_fixture():
    """ref_whiten(rows, mask) -> plain-loop whitening over the valid entries."""
    return ref_whiten


@pytest.fixture(name="random_group_batch", scope="session")
def _random_group_batch_fixture():
    """random_group_batch(seed) -> (scores, group_ids, mask) with ties and singletons."""
    return random_group_batch


@pytest.fixture(name="policy_batch", scope="session")
def _policy_batch_fixture():
    """policy_batch(gen, mask, spread_=0.5) -> (old, new, adv), nan outside the mask."""
    return policy_batch


@pytest.fixture(name="ref_loss_and_grad", scope="session")
def _ref_loss_and_grad_fixture():
    """ref_loss_and_grad(losses, grads, mask, mode) -> aggregate and its gradient."""
    return ref_loss_and_grad


@pytest.fixture(name="check_policy_loss", scope="session")
def _check_policy_loss_fixture():
    """check_policy_loss(fn, kwargs, ref_tokens, msg, probabilities=False)."""
    return check_policy_loss
