from rlserve.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ComputeValuesRequest(_message.Message):
    __slots__ = ("batch",)
    BATCH_FIELD_NUMBER: _ClassVar[int]
    batch: _common_pb2.Batch
    def __init__(self, batch: _Optional[_Union[_common_pb2.Batch, _Mapping]] = ...) -> None: ...

class ComputeValuesResponse(_message.Message):
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

class UpdateCriticRequest(_message.Message):
    __slots__ = ("step", "batch")
    STEP_FIELD_NUMBER: _ClassVar[int]
    BATCH_FIELD_NUMBER: _ClassVar[int]
    step: int
    batch: _common_pb2.Batch
    def __init__(self, step: _Optional[int] = ..., batch: _Optional[_Union[_common_pb2.Batch, _Mapping]] = ...) -> None: ...

class UpdateCriticResponse(_message.Message):
    __slots__ = ("metrics", "weights_version", "replayed")
    class MetricsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    METRICS_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_VERSION_FIELD_NUMBER: _ClassVar[int]
    REPLAYED_FIELD_NUMBER: _ClassVar[int]
    metrics: _containers.ScalarMap[str, float]
    weights_version: int
    replayed: bool
    def __init__(self, metrics: _Optional[_Mapping[str, float]] = ..., weights_version: _Optional[int] = ..., replayed: _Optional[bool] = ...) -> None: ...

class CriticServiceGetInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class CriticServiceGetInfoResponse(_message.Message):
    __slots__ = ("info",)
    INFO_FIELD_NUMBER: _ClassVar[int]
    info: _common_pb2.ServiceInfo
    def __init__(self, info: _Optional[_Union[_common_pb2.ServiceInfo, _Mapping]] = ...) -> None: ...

class CriticServiceSaveCheckpointRequest(_message.Message):
    __slots__ = ("location",)
    LOCATION_FIELD_NUMBER: _ClassVar[int]
    location: _common_pb2.CheckpointLocation
    def __init__(self, location: _Optional[_Union[_common_pb2.CheckpointLocation, _Mapping]] = ...) -> None: ...

class CriticServiceSaveCheckpointResponse(_message.Message):
    __slots__ = ("weights_version", "last_applied_step")
    WEIGHTS_VERSION_FIELD_NUMBER: _ClassVar[int]
    LAST_APPLIED_STEP_FIELD_NUMBER: _ClassVar[int]
    weights_version: int
    last_applied_step: int
    def __init__(self, weights_version: _Optional[int] = ..., last_applied_step: _Optional[int] = ...) -> None: ...

class CriticServiceLoadCheckpointRequest(_message.Message):
    __slots__ = ("location",)
    LOCATION_FIELD_NUMBER: _ClassVar[int]
    location: _common_pb2.CheckpointLocation
    def __init__(self, location: _Optional[_Union[_common_pb2.CheckpointLocation, _Mapping]] = ...) -> None: ...

class CriticServiceLoadCheckpointResponse(_message.Message):
    __slots__ = ("weights_version", "last_applied_step")
    WEIGHTS_VERSION_FIELD_NUMBER: _ClassVar[int]
    LAST_APPLIED_STEP_FIELD_NUMBER: _ClassVar[int]
    weights_version: int
    last_applied_step: int
    def __init__(self, weights_version: _Optional[int] = ..., last_applied_step: _Optional[int] = ...) -> None: ...

class CriticServiceResetRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class CriticServiceResetResponse(_message.Message):
    __slots__ = ("weights_version", "last_applied_step")
    WEIGHTS_VERSION_FIELD_NUMBER: _ClassVar[int]
    LAST_APPLIED_STEP_FIELD_NUMBER: _ClassVar[int]
    weights_version: int
    last_applied_step: int
    def __init__(self, weights_version: _Optional[int] = ..., last_applied_step: _Optional[int] = ...) -> None: ...

class CriticServiceLeaseRequest(_message.Message):
    __slots__ = ("run_id", "ttl_s", "release")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    TTL_S_FIELD_NUMBER: _ClassVar[int]
    RELEASE_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    ttl_s: float
    release: bool
    def __init__(self, run_id: _Optional[str] = ..., ttl_s: _Optional[float] = ..., release: _Optional[bool] = ...) -> None: ...

class CriticServiceLeaseResponse(_message.Message):
    __slots__ = ("lease",)
    LEASE_FIELD_NUMBER: _ClassVar[int]
    lease: _common_pb2.RunLease
    def __init__(self, lease: _Optional[_Union[_common_pb2.RunLease, _Mapping]] = ...) -> None: ...
