from rlserve.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class SamplingParams(_message.Message):
    __slots__ = ("temperature", "top_p", "top_k", "max_new_tokens", "responses_per_prompt", "seed", "ignore_eos")
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    MAX_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    RESPONSES_PER_PROMPT_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_p: float
    top_k: int
    max_new_tokens: int
    responses_per_prompt: int
    seed: int
    ignore_eos: bool
    def __init__(self, temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., max_new_tokens: _Optional[int] = ..., responses_per_prompt: _Optional[int] = ..., seed: _Optional[int] = ..., ignore_eos: _Optional[bool] = ...) -> None: ...

class GenerateSequencesRequest(_message.Message):
    __slots__ = ("prompts", "sampling", "expected_weights_version", "return_log_probs", "agent")
    PROMPTS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_WEIGHTS_VERSION_FIELD_NUMBER: _ClassVar[int]
    RETURN_LOG_PROBS_FIELD_NUMBER: _ClassVar[int]
    AGENT_FIELD_NUMBER: _ClassVar[int]
    prompts: _common_pb2.Batch
    sampling: SamplingParams
    expected_weights_version: int
    return_log_probs: bool
    agent: AgentParams
    def __init__(self, prompts: _Optional[_Union[_common_pb2.Batch, _Mapping]] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., expected_weights_version: _Optional[int] = ..., return_log_probs: _Optional[bool] = ..., agent: _Optional[_Union[AgentParams, _Mapping]] = ...) -> None: ...

class AgentParams(_message.Message):
    __slots__ = ("environment_app", "tool_call_format", "bracket_argument", "max_turns", "max_tool_calls", "max_tool_response_tokens", "tool_timeout_s", "observation_role")
    ENVIRONMENT_APP_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALL_FORMAT_FIELD_NUMBER: _ClassVar[int]
    BRACKET_ARGUMENT_FIELD_NUMBER: _ClassVar[int]
    MAX_TURNS_FIELD_NUMBER: _ClassVar[int]
    MAX_TOOL_CALLS_FIELD_NUMBER: _ClassVar[int]
    MAX_TOOL_RESPONSE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TOOL_TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    OBSERVATION_ROLE_FIELD_NUMBER: _ClassVar[int]
    environment_app: str
    tool_call_format: str
    bracket_argument: str
    max_turns: int
    max_tool_calls: int
    max_tool_response_tokens: int
    tool_timeout_s: float
    observation_role: str
    def __init__(self, environment_app: _Optional[str] = ..., tool_call_format: _Optional[str] = ..., bracket_argument: _Optional[str] = ..., max_turns: _Optional[int] = ..., max_tool_calls: _Optional[int] = ..., max_tool_response_tokens: _Optional[int] = ..., tool_timeout_s: _Optional[float] = ..., observation_role: _Optional[str] = ...) -> None: ...

class GenerateSequencesResponse(_message.Message):
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

class ComputeLogProbRequest(_message.Message):
    __slots__ = ("batch", "return_entropy", "expected_weights_version", "return_sum_pi_squared")
    BATCH_FIELD_NUMBER: _ClassVar[int]
    RETURN_ENTROPY_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_WEIGHTS_VERSION_FIELD_NUMBER: _ClassVar[int]
    RETURN_SUM_PI_SQUARED_FIELD_NUMBER: _ClassVar[int]
    batch: _common_pb2.Batch
    return_entropy: bool
    expected_weights_version: int
    return_sum_pi_squared: bool
    def __init__(self, batch: _Optional[_Union[_common_pb2.Batch, _Mapping]] = ..., return_entropy: _Optional[bool] = ..., expected_weights_version: _Optional[int] = ..., return_sum_pi_squared: _Optional[bool] = ...) -> None: ...

class ComputeLogProbResponse(_message.Message):
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

class UpdateActorRequest(_message.Message):
    __slots__ = ("step", "batch", "weights_version")
    STEP_FIELD_NUMBER: _ClassVar[int]
    BATCH_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_VERSION_FIELD_NUMBER: _ClassVar[int]
    step: int
    batch: _common_pb2.Batch
    weights_version: int
    def __init__(self, step: _Optional[int] = ..., batch: _Optional[_Union[_common_pb2.Batch, _Mapping]] = ..., weights_version: _Optional[int] = ...) -> None: ...

class UpdateActorResponse(_message.Message):
    __slots__ = ("metrics", "weights_version", "replayed", "batch")
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
    BATCH_FIELD_NUMBER: _ClassVar[int]
    metrics: _containers.ScalarMap[str, float]
    weights_version: int
    replayed: bool
    batch: _common_pb2.Batch
    def __init__(self, metrics: _Optional[_Mapping[str, float]] = ..., weights_version: _Optional[int] = ..., replayed: _Optional[bool] = ..., batch: _Optional[_Union[_common_pb2.Batch, _Mapping]] = ...) -> None: ...

class RolloutServiceGetInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class RolloutServiceGetInfoResponse(_message.Message):
    __slots__ = ("info",)
    INFO_FIELD_NUMBER: _ClassVar[int]
    info: _common_pb2.ServiceInfo
    def __init__(self, info: _Optional[_Union[_common_pb2.ServiceInfo, _Mapping]] = ...) -> None: ...

class RolloutServiceSaveCheckpointRequest(_message.Message):
    __slots__ = ("location",)
    LOCATION_FIELD_NUMBER: _ClassVar[int]
    location: _common_pb2.CheckpointLocation
    def __init__(self, location: _Optional[_Union[_common_pb2.CheckpointLocation, _Mapping]] = ...) -> None: ...

class RolloutServiceSaveCheckpointResponse(_message.Message):
    __slots__ = ("weights_version", "last_applied_step")
    WEIGHTS_VERSION_FIELD_NUMBER: _ClassVar[int]
    LAST_APPLIED_STEP_FIELD_NUMBER: _ClassVar[int]
    weights_version: int
    last_applied_step: int
    def __init__(self, weights_version: _Optional[int] = ..., last_applied_step: _Optional[int] = ...) -> None: ...

class RolloutServiceLoadCheckpointRequest(_message.Message):
    __slots__ = ("location",)
    LOCATION_FIELD_NUMBER: _ClassVar[int]
    location: _common_pb2.CheckpointLocation
    def __init__(self, location: _Optional[_Union[_common_pb2.CheckpointLocation, _Mapping]] = ...) -> None: ...

class RolloutServiceLoadCheckpointResponse(_message.Message):
    __slots__ = ("weights_version", "last_applied_step")
    WEIGHTS_VERSION_FIELD_NUMBER: _ClassVar[int]
    LAST_APPLIED_STEP_FIELD_NUMBER: _ClassVar[int]
    weights_version: int
    last_applied_step: int
    def __init__(self, weights_version: _Optional[int] = ..., last_applied_step: _Optional[int] = ...) -> None: ...

class RolloutServiceResetRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class RolloutServiceResetResponse(_message.Message):
    __slots__ = ("weights_version", "last_applied_step")
    WEIGHTS_VERSION_FIELD_NUMBER: _ClassVar[int]
    LAST_APPLIED_STEP_FIELD_NUMBER: _ClassVar[int]
    weights_version: int
    last_applied_step: int
    def __init__(self, weights_version: _Optional[int] = ..., last_applied_step: _Optional[int] = ...) -> None: ...

class RolloutServiceLeaseRequest(_message.Message):
    __slots__ = ("run_id", "ttl_s", "release")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    TTL_S_FIELD_NUMBER: _ClassVar[int]
    RELEASE_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    ttl_s: float
    release: bool
    def __init__(self, run_id: _Optional[str] = ..., ttl_s: _Optional[float] = ..., release: _Optional[bool] = ...) -> None: ...

class RolloutServiceLeaseResponse(_message.Message):
    __slots__ = ("lease",)
    LEASE_FIELD_NUMBER: _ClassVar[int]
    lease: _common_pb2.RunLease
    def __init__(self, lease: _Optional[_Union[_common_pb2.RunLease, _Mapping]] = ...) -> None: ...
