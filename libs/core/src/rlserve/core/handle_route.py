"""The in-cluster route for batches: a Batch handed to a service's replica through Ray.

A caller on the Ray cluster (the trainer) that sends or receives a large Batch need not
pay protobuf's copies (see rlserve.core.codec: `tobytes`, into the message, serialized,
into gRPC, and as many on the way out). It calls the app's deployment through a Serve
DeploymentHandle instead: `call_with_batch(rpc, request_bytes, batch, metadata)` carries
the request's small fields as protobuf bytes (its batch field left empty) and the Batch
beside them, pickled by Ray (each tensor one uint8 array, so the object store holds one
copy and the replica reads it without another until it takes ownership). The replica
runs the very same `@rpc_method` handler as for gRPC, with a `HandleCallContext` in
place of the gRPC context: the handler reads its batch with `request_batch` and returns
its batch with `response_batch`, which on this route hand the Batch objects through and
on gRPC decode and encode protobuf. Auth, deadline and trace context travel as the same
metadata, so tokens, deadlines, statuses and spans are those of a gRPC call.

Why this is no hole in "never unpickle what a caller could have written": the handle
route exists only inside the Ray cluster, whose members can already run any code on it
(that is what a Ray driver does); nothing on a gRPC port unpickles. `call_with_batch`
is no gRPC method (the servicers register only the proto's RPCs, so the proxy and a
replica's own port answer UNIMPLEMENTED for it), and it still checks what it is given:
only RPCs declared with `@rpc_method` that carry a batch, a Batch of the codec's dtypes.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import grpc
import numpy as np

from rlserve.core.wire import BatchColumns, CodecError, arrays_to_proto, columns_from_proto
from rlserve.v1 import common_pb2

# Batch and the codec need torch, which a rule or HTTP reward replica may lack: they
# are imported where a call brings or needs tensors.
if TYPE_CHECKING:
    from rlserve.core.batch import Batch


@dataclass
class HandleCallContext:
    """What a handler sees of a call that came by the handle route: the metadata a gRPC
    call would carry, the request's Batch, and slots for the status and the answer's
    Batch (the parts of grpc.aio.ServicerContext the handlers use)."""

    metadata: tuple[tuple[str, str], ...]
    request_batch: Batch
    response_batch: Batch | None = None
    code: grpc.StatusCode = grpc.StatusCode.OK
    details: str = ""

    def invocation_metadata(self) -> tuple[tuple[str, str], ...]:
        return self.metadata

    def set_code(self, code: grpc.StatusCode) -> None:
        self.code = code

    def set_details(self, details: str) -> None:
        self.details = details


def request_batch(message: common_pb2.Batch, grpc_context: Any) -> Batch:
    """The request's batch: the Batch handed through on the handle route, else `message`
    decoded (CodecError names the bad field; `rpc_method` makes it INVALID_ARGUMENT)."""
    if isinstance(grpc_context, HandleCallContext):
        return _handed_batch(message, grpc_context)
    from rlserve.core.codec import batch_from_proto

    return batch_from_proto(message)


def request_columns(message: common_pb2.Batch, grpc_context: Any) -> Batch | BatchColumns:
    """The request's per-row columns and meta, read without torch when the call came
    by gRPC (its tensors checked, not decoded: see rlserve.core.wire); for a service
    that reads no tensors."""
    if isinstance(grpc_context, HandleCallContext):
        return _handed_batch(message, grpc_context)
    return columns_from_proto(message)


def _handed_batch(message: common_pb2.Batch, grpc_context: HandleCallContext) -> Batch:
    if message.ByteSize():
        raise CodecError("batch: sent both as protobuf and beside the request; send one")
    return grpc_context.request_batch


def response_batch(batch: Batch, grpc_context: Any) -> common_pb2.Batch:
    """What a handler puts in its response's batch field: on the handle route an empty
    message, the Batch itself going back beside the response; else `batch` encoded."""
    if isinstance(grpc_context, HandleCallContext):
        grpc_context.response_batch = batch
        return common_pb2.Batch()
    from rlserve.core.codec import batch_to_proto

    return batch_to_proto(batch)


def response_arrays(
    arrays: Mapping[str, np.ndarray], meta: Mapping[str, Any], grpc_context: Any
) -> common_pb2.Batch:
    """`response_batch` for a service that answers numpy arrays: encoded without torch
    on gRPC; on the handle route (whose request brought torch tensors) as a Batch."""
    if isinstance(grpc_context, HandleCallContext):
        import torch

        from rlserve.core.batch import Batch

        tensors = {key: torch.from_numpy(array) for key, array in arrays.items()}
        return response_batch(Batch(tensors=tensors, meta=meta), grpc_context)
    return arrays_to_proto(arrays, meta)


@dataclass(frozen=True)
class HandleCallResult:
    """What `call_with_batch` answers: the gRPC status, the serialized response (its
    batch field empty) and the response's Batch (None when the RPC returns none)."""

    code_name: str
    details: str
    response: bytes
    batch: Batch | None


def check_handed_batch(batch: Any) -> Batch:
    """`batch` when it is a Batch the codec could have carried (its dtypes, on the CPU),
    else CodecError naming the tensor: the handle route accepts no more than gRPC does."""
    from rlserve.core.batch import Batch
    from rlserve.core.codec import check_wire_dtype

    if not isinstance(batch, Batch):
        raise CodecError(f"batch: expected an rlserve Batch, got {type(batch).__name__}")
    for key, tensor in batch.tensors.items():
        check_wire_dtype(tensor, f"tensors[{key!r}]")
        if tensor.device.type != "cpu":
            raise CodecError(f"tensors[{key!r}]: must be on the CPU, is on {tensor.device}")
    return batch


class BatchCalls:
    """Mixin of every service deployment: its RPCs that carry a Batch, callable by the
    handle route (see the module docstring)."""

    async def call_with_batch(
        self, rpc: str, request: bytes, batch: Any, metadata: tuple[tuple[str, str], ...]
    ) -> HandleCallResult:
        method = getattr(type(self), rpc, None) if isinstance(rpc, str) else None
        request_type = getattr(method, "batch_request_type", None)
        if request_type is None:
            return HandleCallResult(
                "UNIMPLEMENTED",
                f"{rpc!r} is no RPC of this service that carries a batch",
                b"",
                None,
            )
        try:
            context = HandleCallContext(tuple(metadata), check_handed_batch(batch))
            message = request_type.FromString(request)
        except Exception as error:  # a request gRPC could not have parsed either
            return HandleCallResult("INVALID_ARGUMENT", f"{rpc}: {error}", b"", None)
        response = await method(self, message, context)
        return HandleCallResult(
            context.code.name, context.details, response.SerializeToString(), context.response_batch
        )
