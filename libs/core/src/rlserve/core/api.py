"""The plain API of the RPCs that carry a Batch: one request and one response dataclass
each, the same whatever route a call takes.

A service handler declared with `rlserve.core.serving.batch_rpc(Request)` takes the
request dataclass and returns the response dataclass; the trainer's
`ServiceClient.call_api(request)` sends one and gets the other back. On gRPC (Serve's
proxy, or a replica's own port) `to_proto` / `from_proto` are the wire form, the
contract in `proto/rlserve/v1/`; on the in-cluster handle route the dataclasses
themselves cross Ray, tensors and all, with no protobuf on the way. So no handler
knows, or can tell, which route a call came by.

Every request names its RPC (`RPC`), its gRPC service (`SERVICE`), its protobuf
message (`PROTO`) and its response dataclass (`Response`). Batch and the torch codec
are imported where tensors are read or written, so a rule or HTTP reward replica on a
node without torch reads its requests' columns only (`ComputeRewardRequest.from_proto`
with `reads_tensors=False`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np

from rlserve.core.wire import BatchColumns, arrays_to_proto, columns_from_proto, metrics_to_proto
from rlserve.v1 import common_pb2, critic_pb2, reference_pb2, reward_pb2, rollout_pb2

if TYPE_CHECKING:
    from rlserve.core.batch import Batch


def _decode(message: common_pb2.Batch) -> Batch:
    from rlserve.core.codec import batch_from_proto

    return batch_from_proto(message)


def _encode(batch: Batch, into: common_pb2.Batch) -> None:
    from rlserve.core.codec import batch_to_proto

    batch_to_proto(batch, into=into)


def _optional(message: Any, name: str) -> int | None:
    return getattr(message, name) if message.HasField(name) else None


# ---- answers --------------------------------------------------------------------------


@dataclass
class BatchAnswer:
    """The answer of an RPC that returns a Batch and figures (GenerateSequences,
    ComputeLogProb, ComputeRefLogProb, ComputeValues)."""

    batch: Batch
    metrics: dict[str, float] = field(default_factory=dict)

    def to_proto(self, message_type: type) -> Any:
        message = message_type(metrics=metrics_to_proto(self.metrics))
        _encode(self.batch, message.batch)
        return message

    @classmethod
    def from_proto(cls, message: Any) -> BatchAnswer:
        return cls(_decode(message.batch), dict(message.metrics))


@dataclass
class UpdateAnswer:
    """The answer of UpdateActor and UpdateCritic."""

    metrics: dict[str, float]
    weights_version: int
    """Weights version after the update."""
    replayed: bool
    """The step had been applied before: this answer replays its result."""
    scores: Batch | None = None
    """UpdateActor without old_log_probs: log_probs and entropy of its own forward."""

    def to_proto(self, message_type: type) -> Any:
        message = message_type(
            metrics=metrics_to_proto(self.metrics),
            weights_version=self.weights_version,
            replayed=self.replayed,
        )
        if self.scores is not None:
            _encode(self.scores, message.batch)
        return message

    @classmethod
    def from_proto(cls, message: Any) -> UpdateAnswer:
        has_scores = "batch" in message.DESCRIPTOR.fields_by_name and message.HasField("batch")
        return cls(
            dict(message.metrics),
            message.weights_version,
            message.replayed,
            _decode(message.batch) if has_scores else None,
        )


@dataclass
class ScoresAnswer:
    """ComputeReward's answer: "scores" [N] float32, "scores_<kind>" per kind, as numpy
    arrays (a rule or HTTP reward replica may have no torch)."""

    scores: dict[str, np.ndarray]
    metrics: dict[str, float] = field(default_factory=dict)
    meta: Mapping[str, Any] = field(default_factory=dict)

    def to_proto(self, message_type: type) -> Any:
        return message_type(
            batch=arrays_to_proto(self.scores, self.meta), metrics=metrics_to_proto(self.metrics)
        )

    @classmethod
    def from_proto(cls, message: Any) -> ScoresAnswer:
        batch = _decode(message.batch)
        scores = {key: tensor.numpy() for key, tensor in batch.tensors.items()}
        return cls(scores, dict(message.metrics), batch.meta)


# ---- requests -------------------------------------------------------------------------


@dataclass(frozen=True)
class Sampling:
    """How to sample responses: rlserve.v1.SamplingParams with its 0 = default rules
    applied, its floats at the wire's float32 precision (so both routes sample alike)."""

    temperature: float
    """0 = greedy."""
    max_new_tokens: int
    """Most generated tokens per response."""
    top_p: float = 1.0
    """Nucleus mass in (0, 1]; 1 = off."""
    top_k: int = -1
    """-1 = off."""
    responses_per_prompt: int = 1
    """Responses per prompt, adjacent in the answer."""
    seed: int | None = None
    """None = nondeterministic."""
    ignore_eos: bool = False
    """Keep generating past EOS (benchmarks)."""

    def __post_init__(self) -> None:
        for name in ("temperature", "top_p"):
            object.__setattr__(self, name, float(np.float32(getattr(self, name))))

    def to_proto(self) -> rollout_pb2.SamplingParams:
        return rollout_pb2.SamplingParams(
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            max_new_tokens=self.max_new_tokens,
            responses_per_prompt=self.responses_per_prompt,
            seed=self.seed,
            ignore_eos=self.ignore_eos,
        )

    @classmethod
    def from_proto(cls, message: rollout_pb2.SamplingParams) -> Sampling:
        return cls(
            temperature=message.temperature,
            max_new_tokens=message.max_new_tokens,
            top_p=message.top_p if message.top_p != 0 else 1.0,
            top_k=-1 if message.top_k in (0, -1) else message.top_k,
            responses_per_prompt=message.responses_per_prompt or 1,
            seed=_optional(message, "seed"),
            ignore_eos=message.ignore_eos,
        )


@dataclass(frozen=True)
class Agent:
    """How a multi-turn response calls tools (rlserve.v1.AgentParams)."""

    environment_app: str = "environment"
    """Serve application of the environment service."""
    tool_call_format: str = "hermes"
    """"hermes" or "bracket"."""
    bracket_argument: str = "expression"
    """The argument a "bracket" call's text is passed as."""
    max_turns: int = 4
    max_tool_calls: int = 8
    max_tool_response_tokens: int = 256
    tool_timeout_s: float = 30.0
    observation_role: str = "tool"

    def to_proto(self) -> rollout_pb2.AgentParams:
        return rollout_pb2.AgentParams(**asdict(self))

    @classmethod
    def from_proto(cls, message: rollout_pb2.AgentParams) -> Agent:
        return cls(
            environment_app=message.environment_app,
            tool_call_format=message.tool_call_format,
            bracket_argument=message.bracket_argument,
            max_turns=message.max_turns,
            max_tool_calls=message.max_tool_calls,
            max_tool_response_tokens=message.max_tool_response_tokens,
            tool_timeout_s=message.tool_timeout_s,
            observation_role=message.observation_role or "tool",
        )


@dataclass
class GenerateSequencesRequest:
    """Responses to `prompts` (input_ids and attention_mask [B, P], left-padded)."""

    RPC: ClassVar[str] = "GenerateSequences"
    SERVICE: ClassVar[str] = "RolloutService"
    PROTO: ClassVar[type] = rollout_pb2.GenerateSequencesRequest
    RESPONSE_PROTO: ClassVar[type] = rollout_pb2.GenerateSequencesResponse
    Response: ClassVar[type] = BatchAnswer

    prompts: Batch
    sampling: Sampling
    expected_weights_version: int | None = None
    """FAILED_PRECONDITION unless the loaded weights have this version; None = any."""
    return_log_probs: bool = False
    """Also answer the engine's log-probs of the sampled tokens (rollout_log_probs)."""
    agent: Agent | None = None
    """Multi-turn, tool-calling responses; None = one turn."""

    @property
    def batch(self) -> Batch:
        return self.prompts

    def response_bytes(self) -> int:
        """About the answer's tensor bytes: several int64 [samples, width] tensors (ids,
        masks, responses), far more than the prompts; it decides the call's route."""
        samples = len(self.prompts) * self.sampling.responses_per_prompt
        width = self.prompts["input_ids"].shape[1] + self.sampling.max_new_tokens
        return 4 * samples * width * 8

    def to_proto(self) -> Any:
        message = self.PROTO(
            sampling=self.sampling.to_proto(),
            expected_weights_version=self.expected_weights_version,
            return_log_probs=self.return_log_probs,
            agent=None if self.agent is None else self.agent.to_proto(),
        )
        _encode(self.prompts, message.prompts)
        return message

    @classmethod
    def from_proto(cls, message: Any, reads_tensors: bool = True) -> GenerateSequencesRequest:
        return cls(
            _decode(message.prompts),
            Sampling.from_proto(message.sampling),
            _optional(message, "expected_weights_version"),
            message.return_log_probs,
            Agent.from_proto(message.agent) if message.HasField("agent") else None,
        )


@dataclass
class ComputeLogProbRequest:
    """The policy's log-probs of `batch`'s responses."""

    RPC: ClassVar[str] = "ComputeLogProb"
    SERVICE: ClassVar[str] = "RolloutService"
    PROTO: ClassVar[type] = rollout_pb2.ComputeLogProbRequest
    RESPONSE_PROTO: ClassVar[type] = rollout_pb2.ComputeLogProbResponse
    Response: ClassVar[type] = BatchAnswer

    batch: Batch
    return_entropy: bool = False
    expected_weights_version: int | None = None
    return_sum_pi_squared: bool = False

    def response_bytes(self) -> int:
        return 0

    def to_proto(self) -> Any:
        message = self.PROTO(
            return_entropy=self.return_entropy,
            expected_weights_version=self.expected_weights_version,
            return_sum_pi_squared=self.return_sum_pi_squared,
        )
        _encode(self.batch, message.batch)
        return message

    @classmethod
    def from_proto(cls, message: Any, reads_tensors: bool = True) -> ComputeLogProbRequest:
        return cls(
            _decode(message.batch),
            message.return_entropy,
            _optional(message, "expected_weights_version"),
            message.return_sum_pi_squared,
        )


@dataclass
class UpdateActorRequest:
    """One PPO update of the actor for step `step` on weights `weights_version`."""

    RPC: ClassVar[str] = "UpdateActor"
    SERVICE: ClassVar[str] = "RolloutService"
    PROTO: ClassVar[type] = rollout_pb2.UpdateActorRequest
    RESPONSE_PROTO: ClassVar[type] = rollout_pb2.UpdateActorResponse
    Response: ClassVar[type] = UpdateAnswer

    step: int
    weights_version: int
    batch: Batch

    def response_bytes(self) -> int:
        return 0

    def to_proto(self) -> Any:
        message = self.PROTO(step=self.step, weights_version=self.weights_version)
        _encode(self.batch, message.batch)
        return message

    @classmethod
    def from_proto(cls, message: Any, reads_tensors: bool = True) -> UpdateActorRequest:
        return cls(message.step, message.weights_version, _decode(message.batch))


@dataclass
class _BatchOnlyRequest:
    """A request of a batch alone (ComputeRefLogProb, ComputeValues)."""

    batch: Batch

    def response_bytes(self) -> int:
        return 0

    def to_proto(self) -> Any:
        message = self.PROTO()  # type: ignore[attr-defined]
        _encode(self.batch, message.batch)
        return message

    @classmethod
    def from_proto(cls, message: Any, reads_tensors: bool = True) -> Any:
        return cls(_decode(message.batch))


@dataclass
class ComputeRefLogProbRequest(_BatchOnlyRequest):
    """The reference policy's log-probs of `batch`'s responses."""

    RPC: ClassVar[str] = "ComputeRefLogProb"
    SERVICE: ClassVar[str] = "ReferenceService"
    PROTO: ClassVar[type] = reference_pb2.ComputeRefLogProbRequest
    RESPONSE_PROTO: ClassVar[type] = reference_pb2.ComputeRefLogProbResponse
    Response: ClassVar[type] = BatchAnswer


@dataclass
class ComputeValuesRequest(_BatchOnlyRequest):
    """The critic's values of `batch`'s response tokens."""

    RPC: ClassVar[str] = "ComputeValues"
    SERVICE: ClassVar[str] = "CriticService"
    PROTO: ClassVar[type] = critic_pb2.ComputeValuesRequest
    RESPONSE_PROTO: ClassVar[type] = critic_pb2.ComputeValuesResponse
    Response: ClassVar[type] = BatchAnswer


@dataclass
class UpdateCriticRequest:
    """One value update of the critic for step `step`."""

    RPC: ClassVar[str] = "UpdateCritic"
    SERVICE: ClassVar[str] = "CriticService"
    PROTO: ClassVar[type] = critic_pb2.UpdateCriticRequest
    RESPONSE_PROTO: ClassVar[type] = critic_pb2.UpdateCriticResponse
    Response: ClassVar[type] = UpdateAnswer

    step: int
    batch: Batch

    def response_bytes(self) -> int:
        return 0

    def to_proto(self) -> Any:
        message = self.PROTO(step=self.step)
        _encode(self.batch, message.batch)
        return message

    @classmethod
    def from_proto(cls, message: Any, reads_tensors: bool = True) -> UpdateCriticRequest:
        return cls(message.step, _decode(message.batch))


@dataclass
class ComputeRewardRequest:
    """Scores of `batch`'s rows. A replica whose kinds read no tensors gets its
    columns alone by gRPC (`reads_tensors=False`: each tensor checked, none decoded)."""

    RPC: ClassVar[str] = "ComputeReward"
    SERVICE: ClassVar[str] = "RewardService"
    PROTO: ClassVar[type] = reward_pb2.ComputeRewardRequest
    RESPONSE_PROTO: ClassVar[type] = reward_pb2.ComputeRewardResponse
    Response: ClassVar[type] = ScoresAnswer

    batch: Batch | BatchColumns

    def response_bytes(self) -> int:
        return 0

    def to_proto(self) -> Any:
        message = self.PROTO()
        _encode(self.batch, message.batch)  # the caller's is a Batch
        return message

    @classmethod
    def from_proto(cls, message: Any, reads_tensors: bool = True) -> ComputeRewardRequest:
        return cls(_decode(message.batch) if reads_tensors else columns_from_proto(message.batch))


BATCH_REQUESTS: tuple[type, ...] = (
    GenerateSequencesRequest,
    ComputeLogProbRequest,
    UpdateActorRequest,
    ComputeRefLogProbRequest,
    ComputeValuesRequest,
    UpdateCriticRequest,
    ComputeRewardRequest,
)
"""Every request of the plain API (a test checks each against the proto)."""
