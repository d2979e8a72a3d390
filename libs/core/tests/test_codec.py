import math

import pytest
import torch

from rlserve.core.batch import Batch
from rlserve.core.codec import (
    SUPPORTED_DTYPES,
    CodecError,
    batch_from_proto,
    batch_to_proto,
    tensor_from_proto,
    tensor_to_proto,
)
from rlserve.v1 import common_pb2

SHAPES = [(), (0,), (3,), (2, 0, 5), (4, 7), (2, 3, 5)]


def _random_tensor(shape, dtype, generator):
    if dtype == torch.bool:
        return torch.rand(shape, generator=generator) > 0.5
    if dtype.is_floating_point:
        return (torch.randn(shape, generator=generator) * 100).to(dtype)
    info = torch.iinfo(dtype)
    return torch.randint(info.min, info.max, shape, generator=generator, dtype=dtype)


@pytest.mark.parametrize("dtype", SUPPORTED_DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_round_trip_every_dtype_and_shape(dtype, shape):
    generator = torch.Generator().manual_seed(0)
    original = _random_tensor(shape, dtype, generator)
    wire = tensor_to_proto(original).SerializeToString()
    message = common_pb2.Tensor.FromString(wire)
    decoded = tensor_from_proto(message)
    assert decoded.dtype == dtype
    assert tuple(decoded.shape) == shape
    assert torch.equal(decoded, original)


def test_bytes_are_little_endian_c_order():
    tensor = torch.tensor([[1, 2], [3, 256]], dtype=torch.int32)
    message = tensor_to_proto(tensor.t())  # non-contiguous input is laid out in C order
    assert list(message.shape) == [2, 2]
    assert message.data == b"".join(v.to_bytes(4, "little") for v in (1, 3, 2, 256))


def test_special_float_values_survive():
    tensor = torch.tensor([float("nan"), float("inf"), -float("inf"), -0.0, 1e-45])
    decoded = tensor_from_proto(tensor_to_proto(tensor))
    assert torch.equal(decoded.isnan(), tensor.isnan())
    assert decoded[1:4].tolist() == [math.inf, -math.inf, 0.0]
    assert math.copysign(1, decoded[3].item()) == -1


def test_decoded_tensor_is_writable_and_independent():
    message = tensor_to_proto(torch.arange(4, dtype=torch.int64))
    first = tensor_from_proto(message)
    first[0] = 99
    assert tensor_from_proto(message)[0] == 0


def test_unsupported_dtype_names_field():
    with pytest.raises(CodecError, match=r"input_ids: dtype torch.complex64 is not supported"):
        tensor_to_proto(torch.zeros(2, dtype=torch.complex64), name="input_ids")


@pytest.mark.parametrize(
    ("message", "pattern"),
    [
        (common_pb2.Tensor(dtype=0, shape=[1], data=b"\0" * 4), r"x\.dtype: unknown or unset"),
        (common_pb2.Tensor(dtype=42, shape=[1], data=b"\0" * 4), r"x\.dtype: unknown"),
        (common_pb2.Tensor(dtype=common_pb2.DTYPE_INT32, shape=[-1, 2]), r"x\.shape: .*>= 0"),
        (
            common_pb2.Tensor(dtype=common_pb2.DTYPE_FLOAT32, shape=[2, 3], data=b"\0" * 20),
            r"x\.data: shape \[2, 3\] of float32 needs 24 bytes, got 20",
        ),
        (
            common_pb2.Tensor(dtype=common_pb2.DTYPE_INT64, shape=[], data=b""),
            r"needs 8 bytes, got 0",
        ),
        (
            # 2**32 × 2**32 elements would wrap to 0 in 64-bit arithmetic.
            common_pb2.Tensor(dtype=common_pb2.DTYPE_BOOL, shape=[2**32, 2**32], data=b""),
            r"x\.shape: .* over the .*-byte limit",
        ),
        (
            common_pb2.Tensor(dtype=common_pb2.DTYPE_INT64, shape=[2**62, 0, 2**62], data=b"1"),
            r"needs 0 bytes, got 1",
        ),
        (
            common_pb2.Tensor(dtype=common_pb2.DTYPE_BOOL, shape=[2], data=b"\x01\x07"),
            r"x\.data: bool tensor holds bytes other than 0 and 1",
        ),
    ],
)
def test_hostile_tensor_is_rejected_with_field_name(message, pattern):
    with pytest.raises(CodecError, match=pattern):
        tensor_from_proto(message, name="x")


def _example_batch() -> Batch:
    return Batch(
        tensors={
            "input_ids": torch.arange(12, dtype=torch.int64).reshape(3, 4),
            "log_probs": torch.randn(3, 2),
            "scores": torch.tensor([1.0, 0.0, 0.5], dtype=torch.bfloat16),
        },
        non_tensors={"ground_truth": ["68", "7", None], "weight": [1, 2.5, True]},
        meta={"weights_version": 3, "step": 12, "source": "arith", "temperature": 0.7},
    )


def test_batch_round_trip_over_the_wire():
    batch = _example_batch()
    wire = batch_to_proto(batch).SerializeToString()
    decoded = batch_from_proto(common_pb2.Batch.FromString(wire))
    assert decoded.tensors.keys() == batch.tensors.keys()
    for key, tensor in batch.tensors.items():
        assert torch.equal(decoded.tensors[key], tensor), key
    assert decoded.non_tensors == {"ground_truth": ["68", "7", None], "weight": [1.0, 2.5, True]}
    assert decoded.meta == batch.meta


def test_batch_meta_defaults_when_absent():
    decoded = batch_from_proto(batch_to_proto(Batch(tensors={"x": torch.zeros(2, 1)})))
    assert decoded.meta == {"weights_version": 0, "step": 0}


def test_empty_batch_round_trips():
    decoded = batch_from_proto(batch_to_proto(Batch()))
    assert len(decoded) == 0


def test_decoded_batch_with_mismatched_rows_names_keys():
    message = batch_to_proto(_example_batch())
    message.tensors["log_probs"].CopyFrom(tensor_to_proto(torch.zeros(5, 2)))
    with pytest.raises(CodecError, match=r"batch: .*'log_probs'.*5.*3|batch: .*3.*5"):
        batch_from_proto(message)


def test_hostile_tensor_inside_batch_names_its_key():
    message = batch_to_proto(_example_batch())
    message.tensors["input_ids"].shape[:] = [3, 5]
    with pytest.raises(CodecError, match=r"tensors\['input_ids'\]\.data"):
        batch_from_proto(message)


def test_non_scalar_values_are_rejected():
    message = batch_to_proto(_example_batch())
    message.non_tensors["ground_truth"].values[1].list_value.values.add(number_value=1)
    with pytest.raises(CodecError, match=r"non_tensors\['ground_truth'\]\[1\]: expected a scalar"):
        batch_from_proto(message)


def test_encode_rejects_imprecise_ints_and_bad_typed_meta():
    with pytest.raises(CodecError, match=r"non_tensors\['uid'\]\[0\]: integer .* precision"):
        batch_to_proto(Batch(non_tensors={"uid": [2**60]}))
    with pytest.raises(CodecError, match=r"meta\['weights_version'\]: must be an int"):
        batch_to_proto(Batch(meta={"weights_version": 1.5}))


def test_decoded_key_order_is_sorted_whatever_the_wire_order():
    # Errors name the first key a batch holds, so replicas must agree on which that is.
    for keys in (["zeta", "alpha", "mid"], ["mid", "zeta", "alpha"]):
        batch = Batch(
            tensors={key: torch.zeros(2) for key in keys},
            non_tensors={f"{key}_text": ["a", "b"] for key in keys},
        )
        decoded = batch_from_proto(
            common_pb2.Batch.FromString(batch_to_proto(batch).SerializeToString())
        )
        assert list(decoded.tensors) == sorted(keys)
        assert list(decoded.non_tensors) == sorted(f"{key}_text" for key in keys)
