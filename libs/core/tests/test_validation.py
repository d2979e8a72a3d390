import grpc
import pytest
import torch

from rlserve.core.batch import Batch
from rlserve.core.serving import RpcError
from rlserve.core.tensor_checks import (
    require_finite,
    require_mask,
    require_sequences,
    require_tensor,
    require_token_ids,
)
from rlserve.core.validation import require_non_tensor, require_rows, require_tokens


def _raises(code, pattern, fn, *args, **kwargs):
    with pytest.raises(RpcError, match=pattern) as error:
        fn(*args, **kwargs)
    assert error.value.code == code


INVALID = grpc.StatusCode.INVALID_ARGUMENT


def test_rows_empty_and_oversized():
    batch = Batch(tensors={"x": torch.zeros(3, 1)})
    require_rows(batch, max_rows=3)
    _raises(INVALID, r"^batch: empty batch", require_rows, Batch(), 3)
    _raises(
        grpc.StatusCode.RESOURCE_EXHAUSTED, r"3 rows exceed .* limit of 2", require_rows, batch, 2
    )


def test_tensor_presence_dtype_and_rank():
    batch = Batch(tensors={"ids": torch.zeros(2, 3, dtype=torch.int32)})
    assert require_tensor(batch, "ids", (torch.int32,), 2).shape == (2, 3)
    _raises(
        INVALID,
        r"batch.tensors\['mask'\]: missing.*\['ids'\]",
        require_tensor,
        batch,
        "mask",
        (torch.int64,),
        2,
    )
    _raises(
        INVALID,
        r"dtype must be float32, got torch.int32",
        require_tensor,
        batch,
        "ids",
        (torch.float32,),
        2,
    )
    _raises(
        INVALID,
        r"must have 3 dims, got shape \[2, 3\]",
        require_tensor,
        batch,
        "ids",
        (torch.int32,),
        3,
    )


def test_token_ids_in_vocab():
    batch = Batch(tensors={"ids": torch.tensor([[0, 5], [9, 2]])})
    assert require_token_ids(batch, "ids", vocab_size=10).dtype == torch.int64
    _raises(INVALID, r"token ids must lie in 0..8, got 0..9", require_token_ids, batch, "ids", 9)
    negative = Batch(tensors={"ids": torch.tensor([[-1]])})
    _raises(INVALID, r"got -1..-1", require_token_ids, negative, "ids", 9)


def test_mask_shape_and_values():
    ids = torch.zeros(2, 3, dtype=torch.int64)
    good = Batch(tensors={"m": torch.tensor([[1, 1, 0], [0, 1, 1]])})
    assert require_mask(good, "m", ids, "input_ids").tolist() == [[1, 1, 0], [0, 1, 1]]
    short = Batch(tensors={"m": torch.ones(2, 2, dtype=torch.int64)})
    _raises(
        INVALID,
        r"shape \[2, 2\] must match input_ids \[2, 3\]",
        require_mask,
        short,
        "m",
        ids,
        "input_ids",
    )
    twos = Batch(tensors={"m": torch.full((2, 3), 2)})
    _raises(INVALID, r"must hold only 0 and 1", require_mask, twos, "m", ids, "input_ids")
    boolean = Batch(tensors={"m": torch.ones(2, 3, dtype=torch.bool)})
    assert require_mask(boolean, "m", ids, "input_ids").dtype == torch.int64


def test_finite():
    require_finite(torch.tensor([0.0, -1.0]), "advantages")
    _raises(
        INVALID,
        r"\['advantages'\]: 2 values are NaN or infinite",
        require_finite,
        torch.tensor([float("nan"), 1.0, float("inf")]),
        "advantages",
    )
    _raises(INVALID, r"must be float", require_finite, torch.tensor([1]), "advantages")


def test_non_tensor():
    batch = Batch(non_tensors={"ground_truth": ["1", "2"]})
    assert require_non_tensor(batch, "ground_truth") == ["1", "2"]
    _raises(
        INVALID,
        r"non_tensors\['response_text'\]: missing",
        require_non_tensor,
        batch,
        "response_text",
    )


def _sequences(prompt_len: int, response_len: int) -> dict[str, torch.Tensor]:
    ids = torch.arange(1, 1 + 2 * (prompt_len + response_len)).reshape(2, -1) % 9
    responses = ids[:, prompt_len:].clone()
    return {
        "input_ids": ids,
        "attention_mask": torch.ones_like(ids),
        "responses": responses,
        "response_mask": torch.ones_like(responses),
        "values": torch.zeros(2, response_len),
    }


def test_sequences_layout_and_the_four_tensors_it_returns():
    clean = require_sequences(Batch(_sequences(3, 2), meta={"step": 4}), 9, 8)
    assert sorted(clean.tensors) == ["attention_mask", "input_ids", "response_mask", "responses"]
    assert clean.meta == {"step": 4}


def test_sequences_need_a_prompt_column_before_the_responses():
    """Issue 12 defect 5: responses filling all of input_ids (a zero-prompt batch)."""
    zero_prompt = Batch(_sequences(0, 4))
    _raises(
        INVALID,
        r"^batch\.tensors\['input_ids'\]: needs more positions \(4\) than responses \(4\)",
        require_sequences,
        zero_prompt,
        9,
        8,
    )
    _raises(
        INVALID, r"^update\.tensors\['input_ids'\]", require_sequences, zero_prompt, 9, 8, "update"
    )


def test_sequences_need_a_real_prompt_token_in_rows_with_a_response():
    """The masked zero-prompt batch: prompt columns exist but are all padding."""
    tensors = _sequences(3, 2)
    tensors["attention_mask"][1, :3] = 0
    _raises(
        INVALID,
        r"^batch\.tensors\['attention_mask'\]: row 1 has response tokens but no real prompt",
        require_sequences,
        Batch(tensors),
        9,
        8,
    )
    tensors["attention_mask"][1, 3:] = 0  # a row with neither prompt nor response is fine
    tensors["response_mask"][1] = 0
    require_sequences(Batch(tensors), 9, 8)


def test_sequences_need_a_real_token_right_before_each_response_token():
    """A right-padded prompt (its last column masked) would score the first response
    token from a padding position."""
    tensors = _sequences(3, 2)
    tensors["attention_mask"][0, 2] = 0
    _raises(
        INVALID,
        r"^batch\.tensors\['attention_mask'\]: row 0: response token 0 follows a masked "
        r"position \(input_ids column 2\)",
        require_sequences,
        Batch(tensors),
        9,
        8,
    )
    tensors = _sequences(3, 2)
    tensors["attention_mask"][1, 0] = 0  # left padding is how prompts come
    require_sequences(Batch(tensors), 9, 8)


def test_sequences_responses_must_be_the_real_tail_of_input_ids():
    tensors = _sequences(3, 2)
    tensors["responses"] = tensors["responses"].flip(1)
    _raises(
        INVALID,
        r"^batch\.tensors\['responses'\]: must equal",
        require_sequences,
        Batch(tensors),
        9,
        8,
    )
    tensors = _sequences(3, 2)
    tensors["attention_mask"][0, -1] = 0
    _raises(
        INVALID,
        r"^batch\.tensors\['response_mask'\]: marks positions",
        require_sequences,
        Batch(tensors),
        9,
        8,
    )
    tensors["response_mask"][0, -1] = 0  # a masked-out response position is fine
    require_sequences(Batch(tensors), 9, 8)


def test_token_positions_limit_names_the_field_the_count_and_the_setting():
    require_tokens(100, 100, "batch", "10 rows × 10")
    require_tokens(10**9, None, "batch", "no limit")
    _raises(
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        r"^batch: 10 rows × 11 = 110 token positions exceed this service's limit of 100 "
        r"\(its max_request_tokens setting\); split the request",
        require_tokens,
        110,
        100,
        "batch",
        "10 rows × 11",
    )
    batch = Batch(
        {
            "input_ids": torch.ones(4, 3, dtype=torch.long),
            "attention_mask": torch.ones(4, 3, dtype=torch.long),
            "responses": torch.ones(4, 1, dtype=torch.long),
            "response_mask": torch.ones(4, 1, dtype=torch.long),
        }
    )
    assert len(require_sequences(batch, 10, 4, max_tokens=12)) == 4
    _raises(
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        r"^batch.tensors\['input_ids'\]: 4 rows × 3 = 12 token positions exceed .* of 11 ",
        require_sequences,
        batch,
        10,
        4,
        max_tokens=11,
    )
