"""DAPO's overlong shaping and filtering: hand-computed cases and plain-loop references."""

import pytest
import torch

from rlserve.core.algos.dapo import overlong_penalty, truncated_responses


def test_overlong_penalty_by_hand():
    lengths = torch.tensor([0, 3, 4, 5, 6, 8, 10])
    # L_max 8, buffer 4: free up to 4 tokens, then -1/4 per token, -1 from 8 on
    penalty = overlong_penalty(lengths, max_response_tokens=8, buffer_tokens=4)
    assert penalty.tolist() == [0.0, 0.0, 0.0, -0.25, -0.5, -1.0, -1.0]
    half = overlong_penalty(lengths, max_response_tokens=8, buffer_tokens=4, factor=0.5)
    assert half.tolist() == [0.0, 0.0, 0.0, -0.125, -0.25, -0.5, -0.5]


def _penalty_loop(length: int, max_tokens: int, buffer: int, factor: float) -> float:
    """The paper's piecewise definition, eq. 13 of arXiv:2503.14476."""
    if length <= max_tokens - buffer:
        return 0.0
    if length <= max_tokens:
        return (max_tokens - buffer - length) / buffer * factor
    return -factor


@pytest.mark.parametrize("seed", range(5))
def test_overlong_penalty_matches_the_piecewise_definition(seed):
    generator = torch.Generator().manual_seed(seed)
    max_tokens = int(torch.randint(1, 64, (), generator=generator))
    buffer = int(torch.randint(1, max_tokens + 1, (), generator=generator))
    factor = float(torch.rand((), generator=generator)) * 2
    lengths = torch.randint(0, max_tokens + 5, (50,), generator=generator)
    expected = torch.tensor([_penalty_loop(int(n), max_tokens, buffer, factor) for n in lengths])
    got = overlong_penalty(lengths, max_tokens, buffer, factor)
    torch.testing.assert_close(got, expected, atol=1e-6, rtol=0)


def test_overlong_penalty_refuses_bad_settings():
    lengths = torch.tensor([1, 2])
    with pytest.raises(ValueError, match=r"buffer_tokens must be in 1\.\.8"):
        overlong_penalty(lengths, 8, 0)
    with pytest.raises(ValueError, match=r"buffer_tokens must be in 1\.\.8"):
        overlong_penalty(lengths, 8, 9)
    with pytest.raises(ValueError, match="factor must be >= 0"):
        overlong_penalty(lengths, 8, 2, factor=-1)
    with pytest.raises(ValueError, match=r"response_lengths must be \(B,\)"):
        overlong_penalty(lengths[None], 8, 2)


EOS = 2


def test_truncated_responses_by_hand():
    responses = torch.tensor(
        [
            [5, 6, 7, 8],  # 4 = L_max tokens, no EOS: cut off
            [5, 6, 7, EOS],  # 4 tokens ending in EOS: finished
            [5, EOS, 0, 0],  # short
            [5, 6, 0, 0],  # short without EOS (ignore_eos / a stop string): not cut off
            [0, 0, 0, 0],  # no response at all
        ]
    )
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 1, 1], [1, 1, 0, 0], [1, 1, 0, 0], [0, 0, 0, 0]])
    got = truncated_responses(responses, mask, EOS, max_response_tokens=4)
    assert got.tolist() == [True, False, False, False, False]


@pytest.mark.parametrize("seed", range(5))
def test_truncated_responses_match_a_loop(seed):
    generator = torch.Generator().manual_seed(seed)
    rows, width = 40, 6
    lengths = torch.randint(0, width + 1, (rows,), generator=generator)
    responses = torch.randint(0, 5, (rows, width), generator=generator)
    mask = (torch.arange(width)[None, :] < lengths[:, None]).int()
    responses = responses * mask  # right padding with 0
    expected = [
        int(n) >= width and int(responses[i, int(n) - 1]) != EOS for i, n in enumerate(lengths)
    ]
    assert truncated_responses(responses, mask, EOS, width).tolist() == expected
