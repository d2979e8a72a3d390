"""The torch-free wire reader agrees with the torch codec on every message."""

import numpy as np
import pytest
import torch

from rlserve.core.batch import Batch
from rlserve.core.codec import CodecError, batch_from_proto, batch_to_proto
from rlserve.core.wire import arrays_to_proto, columns_from_proto
from rlserve.v1 import common_pb2


def _batch() -> Batch:
    return Batch(
        tensors={"input_ids": torch.arange(6).reshape(3, 2), "flags": torch.tensor([1, 0, 1]) > 0},
        non_tensors={"response_text": ["a", "b", None], "score": [1, 2.5, True]},
        meta={"weights_version": 4, "step": 2, "temperature": 0.7},
    )


def test_columns_match_the_codecs_decoding():
    message = batch_to_proto(_batch())
    decoded = batch_from_proto(message)
    columns = columns_from_proto(message)
    assert len(columns) == len(decoded) == 3
    assert columns.non_tensors == decoded.non_tensors
    assert columns.meta == decoded.meta


def test_columns_without_tensors_count_rows_from_columns():
    message = batch_to_proto(Batch(non_tensors={"response_text": ["x", "y"]}))
    assert len(columns_from_proto(message)) == 2
    assert len(columns_from_proto(common_pb2.Batch())) == 0


@pytest.mark.parametrize(
    ("mutate", "error"),
    [
        (lambda m: m.tensors["input_ids"].shape.__setitem__(0, 4), r"tensors\['input_ids'\]\.data"),
        (
            lambda m: setattr(m.tensors["flags"], "data", b"\x00\x02\x01"),
            "bytes other than 0 and 1",
        ),
        (lambda m: setattr(m.tensors["flags"], "dtype", 99), r"tensors\['flags'\]\.dtype"),
        (lambda m: m.non_tensors["response_text"].values.pop(), "same number of rows"),
        (lambda m: m.non_tensors["input_ids"].values.add(), "both a tensor and a non-tensor"),
    ],
)
def test_hostile_messages_fail_as_the_codec_fails(mutate, error):
    message = batch_to_proto(_batch())
    mutate(message)
    with pytest.raises(CodecError, match=error):
        columns_from_proto(message)
    with pytest.raises(CodecError):
        batch_from_proto(message)


def test_arrays_decode_to_the_same_tensors():
    scores = np.array([0.25, -1.0, 3.5], dtype=np.float32)
    message = arrays_to_proto({"scores": scores}, {"weights_version": 7, "tag": "x"})
    decoded = batch_from_proto(message)
    assert decoded["scores"].dtype == torch.float32
    assert decoded["scores"].tolist() == scores.tolist()
    assert decoded.meta == {"weights_version": 7, "step": 0, "tag": "x"}


def test_arrays_of_unsupported_dtype_name_the_field():
    with pytest.raises(CodecError, match=r"tensors\['scores'\]: dtype float64"):
        arrays_to_proto({"scores": np.zeros(2)}, {})
