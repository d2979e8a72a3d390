from rlserve.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ComputeRefLogProbRequest(_message.Message):
    __slots__ = ("batch",)
    BATCH_FIELD_NUMBER: _ClassVar[int]
    batch: _common_pb2.Batch
    def __init__(self, batch: _Optional[_Union[_common_pb2.Batch, _Mapping]] = ...) -> None: ...

class ComputeRefLogProbResponse(_message.Message):
    __slots__ = ("batch", "metrics")
    class MetricsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    BATCH_FIELD_NUMBER: _ClassVar[int]
    METRICS_FIELD_NUMBER: _ClassVar[int]
    batch: _common_pb2.Batch
    metrics: _containers.ScalarMap[str, float]
    def __init__(self, batch: _Optional[_Union[_common_pb2.Batch, _Mapping]] = ..., metrics: _Optional[_Mapping[str, float]] = ...) -> None: ...

class ReferenceServiceGetInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ReferenceServiceGetInfoResponse(_message.Message):
    __slots__ = ("info",)
    INFO_FIELD_NUMBER: _ClassVar[int]
    info: _common_pb2.ServiceInfo
    def __init__(self, info: _Optional[_Union[_common_pb2.ServiceInfo, _Mapping]] = ...) -> None: ...
