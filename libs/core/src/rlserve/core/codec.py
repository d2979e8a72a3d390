"""The one codec between torch tensors / Batches and their protobuf wire form.

Tensor bytes are little-endian, C order (rlserve.v1.Tensor). Encoding a CPU tensor
copies its bytes twice: `tobytes` (protobuf needs a `bytes`) and into the message (upb
keeps its own copy; `batch_to_proto` writes each tensor straight into its map entry, so
no third copy by `CopyFrom`); a GPU or non-contiguous tensor adds the copies of
`.to("cpu")` and `.contiguous()`. The finished message holds one copy; the other is
freed as it is built. Decoding a parsed message costs one copy: upb builds a fresh `bytes` on every
field access, and `torch.frombuffer` wraps it without another, so it belongs to the
decoded tensor alone and may be written through it.

Every check a hostile message could trip (unknown dtype, negative or huge dims, a byte
count that does not match the shape, bool bytes other than 0/1) raises CodecError,
which services turn into INVALID_ARGUMENT.
"""

import math
import sys
import warnings
from collections.abc import Mapping
from typing import Any

import torch
from google.protobuf import struct_pb2

from rlserve.core.batch import Batch
from rlserve.v1 import common_pb2

if sys.byteorder != "little":  # every supported platform (x86_64, aarch64) is little-endian
    raise ImportError("rlserve's tensor codec supports little-endian hosts only")

# Any larger tensor could not be carried by one gRPC message (2 GiB) anyway.
MAX_TENSOR_BYTES = 2**31

_TORCH_BY_PROTO: dict[int, torch.dtype] = {
    common_pb2.DTYPE_FLOAT32: torch.float32,
    common_pb2.DTYPE_FLOAT16: torch.float16,
    common_pb2.DTYPE_BFLOAT16: torch.bfloat16,
    common_pb2.DTYPE_INT64: torch.int64,
    common_pb2.DTYPE_INT32: torch.int32,
    common_pb2.DTYPE_BOOL: torch.bool,
}
_PROTO_BY_TORCH = {dtype: code for code, dtype in _TORCH_BY_PROTO.items()}
SUPPORTED_DTYPES = tuple(_PROTO_BY_TORCH)

# BatchMeta has typed fields for these keys; any other meta key goes to `extra`.
_TYPED_META_KEYS = ("weights_version", "step")


class CodecError(ValueError):
    """A tensor or batch cannot be encoded or decoded; the message names the field."""


def tensor_to_proto(tensor: torch.Tensor, name: str = "tensor") -> common_pb2.Tensor:
    """Encodes a tensor (any device, any strides) as rlserve.v1.Tensor."""
    message = common_pb2.Tensor()
    _fill_tensor(message, tensor, name)
    return message


def _fill_tensor(message: common_pb2.Tensor, tensor: torch.Tensor, name: str) -> None:
    """Writes `tensor` into an empty `message` in place (a map entry of a Batch, say: no
    CopyFrom of a finished message, which would copy the bytes once more)."""
    code = _proto_dtype(tensor, name)
    flat = tensor.detach().to("cpu").contiguous()
    message.dtype = code
    message.shape.extend(flat.shape)
    # Viewing as bytes covers bfloat16, which numpy cannot represent.
    message.data = flat.reshape(-1).view(torch.uint8).numpy().tobytes() if flat.numel() else b""


def _proto_dtype(tensor: torch.Tensor, name: str) -> int:
    """The wire code of `tensor`'s dtype; CodecError naming `name` when it has none."""
    code = _PROTO_BY_TORCH.get(tensor.dtype)
    if code is None:
        raise CodecError(
            f"{name}: dtype {tensor.dtype} is not supported; "
            f"use one of {[str(d) for d in SUPPORTED_DTYPES]}"
        )
    return code


def check_wire_dtype(tensor: torch.Tensor, name: str) -> None:
    """CodecError naming `name` unless the codec can carry `tensor`'s dtype."""
    _proto_dtype(tensor, name)


def tensor_from_proto(message: common_pb2.Tensor, name: str = "tensor") -> torch.Tensor:
    """Decodes rlserve.v1.Tensor; raises CodecError naming `name` on any inconsistency."""
    dtype = _TORCH_BY_PROTO.get(message.dtype)
    if dtype is None:
        raise CodecError(
            f"{name}.dtype: unknown or unset dtype code {message.dtype}; "
            f"expected one of {sorted(_TORCH_BY_PROTO)}"
        )
    shape = list(message.shape)
    if any(dim < 0 for dim in shape):
        raise CodecError(f"{name}.shape: dimensions must be >= 0, got {shape}")
    item_bytes = torch.empty((), dtype=dtype).element_size()
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
            f"{name}.data: shape {shape} of {dtype} needs {expected_bytes} bytes, got {len(data)}"
        )
    if expected_bytes == 0:
        return torch.empty(shape, dtype=dtype)
    with warnings.catch_warnings():
        # `bytes` is read-only to Python, but this object is ours alone (see module doc).
        warnings.filterwarnings("ignore", message="The given buffer is not writable")
        raw = torch.frombuffer(data, dtype=torch.uint8)
    if dtype == torch.bool and bool((raw > 1).any()):
        raise CodecError(f"{name}.data: bool tensor holds bytes other than 0 and 1")
    return raw.view(dtype).reshape(shape)


def _value_to_proto(value: Any, where: str) -> struct_pb2.Value:
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


def _value_from_proto(value: struct_pb2.Value, where: str) -> Any:
    kind = value.WhichOneof("kind")
    if kind == "null_value" or kind is None:
        return None
    if kind in ("number_value", "string_value", "bool_value"):
        return getattr(value, kind)
    raise CodecError(f"{where}: expected a scalar value, got {kind}")


def batch_to_proto(batch: Batch, into: common_pb2.Batch | None = None) -> common_pb2.Batch:
    """Encodes a Batch, into the empty message `into` when given (a request's batch
    field: no CopyFrom, which would copy the bytes once more). Non-tensor numbers
    travel as doubles (JSON semantics)."""
    message = common_pb2.Batch() if into is None else into
    for key, tensor in batch.tensors.items():
        _fill_tensor(message.tensors[key], tensor, f"tensors[{key!r}]")
    for key, column in batch.non_tensors.items():
        values = message.non_tensors[key].values
        for row, value in enumerate(column):
            values.append(_value_to_proto(value, f"non_tensors[{key!r}][{row}]"))
    for key, value in batch.meta.items():
        if key in _TYPED_META_KEYS:
            if not isinstance(value, int) or isinstance(value, bool):
                raise CodecError(f"meta[{key!r}]: must be an int, got {value!r}")
            setattr(message.meta, key, value)
        else:
            message.meta.extra[key].CopyFrom(_value_to_proto(value, f"meta[{key!r}]"))
    return message


def batch_from_proto(message: common_pb2.Batch) -> Batch:
    """Decodes a Batch; CodecError names the offending tensor, column or row."""
    # Protobuf maps have no order; sorting keeps decoded batches, and the first key an
    # error names, the same on every replica and every call.
    tensors = {
        key: tensor_from_proto(message.tensors[key], name=f"tensors[{key!r}]")
        for key in sorted(message.tensors)
    }
    non_tensors = {
        key: [
            _value_from_proto(value, f"non_tensors[{key!r}][{row}]")
            for row, value in enumerate(message.non_tensors[key].values)
        ]
        for key in sorted(message.non_tensors)
    }
    meta: dict[str, Any] = {key: getattr(message.meta, key) for key in _TYPED_META_KEYS}
    meta.update(
        (key, _value_from_proto(value, f"meta[{key!r}]"))
        for key, value in message.meta.extra.items()
    )
    try:
        return Batch(tensors=tensors, non_tensors=non_tensors, meta=meta)
    except ValueError as error:
        raise CodecError(f"batch: {error}") from error


def metrics_to_proto(metrics: Mapping[str, float | torch.Tensor]) -> dict[str, float]:
    """Turns a metrics dict (floats or 0-dim tensors) into a proto map<string, double>."""
    return {key: float(value) for key, value in metrics.items()}
