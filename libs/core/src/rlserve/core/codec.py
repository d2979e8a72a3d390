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
which services turn into INVALID_ARGUMENT. Those checks, the non-tensor columns and the
meta need no torch and live in rlserve.core.wire.
"""

import warnings

import torch

from rlserve.core.batch import Batch
from rlserve.core.wire import (
    CodecError,
    checked_tensor_bytes,
    fill_columns_and_meta,
    meta_from_proto,
    non_tensors_from_proto,
)
from rlserve.v1 import common_pb2

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
    code, shape, data = checked_tensor_bytes(message, name)
    dtype = _TORCH_BY_PROTO[code]
    if not data:
        return torch.empty(shape, dtype=dtype)
    with warnings.catch_warnings():
        # `bytes` is read-only to Python, but this object is ours alone (see module doc).
        warnings.filterwarnings("ignore", message="The given buffer is not writable")
        raw = torch.frombuffer(data, dtype=torch.uint8)
    return raw.view(dtype).reshape(shape)


def batch_to_proto(batch: Batch, into: common_pb2.Batch | None = None) -> common_pb2.Batch:
    """Encodes a Batch, into the empty message `into` when given (a request's batch
    field: no CopyFrom, which would copy the bytes once more). Non-tensor numbers
    travel as doubles (JSON semantics)."""
    message = common_pb2.Batch() if into is None else into
    for key, tensor in batch.tensors.items():
        _fill_tensor(message.tensors[key], tensor, f"tensors[{key!r}]")
    fill_columns_and_meta(message, batch.non_tensors, batch.meta)
    return message


def batch_from_proto(message: common_pb2.Batch) -> Batch:
    """Decodes a Batch; CodecError names the offending tensor, column or row."""
    # Protobuf maps have no order; sorting keeps decoded batches, and the first key an
    # error names, the same on every replica and every call.
    tensors = {
        key: tensor_from_proto(message.tensors[key], name=f"tensors[{key!r}]")
        for key in sorted(message.tensors)
    }
    try:
        return Batch(
            tensors=tensors,
            non_tensors=non_tensors_from_proto(message),
            meta=meta_from_proto(message),
        )
    except ValueError as error:
        raise CodecError(f"batch: {error}") from error
