"""DAPO's length shaping (Yu et al. 2025, "DAPO", arXiv:2503.14476): the soft overlong
penalty added to each score, and which responses generation cut off (left out of the
loss)."""

from __future__ import annotations

import torch
from torch import Tensor

from rlserve.core.algos.masked import check_2d, check_same_shape


def overlong_penalty(
    response_lengths: Tensor, max_response_tokens: int, buffer_tokens: int, factor: float = 1.0
) -> Tensor:
    """DAPO's soft overlong punishment, added to each sequence's score.

    Yu et al. 2025, "DAPO", arXiv:2503.14476, eq. 13: with L_max the longest response
    and a buffer of L_cache tokens before it, a response of L tokens gets 0 while
    L <= L_max - L_cache, then a penalty growing linearly to -factor at L = L_max, and
    -factor beyond (generation caps responses at L_max, so only a caller with longer
    ones sees that case). The penalty tells the policy that length itself costs,
    before truncation cuts an answer off.

    Args:
        response_lengths: Response tokens per sequence. Shape: (B,).
        max_response_tokens: L_max (>= 1).
        buffer_tokens: L_cache, in 1..L_max.
        factor: Penalty at L_max (>= 0).

    Returns:
        The penalty, <= 0. Shape: (B,), float32.

    Raises:
        ValueError: On a bad shape or setting.
    """
    if response_lengths.dim() != 1:
        raise ValueError(f"response_lengths must be (B,), got {tuple(response_lengths.shape)}")
    if max_response_tokens < 1:
        raise ValueError(f"max_response_tokens must be >= 1, got {max_response_tokens}")
    if not 1 <= buffer_tokens <= max_response_tokens:
        raise ValueError(
            f"buffer_tokens must be in 1..{max_response_tokens} (max_response_tokens), "
            f"got {buffer_tokens}"
        )
    if factor < 0:
        raise ValueError(f"factor must be >= 0, got {factor}")
    lengths = response_lengths.float()
    expected = max_response_tokens - buffer_tokens
    # linear in the buffer: 0 at its start, -factor at L_max; -factor beyond it
    penalty = (expected - lengths) / buffer_tokens * factor
    return penalty.clamp(min=-factor, max=0.0)


def truncated_responses(
    responses: Tensor, response_mask: Tensor, eos_token_id: int, max_response_tokens: int
) -> Tensor:
    """Which responses generation cut off: L_max tokens long without ending in EOS.

    DAPO (arXiv:2503.14476, "overlong filtering") leaves such samples out of the loss:
    a reasoning cut short is not wrong, and scoring it as wrong teaches noise.

    Args:
        responses: Response token ids, right-padded. Shape: (B, T).
        response_mask: 1 for response tokens. Shape: (B, T).
        eos_token_id: The tokenizer's end-of-sequence id.
        max_response_tokens: The generation cap L_max.

    Returns:
        True for a truncated response. Shape: (B,), bool.
    """
    check_2d("responses", responses)
    check_same_shape(responses=responses, response_mask=response_mask)
    mask = response_mask.bool()
    lengths = mask.sum(dim=1)
    positions = torch.arange(responses.shape[1], device=mask.device).expand_as(mask)
    last_index = torch.where(mask, positions, torch.zeros_like(positions)).amax(dim=1)
    last_token = responses.gather(1, last_index[:, None]).squeeze(1)
    return (lengths >= max_response_tokens) & (last_token != eos_token_id)
