from rlserve.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class CallToolRequest(_message.Message):
    __slots__ = ("session_id", "tool_name", "arguments_json", "tools_kwargs_json")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    TOOL_NAME_FIELD_NUMBER: _ClassVar[int]
    ARGUMENTS_JSON_FIELD_NUMBER: _ClassVar[int]
    TOOLS_KWARGS_JSON_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    tool_name: str
    arguments_json: str
    tools_kwargs_json: str
    def __init__(self, session_id: _Optional[str] = ..., tool_name: _Optional[str] = ..., arguments_json: _Optional[str] = ..., tools_kwargs_json: _Optional[str] = ...) -> None: ...

class CallToolResponse(_message.Message):
    __slots__ = ("observation", "step_reward", "done", "error", "metrics")
    class MetricsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    OBSERVATION_FIELD_NUMBER: _ClassVar[int]
    STEP_REWARD_FIELD_NUMBER: _ClassVar[int]
    DONE_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    METRICS_FIELD_NUMBER: _ClassVar[int]
    observation: str
    step_reward: float
    done: bool
    error: str
    metrics: _containers.ScalarMap[str, float]
    def __init__(self, observation: _Optional[str] = ..., step_reward: _Optional[float] = ..., done: _Optional[bool] = ..., error: _Optional[str] = ..., metrics: _Optional[_Mapping[str, float]] = ...) -> None: ...

class CloseSessionRequest(_message.Message):
    __slots__ = ("session_id",)
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    def __init__(self, session_id: _Optional[str] = ...) -> None: ...

class CloseSessionResponse(_message.Message):
    __slots__ = ("closed",)
    CLOSED_FIELD_NUMBER: _ClassVar[int]
    closed: bool
    def __init__(self, closed: _Optional[bool] = ...) -> None: ...

class EnvironmentServiceGetInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class EnvironmentServiceGetInfoResponse(_message.Message):
    __slots__ = ("info", "tool_schemas_json")
    class ToolSchemasJsonEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    INFO_FIELD_NUMBER: _ClassVar[int]
    TOOL_SCHEMAS_JSON_FIELD_NUMBER: _ClassVar[int]
    info: _common_pb2.ServiceInfo
    tool_schemas_json: _containers.ScalarMap[str, str]
    def __init__(self, info: _Optional[_Union[_common_pb2.ServiceInfo, _Mapping]] = ..., tool_schemas_json: _Optional[_Mapping[str, str]] = ...) -> None: ...
