"""From a per-token loss term to the scalar a micro-batch backpropagates: the policy's
entropy, the loss aggregation modes, and the factor that makes a micro-batch's loss its
share of the whole mini-batch's."""

from __future__ import annotations

import torch
from torch import Tensor

from rlserve.core.algos.masked import check_2d, check_same_shape, masked_mean, masked_sum
from rlserve.core.algos.notes import AlgorithmNote


def entropy_from_logits(logits: Tensor) -> Tensor:
    """Entropy of the categorical distribution at each position, in nats.

    ``H = logsumexp(z) - Σ softmax(z)·z``: no log of a probability is taken, so it is
    stable for large logits; ``-inf`` logits (masked vocabulary) contribute 0.

    Args:
        logits: Unnormalised log-probs. Shape: (B, T, V) (any leading dims).

    Returns:
        Entropy per position. Shape: (B, T).
    """
    probs = torch.softmax(logits, dim=-1)
    # -inf logits have probability 0; zero them so 0·(-inf) does not give nan
    finite_logits = torch.where(torch.isneginf(logits), torch.zeros_like(logits), logits)
    # H = -Σ p·log p = -Σ p·(z - logsumexp z) = logsumexp z - Σ p·z
    return torch.logsumexp(logits, dim=-1) - (probs * finite_logits).sum(dim=-1)


LOSS_AGG_MODE_NOTES: dict[str, AlgorithmNote] = {
    "token-mean": AlgorithmNote(
        "mean over all response tokens of the micro-batch (every token weighs the same)",
        'Yu et al. 2025, "DAPO", arXiv:2503.14476',
    ),
    "seq-mean-token-sum": AlgorithmNote(
        "sum over each sequence's tokens, mean over sequences",
        "VeRL's aggregation modes",
    ),
    "seq-mean-token-mean": AlgorithmNote(
        "mean over each sequence's tokens, mean over sequences (every sequence weighs the same)",
        'Shao et al. 2024, "DeepSeekMath" (GRPO), arXiv:2402.03300',
    ),
    "token-sum": AlgorithmNote(
        "sum over all response tokens of the micro-batch (no normaliser)",
        "VeRL's aggregation modes",
    ),
    "seq-mean-token-sum-norm": AlgorithmNote(
        "each sequence's token sum over a constant (the padded response length, "
        "rollout.max_new_tokens), mean over sequences: no length bias",
        'Liu et al. 2025, "Understanding R1-Zero-Like Training" (Dr. GRPO), arXiv:2503.20783',
    ),
}
"""One line per loss aggregation mode, with its source."""


LOSS_AGG_MODES: tuple[str, ...] = tuple(LOSS_AGG_MODE_NOTES)
"""Names accepted by :func:`aggregate_loss`."""


def aggregate_loss(
    loss_mat: Tensor, response_mask: Tensor, mode: str, *, norm_tokens: float | None = None
) -> Tensor:
    """Reduce a per-token loss to a scalar.

    - ``"token-mean"``: mean over all response tokens of the batch (every token
      weighs the same; DAPO's choice).
    - ``"seq-mean-token-sum"``: sum over each sequence's tokens, mean over sequences.
    - ``"seq-mean-token-mean"``: mean over each sequence's tokens, mean over
      sequences (every sequence weighs the same; the original GRPO).
    - ``"token-sum"``: sum over all response tokens (0 for an empty mask).
    - ``"seq-mean-token-sum-norm"``: each sequence's token sum divided by the constant
      ``norm_tokens``, mean over sequences (Dr. GRPO, Liu et al., 2025,
      arXiv:2503.20783: a per-sequence ``1/|y|`` favours long wrong answers and short
      right ones; a constant divisor removes that bias). ``norm_tokens`` defaults to
      T, the padded response length, which in the actor is always
      ``rollout.max_new_tokens`` (responses are padded to it), so it is constant over a
      run. VeRL divides the *sum* over sequences instead of the mean, which makes the
      loss grow with the micro-batch size; the mean here matches the paper's 1/G.

    Sequences without any response token (padding rows) are left out of the
    sequence means. The mean is over this call's tokens/sequences: a trainer that
    accumulates gradients over micro-batches scales accordingly.

    Args:
        loss_mat: Per-token loss. Shape: (B, T).
        response_mask: 1 for response tokens. Shape: (B, T).
        mode: One of :data:`LOSS_AGG_MODES`.
        norm_tokens: The constant of ``"seq-mean-token-sum-norm"`` (> 0); None = T.

    Returns:
        The loss. Shape: () (0-dim).

    Raises:
        ValueError: On bad shapes, an unknown ``mode``, a non-positive ``norm_tokens``
            or an all-zero mask (except for ``"token-sum"``).
    """
    check_2d("loss_mat", loss_mat)
    check_same_shape(loss_mat=loss_mat, response_mask=response_mask)
    if mode not in LOSS_AGG_MODES:
        raise ValueError(
            f"unknown loss_agg_mode {mode!r}; valid modes: {', '.join(LOSS_AGG_MODES)}"
        )
    if norm_tokens is not None and not norm_tokens > 0:
        raise ValueError(f"norm_tokens must be > 0 (or None for T), got {norm_tokens}")
    if mode == "token-mean":
        return masked_mean(loss_mat, response_mask)
    if mode == "token-sum":
        return masked_sum(loss_mat, response_mask)
    # one value per sequence: token sum, token sum over a constant, or token mean
    if mode == "seq-mean-token-sum":
        per_sequence = masked_sum(loss_mat, response_mask, dim=1)
    elif mode == "seq-mean-token-sum-norm":
        constant = loss_mat.shape[1] if norm_tokens is None else norm_tokens
        per_sequence = masked_sum(loss_mat, response_mask, dim=1) / constant
    else:
        per_sequence = masked_mean(loss_mat, response_mask, dim=1)
    # average over the sequences that have at least one response token
    return masked_mean(per_sequence, response_mask.bool().any(dim=1))


def mini_batch_loss_scale(
    response_mask: Tensor,
    mode: str,
    *,
    mini_batch_tokens: float,
    mini_batch_sequences: float,
    ranks: int,
    accumulation_steps: int,
) -> Tensor:
    """Factor that makes a micro-batch's :func:`aggregate_loss` its share of the loss over
    the whole mini-batch, so the gradient does not depend on how the mini-batch is split
    over data-parallel ranks and micro-batches.

    :func:`aggregate_loss` divides by the micro-batch's own count (tokens for
    "token-mean", sequences with a token for the "seq-mean-*" modes), and the training
    engine then averages the micro-batches' gradients (÷ accumulation_steps) and the
    ranks' (÷ ranks). With ``n`` the micro-batch's count and ``N`` the mini-batch's::

        scale = n / N · ranks · accumulation_steps     (token-mean, seq-mean-*)
        scale = ranks · accumulation_steps             (token-sum: the mini-batch's sum)

    so the sum over micro-batches and mean over ranks of ``scale · loss`` is the loss of
    the mini-batch taken as one batch (VeRL's global-batch normalisation).

    Args:
        response_mask: The micro-batch's response mask. Shape: (B, T).
        mode: One of :data:`LOSS_AGG_MODES`.
        mini_batch_tokens: Response tokens in the whole mini-batch, every rank (> 0).
        mini_batch_sequences: Sequences with a response token in it, every rank (> 0).
        ranks: Data-parallel ranks the mini-batch is split over (>= 1).
        accumulation_steps: Micro-batches per rank in the mini-batch (>= 1).

    Returns:
        The factor. Shape: () (0-dim).

    Raises:
        ValueError: On an unknown mode or non-positive counts.
    """
    check_2d("response_mask", response_mask)
    if mode not in LOSS_AGG_MODES:
        raise ValueError(
            f"unknown loss_agg_mode {mode!r}; valid modes: {', '.join(LOSS_AGG_MODES)}"
        )
    if not (mini_batch_tokens > 0 and mini_batch_sequences > 0):
        raise ValueError(
            "mini_batch_tokens and mini_batch_sequences must be > 0, got "
            f"{mini_batch_tokens} and {mini_batch_sequences}"
        )
    if ranks < 1 or accumulation_steps < 1:
        raise ValueError(
            f"ranks and accumulation_steps must be >= 1, got {ranks}, {accumulation_steps}"
        )
    mask = response_mask.bool()
    averaged_over = float(ranks * accumulation_steps)
    if mode == "token-sum":
        return torch.tensor(averaged_over)
    if mode == "token-mean":
        share = mask.sum() / mini_batch_tokens
    else:
        share = mask.any(dim=1).sum() / mini_batch_sequences
    return share.to(torch.float32) * averaged_over
