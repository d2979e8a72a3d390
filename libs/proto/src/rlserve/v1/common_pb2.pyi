from google.protobuf import struct_pb2 as _struct_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Dtype(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DTYPE_UNSPECIFIED: _ClassVar[Dtype]
    DTYPE_FLOAT32: _ClassVar[Dtype]
    DTYPE_FLOAT16: _ClassVar[Dtype]
    DTYPE_BFLOAT16: _ClassVar[Dtype]
    DTYPE_INT64: _ClassVar[Dtype]
    DTYPE_INT32: _ClassVar[Dtype]
    DTYPE_BOOL: _ClassVar[Dtype]
DTYPE_UNSPECIFIED: Dtype
DTYPE_FLOAT32: Dtype
DTYPE_FLOAT16: Dtype
DTYPE_BFLOAT16: Dtype
DTYPE_INT64: Dtype
DTYPE_INT32: Dtype
DTYPE_BOOL: Dtype

class Tensor(_message.Message):
    __slots__ = ("dtype", "shape", "data")
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    dtype: Dtype
    shape: _containers.RepeatedScalarFieldContainer[int]
    data: bytes
    def __init__(self, dtype: _Optional[_Union[Dtype, str]] = ..., shape: _Optional[_Iterable[int]] = ..., data: _Optional[bytes] = ...) -> None: ...

class NonTensorColumn(_message.Message):
    __slots__ = ("values",)
    VALUES_FIELD_NUMBER: _ClassVar[int]
    values: _containers.RepeatedCompositeFieldContainer[_struct_pb2.Value]
    def __init__(self, values: _Optional[_Iterable[_Union[_struct_pb2.Value, _Mapping]]] = ...) -> None: ...

class BatchMeta(_message.Message):
    __slots__ = ("weights_version", "step", "extra")
    class ExtraEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: _struct_pb2.Value
        def __init__(self, key: _Optional[str] = ..., value: _Optional[_Union[_struct_pb2.Value, _Mapping]] = ...) -> None: ...
    WEIGHTS_VERSION_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    EXTRA_FIELD_NUMBER: _ClassVar[int]
    weights_version: int
    step: int
    extra: _containers.MessageMap[str, _struct_pb2.Value]
    def __init__(self, weights_version: _Optional[int] = ..., step: _Optional[int] = ..., extra: _Optional[_Mapping[str, _struct_pb2.Value]] = ...) -> None: ...

class Batch(_message.Message):
    __slots__ = ("tensors", "non_tensors", "meta")
    class TensorsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: Tensor
        def __init__(self, key: _Optional[str] = ..., value: _Optional[_Union[Tensor, _Mapping]] = ...) -> None: ...
    class NonTensorsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: NonTensorColumn
        def __init__(self, key: _Optional[str] = ..., value: _Optional[_Union[NonTensorColumn, _Mapping]] = ...) -> None: ...
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    NON_TENSORS_FIELD_NUMBER: _ClassVar[int]
    META_FIELD_NUMBER: _ClassVar[int]
    tensors: _containers.MessageMap[str, Tensor]
    non_tensors: _containers.MessageMap[str, NonTensorColumn]
    meta: BatchMeta
    def __init__(self, tensors: _Optional[_Mapping[str, Tensor]] = ..., non_tensors: _Optional[_Mapping[str, NonTensorColumn]] = ..., meta: _Optional[_Union[BatchMeta, _Mapping]] = ...) -> None: ...

class CheckpointLocation(_message.Message):
    __slots__ = ("path",)
    PATH_FIELD_NUMBER: _ClassVar[int]
    path: str
    def __init__(self, path: _Optional[str] = ...) -> None: ...

class WorkerInfo(_message.Message):
    __slots__ = ("rank", "node_id", "hostname", "pid")
    RANK_FIELD_NUMBER: _ClassVar[int]
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    HOSTNAME_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    rank: int
    node_id: str
    hostname: str
    pid: int
    def __init__(self, rank: _Optional[int] = ..., node_id: _Optional[str] = ..., hostname: _Optional[str] = ..., pid: _Optional[int] = ...) -> None: ...

class ServiceInfo(_message.Message):
    __slots__ = ("role", "model", "engine", "weights_version", "last_applied_step", "workers", "rlserve_version", "settings_json", "auth_mode", "lease")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    ENGINE_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_VERSION_FIELD_NUMBER: _ClassVar[int]
    LAST_APPLIED_STEP_FIELD_NUMBER: _ClassVar[int]
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    RLSERVE_VERSION_FIELD_NUMBER: _ClassVar[int]
    SETTINGS_JSON_FIELD_NUMBER: _ClassVar[int]
    AUTH_MODE_FIELD_NUMBER: _ClassVar[int]
    LEASE_FIELD_NUMBER: _ClassVar[int]
    role: str
    model: str
    engine: str
    weights_version: int
    last_applied_step: int
    workers: _containers.RepeatedCompositeFieldContainer[WorkerInfo]
    rlserve_version: str
    settings_json: str
    auth_mode: str
    lease: RunLease
    def __init__(self, role: _Optional[str] = ..., model: _Optional[str] = ..., engine: _Optional[str] = ..., weights_version: _Optional[int] = ..., last_applied_step: _Optional[int] = ..., workers: _Optional[_Iterable[_Union[WorkerInfo, _Mapping]]] = ..., rlserve_version: _Optional[str] = ..., settings_json: _Optional[str] = ..., auth_mode: _Optional[str] = ..., lease: _Optional[_Union[RunLease, _Mapping]] = ...) -> None: ...

class RunLease(_message.Message):
    __slots__ = ("holder", "expires_in_s")
    HOLDER_FIELD_NUMBER: _ClassVar[int]
    EXPIRES_IN_S_FIELD_NUMBER: _ClassVar[int]
    holder: str
    expires_in_s: float
    def __init__(self, holder: _Optional[str] = ..., expires_in_s: _Optional[float] = ...) -> None: ...
