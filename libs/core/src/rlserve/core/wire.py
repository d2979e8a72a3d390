"""The torch-free half of the wire codec: a Batch message's rows, meta and checks.

rlserve.core.codec turns protobuf Batches into torch tensors; this module holds what
needs no torch, so a service that reads only per-row text (a rule or HTTP reward, on a
node without torch) decodes and answers the same messages:

- the JSON-scalar columns (`non_tensors`) and the meta, both ways;
- the checks every Tensor message gets before its bytes are read (dtype code, shape,
  byte count, bool bytes), which raise CodecError naming the field;
- numpy arrays into Tensor messages (a reward's float32 scores);
- `columns_from_proto`: a Batch message's columns and meta, its tensors checked and
  counted as rows but not decoded.
"""

import math
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
from google.protobuf import struct_pb2

from rlserve.v1 import common_pb2

if sys.byteorder != "little":  # every supported platform (x86_64, aarch64) is little-endian
    raise ImportError("rlserve's tensor codec supports little-endian hosts only")

# Any larger tensor could not be carried by one gRPC message (2 GiB) anyway.
MAX_TENSOR_BYTES = 2**31

DTYPE_NAMES: dict[int, str] = {
    common_pb2.DTYPE_FLOAT32: "float32",
    common_pb2.DTYPE_FLOAT16: "float16",
    common_pb2.DTYPE_BFLOAT16: "bfloat16",
    common_pb2.DTYPE_INT64: "int64",
    common_pb2.DTYPE_INT32: "int32",
    common_pb2.DTYPE_BOOL: "bool",
}
"""Wire dtype code -> its name (torch's, without the `torch.` prefix)."""
_ITEM_BYTES = {
    common_pb2.DTYPE_FLOAT32: 4,
    common_pb2.DTYPE_FLOAT16: 2,
    common_pb2.DTYPE_BFLOAT16: 2,
    common_pb2.DTYPE_INT64: 8,
    common_pb2.DTYPE_INT32: 4,
    common_pb2.DTYPE_BOOL: 1,
}
# numpy has no bfloat16; a numpy caller sends the others.
_PROTO_BY_NUMPY = {
    np.dtype(name): code for code, name in DTYPE_NAMES.items() if code != common_pb2.DTYPE_BFLOAT16
}

# Batch meta keys with typed proto fields; every other meta key goes in `extra`.
TYPED_META_KEYS = ("weights_version", "step")


class CodecError(ValueError):
    """A tensor or batch cannot be encoded or decoded; the message names the field."""


def checked_tensor_bytes(message: common_pb2.Tensor, name: str) -> tuple[int, list[int], bytes]:
    """The dtype code, shape and data of a Tensor message that passes every check a
    hostile message could trip; CodecError naming `name` otherwise."""
    item_bytes = _ITEM_BYTES.get(message.dtype)
    if item_bytes is None:
        raise CodecError(
            f"{name}.dtype: unknown or unset dtype code {message.dtype}; "
            f"expected one of {sorted(_ITEM_BYTES)}"
        )
    shape = list(message.shape)
    if any(dim < 0 for dim in shape):
        raise CodecError(f"{name}.shape: dimensions must be >= 0, got {shape}")
    # Python ints do not overflow, so a hostile shape cannot wrap around to a small size.
    expected_bytes = math.prod(shape) * item_bytes
    if expected_bytes > MAX_TENSOR_BYTES:
        raise CodecError(
            f"{name}.shape: {shape} needs {expected_bytes} bytes, over the "
            f"{MAX_TENSOR_BYTES}-byte limit of one message"
        )
    data = message.data
    if len(data) != expected_bytes:
        raise CodecError(
            f"{name}.data: shape {shape} of {DTYPE_NAMES[message.dtype]} needs "
            f"{expected_bytes} bytes, got {len(data)}"
        )
    if message.dtype == common_pb2.DTYPE_BOOL and bool(
        (np.frombuffer(data, dtype=np.uint8) > 1).any()
    ):
        raise CodecError(f"{name}.data: bool tensor holds bytes other than 0 and 1")
    return message.dtype, shape, data


def fill_array(message: common_pb2.Tensor, array: np.ndarray, name: str) -> None:
    """Writes a numpy `array` into an empty Tensor `message` in place."""
    code = _PROTO_BY_NUMPY.get(array.dtype)
    if code is None:
        raise CodecError(
            f"{name}: dtype {array.dtype} is not supported; "
            f"use one of {[str(d) for d in _PROTO_BY_NUMPY]}"
        )
    message.dtype = code
    message.shape.extend(array.shape)
    message.data = np.ascontiguousarray(array).tobytes()


def value_to_proto(value: Any, where: str) -> struct_pb2.Value:
    # bool before int: bool is a subclass of int.
    if value is None:
        return struct_pb2.Value(null_value=struct_pb2.NULL_VALUE)
    if isinstance(value, bool):
        return struct_pb2.Value(bool_value=value)
    if isinstance(value, int | float):
        if isinstance(value, int) and abs(value) > 2**53:
            raise CodecError(f"{where}: integer {value} would lose precision as a double")
        return struct_pb2.Value(number_value=float(value))
    if isinstance(value, str):
        return struct_pb2.Value(string_value=value)
    raise CodecError(
        f"{where}: {type(value).__name__} is not a JSON scalar (str, int, float, bool, None)"
    )


def value_from_proto(value: struct_pb2.Value, where: str) -> Any:
    kind = value.WhichOneof("kind")
    if kind == "null_value" or kind is None:
        return None
    if kind in ("number_value", "string_value", "bool_value"):
        return getattr(value, kind)
    raise CodecError(f"{where}: expected a scalar value, got {kind}")


def fill_columns_and_meta(
    message: common_pb2.Batch, non_tensors: Mapping[str, list[Any]], meta: Mapping[str, Any]
) -> None:
    """Writes a Batch's non-tensor columns and meta into `message`. Non-tensor numbers
    travel as doubles (JSON semantics)."""
    for key, column in non_tensors.items():
        values = message.non_tensors[key].values
        for row, value in enumerate(column):
            values.append(value_to_proto(value, f"non_tensors[{key!r}][{row}]"))
    for key, value in meta.items():
        if key in TYPED_META_KEYS:
            if not isinstance(value, int) or isinstance(value, bool):
                raise CodecError(f"meta[{key!r}]: must be an int, got {value!r}")
            setattr(message.meta, key, value)
        else:
            message.meta.extra[key].CopyFrom(value_to_proto(value, f"meta[{key!r}]"))


def non_tensors_from_proto(message: common_pb2.Batch) -> dict[str, list[Any]]:
    # Protobuf maps have no order; sorting keeps decoded batches, and the first key an
    # error names, the same on every replica and every call.
    return {
        key: [
            value_from_proto(value, f"non_tensors[{key!r}][{row}]")
            for row, value in enumerate(message.non_tensors[key].values)
        ]
        for key in sorted(message.non_tensors)
    }


def meta_from_proto(message: common_pb2.Batch) -> dict[str, Any]:
    meta: dict[str, Any] = {key: getattr(message.meta, key) for key in TYPED_META_KEYS}
    meta.update(
        (key, value_from_proto(value, f"meta[{key!r}]"))
        for key, value in message.meta.extra.items()
    )
    return meta


@dataclass(frozen=True)
class BatchColumns:
    """A Batch message's per-row columns and meta, read without torch. It answers
    `len()` and `.non_tensors` like a Batch, so the same request checks apply."""

    non_tensors: dict[str, list[Any]]
    meta: dict[str, Any]
    rows: int

    def __len__(self) -> int:
        return self.rows


def columns_from_proto(message: common_pb2.Batch) -> BatchColumns:
    """The columns and meta of `message`; each tensor passes the codec's checks and
    counts towards the rows (every field of a Batch has the same), but is not decoded.
    CodecError names the offending field."""
    sizes: dict[str, int] = {}
    for key in sorted(message.tensors):
        name = f"tensors[{key!r}]"
        _, shape, _ = checked_tensor_bytes(message.tensors[key], name)
        if not shape:
            raise CodecError(f"batch: tensor {key!r} is 0-dim; tensors need a batch dimension")
        sizes[name] = shape[0]
    non_tensors = non_tensors_from_proto(message)
    sizes.update((f"non_tensors[{key!r}]", len(column)) for key, column in non_tensors.items())
    both = set(message.tensors) & set(non_tensors)
    if both:
        raise CodecError(f"batch: key {sorted(both)[0]!r} is both a tensor and a non-tensor key")
    if len(set(sizes.values())) > 1:
        raise CodecError(f"batch: every field needs the same number of rows, got {sizes}")
    return BatchColumns(non_tensors, meta_from_proto(message), next(iter(sizes.values()), 0))


def arrays_to_proto(arrays: Mapping[str, np.ndarray], meta: Mapping[str, Any]) -> common_pb2.Batch:
    """A Batch message of numpy `arrays` (all [N, ...]) and `meta`."""
    message = common_pb2.Batch()
    for key, array in arrays.items():
        fill_array(message.tensors[key], array, f"tensors[{key!r}]")
    fill_columns_and_meta(message, {}, meta)
    return message


def metrics_to_proto(metrics: Mapping[str, Any]) -> dict[str, float]:
    """Turns a metrics dict (floats, or 0-dim tensors and arrays) into a proto
    map<string, double>."""
    return {key: float(value) for key, value in metrics.items()}
