from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class RunState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    RUN_STATE_UNSPECIFIED: _ClassVar[RunState]
    RUN_STATE_STARTING: _ClassVar[RunState]
    RUN_STATE_RUNNING: _ClassVar[RunState]
    RUN_STATE_STOPPING: _ClassVar[RunState]
    RUN_STATE_FINISHED: _ClassVar[RunState]
    RUN_STATE_FAILED: _ClassVar[RunState]
RUN_STATE_UNSPECIFIED: RunState
RUN_STATE_STARTING: RunState
RUN_STATE_RUNNING: RunState
RUN_STATE_STOPPING: RunState
RUN_STATE_FINISHED: RunState
RUN_STATE_FAILED: RunState

class ServiceStatus(_message.Message):
    __slots__ = ("role", "healthy", "weights_version", "detail")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    HEALTHY_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_VERSION_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    role: str
    healthy: bool
    weights_version: int
    detail: str
    def __init__(self, role: _Optional[str] = ..., healthy: _Optional[bool] = ..., weights_version: _Optional[int] = ..., detail: _Optional[str] = ...) -> None: ...

class GetStatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetStatusResponse(_message.Message):
    __slots__ = ("state", "step", "total_steps", "last_metrics", "services", "run_dir", "error")
    class LastMetricsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    STATE_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    TOTAL_STEPS_FIELD_NUMBER: _ClassVar[int]
    LAST_METRICS_FIELD_NUMBER: _ClassVar[int]
    SERVICES_FIELD_NUMBER: _ClassVar[int]
    RUN_DIR_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    state: RunState
    step: int
    total_steps: int
    last_metrics: _containers.ScalarMap[str, float]
    services: _containers.RepeatedCompositeFieldContainer[ServiceStatus]
    run_dir: str
    error: str
    def __init__(self, state: _Optional[_Union[RunState, str]] = ..., step: _Optional[int] = ..., total_steps: _Optional[int] = ..., last_metrics: _Optional[_Mapping[str, float]] = ..., services: _Optional[_Iterable[_Union[ServiceStatus, _Mapping]]] = ..., run_dir: _Optional[str] = ..., error: _Optional[str] = ...) -> None: ...

class RequestCheckpointRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class RequestCheckpointResponse(_message.Message):
    __slots__ = ("after_step", "path")
    AFTER_STEP_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    after_step: int
    path: str
    def __init__(self, after_step: _Optional[int] = ..., path: _Optional[str] = ...) -> None: ...

class StopRequest(_message.Message):
    __slots__ = ("checkpoint",)
    CHECKPOINT_FIELD_NUMBER: _ClassVar[int]
    checkpoint: bool
    def __init__(self, checkpoint: _Optional[bool] = ...) -> None: ...

class StopResponse(_message.Message):
    __slots__ = ("after_step",)
    AFTER_STEP_FIELD_NUMBER: _ClassVar[int]
    after_step: int
    def __init__(self, after_step: _Optional[int] = ...) -> None: ...
