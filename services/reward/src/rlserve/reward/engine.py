"""The reward engine: checks a request batch, scores it with every kind, combines them.

Testable without Ray or gRPC: build one with `build_engine(config)` (or from scorers),
`parse` a Batch into `RewardInputs` (raising INVALID_ARGUMENT / RESOURCE_EXHAUSTED
naming the field), then `await score(inputs, deadline)`.

Design choices:
- Each kind is a small scorer (`RuleScorer`, `ModelScorer`, `HttpScorer`) returning
  float32 scores [N] and its own metrics; the engine runs them **concurrently** (rules
  and the model forward in threads, HTTP on the event loop), so a slow API overlaps the
  model's forward pass. If one kind fails, the others are cancelled (threads finish
  their current unit and stop at the next deadline check).
- The combined score is Σ weight_k · scores_k, summed in float64, returned float32.
- A kind asks only for the inputs it needs: rules need response_text and ground_truth,
  HTTP needs response_text (and sends every non-tensor column of the row), the model
  needs input_ids / attention_mask in its vocabulary.
- Rules are bounded twice: `parse` refuses a response_text or ground_truth longer than
  `kinds.rule.max_text_chars` (INVALID_ARGUMENT naming the row), and the rule thread
  stops between rows once `kinds.rule.time_budget_s` is spent (RESOURCE_EXHAUSTED).
- HTTP failure policy lives here: 'raise' maps a row's failure to a gRPC status
  (timeout or deadline -> DEADLINE_EXCEEDED, connection error / 5xx -> UNAVAILABLE,
  other status or malformed body -> FAILED_PRECONDITION) whose message names the row;
  'fallback' scores the row fallback_score and counts it in http_failures.
"""

import asyncio
import math
import time
from dataclasses import dataclass
from typing import Any, Protocol

import grpc
import numpy as np

from rlserve.core import tracing
from rlserve.core.reward_settings import resolve_header_values
from rlserve.core.serving import Deadline, RpcError, invalid_argument, resource_exhausted
from rlserve.core.validation import Rows, require_non_tensor, require_rows
from rlserve.reward.config import RewardServiceConfig
from rlserve.reward.http_client import HttpFailure, HttpScoreClient
from rlserve.reward.rules import RuleFn, accepts_extra, resolve_rule

RESPONSE_TEXT = "response_text"
GROUND_TRUTH = "ground_truth"
_FAILURE_CODES = {
    "timeout": grpc.StatusCode.DEADLINE_EXCEEDED,
    "deadline": grpc.StatusCode.DEADLINE_EXCEEDED,
    "unavailable": grpc.StatusCode.UNAVAILABLE,
    "rejected": grpc.StatusCode.FAILED_PRECONDITION,
}


class RewardError(Exception):
    """A reward kind failed on a row for a reason of its own (e.g. a rule raised)."""


@dataclass(frozen=True)
class RewardInputs:
    """A checked request: what the configured kinds need, N rows each."""

    size: int
    """N, the number of samples."""
    columns: dict[str, list[Any]]
    """Every non-tensor column of the request (JSON scalars), N values each."""
    input_ids: Any = None
    """[N, S] int64 torch token ids, when a model kind is configured."""
    attention_mask: Any = None
    """[N, S] int64, 1 = real token, when a model kind is configured."""


@dataclass(frozen=True)
class RewardResult:
    scores: np.ndarray
    """[N] float32, Σ weight_k · scores_k."""
    kind_scores: dict[str, np.ndarray]
    """Kind name -> [N] float32 unweighted scores."""
    metrics: dict[str, float]
    """Per-kind figures (rule_s, model_s, http_s, http_requests, http_retries,
    http_failures) and samples."""


class KindScorer(Protocol):
    """One reward kind."""

    needs_text: bool
    """Needs the response_text column."""
    needs_ground_truth: bool
    """Needs the ground_truth column."""
    vocab_size: int | None
    """Needs input_ids / attention_mask with ids below this; None = no tensors."""
    max_text_chars: int | None
    """Longest response_text / ground_truth it reads; None = no limit of its own."""

    async def score(
        self, inputs: RewardInputs, deadline: Deadline
    ) -> tuple[np.ndarray, dict[str, float]]:
        """[N] float32 scores and this kind's metrics."""
        ...

    async def close(self) -> None: ...


class RuleScorer:
    """A rule function applied row by row (in a worker thread)."""

    needs_text = True
    needs_ground_truth = True
    vocab_size = None

    def __init__(
        self,
        rule: RuleFn,
        rule_name: str,
        max_text_chars: int | None = None,
        time_budget_s: float = math.inf,
    ) -> None:
        self._rule = rule
        self._rule_name = rule_name
        self._pass_extra = accepts_extra(rule)
        self.max_text_chars = max_text_chars
        self._time_budget_s = time_budget_s

    async def score(
        self, inputs: RewardInputs, deadline: Deadline
    ) -> tuple[np.ndarray, dict[str, float]]:
        start_s = time.perf_counter()
        with tracing.span("reward.rule", batch_size=inputs.size, rule=self._rule_name):
            scores = await asyncio.to_thread(self._score_rows, inputs, deadline)
        return scores, {"rule_s": time.perf_counter() - start_s}

    def _score_rows(self, inputs: RewardInputs, deadline: Deadline) -> np.ndarray:
        texts, truths = inputs.columns[RESPONSE_TEXT], inputs.columns[GROUND_TRUTH]
        extra_keys = [key for key in inputs.columns if key not in (RESPONSE_TEXT, GROUND_TRUTH)]
        scores = np.empty(inputs.size, dtype=np.float32)
        budget_end_s = time.monotonic() + self._time_budget_s
        for row in range(inputs.size):
            deadline.check("rule scoring")
            if time.monotonic() > budget_end_s:
                raise resource_exhausted(
                    "kinds.rule.time_budget_s",
                    f"rule {self._rule_name!r} used its {self._time_budget_s:g} s budget "
                    f"after {row} of {inputs.size} rows; send fewer rows per call or raise it",
                )
            extra = {key: inputs.columns[key][row] for key in extra_keys}
            try:
                value = (
                    self._rule(texts[row], truths[row], **extra)
                    if self._pass_extra
                    else self._rule(texts[row], truths[row])
                )
                value = float(value)
            except Exception as error:
                raise RewardError(
                    f"rule {self._rule_name!r} failed on row {row}: {type(error).__name__}: {error}"
                ) from error
            if not math.isfinite(value):
                raise RewardError(f"rule {self._rule_name!r} returned {value} for row {row}")
            scores[row] = value
        return scores

    async def close(self) -> None:
        pass


class ModelScorer:
    """A reward model's forward passes (in a worker thread)."""

    needs_text = False
    needs_ground_truth = False
    max_text_chars = None

    def __init__(self, model: Any) -> None:  # a rlserve.reward.reward_model.RewardModel
        self._model = model
        self.vocab_size = model.vocab_size

    async def score(
        self, inputs: RewardInputs, deadline: Deadline
    ) -> tuple[np.ndarray, dict[str, float]]:
        start_s = time.perf_counter()
        with tracing.span("reward.model", batch_size=inputs.size):
            scores = await asyncio.to_thread(
                self._model.score, inputs.input_ids, inputs.attention_mask, deadline
            )
        return scores.cpu().numpy(), {"model_s": time.perf_counter() - start_s}

    async def close(self) -> None:
        pass


class HttpScorer:
    """The external API, one request per row, with the configured failure policy."""

    needs_text = True
    needs_ground_truth = False
    vocab_size = None
    max_text_chars = None

    def __init__(self, client: HttpScoreClient, on_failure: str, fallback_score: float) -> None:
        self._client = client
        self._raise = on_failure == "raise"
        self._fallback_score = fallback_score

    async def score(
        self, inputs: RewardInputs, deadline: Deadline
    ) -> tuple[np.ndarray, dict[str, float]]:
        start_s = time.perf_counter()
        payloads = [
            {key: values[row] for key, values in inputs.columns.items()}
            for row in range(inputs.size)
        ]
        # One reward.http_call span per row (status, retries) under this one.
        with tracing.span("reward.http", batch_size=inputs.size) as span:
            result = await self._client.score_rows(payloads, deadline.unix_s, fail_fast=self._raise)
            if span.is_recording():
                span.set_attribute("rlserve.retries", result.retries)
                span.set_attribute("rlserve.failures", len(result.failures))
        if self._raise and result.failures:
            raise self._rpc_error(result.failures[0])
        scores = np.array(
            [self._fallback_score if s is None else s for s in result.scores], dtype=np.float32
        )
        return scores, {
            "http_s": time.perf_counter() - start_s,
            "http_requests": float(result.requests),
            "http_retries": float(result.retries),
            "http_failures": float(len(result.failures)),
        }

    def _rpc_error(self, failure: HttpFailure) -> RpcError:
        return RpcError(
            _FAILURE_CODES[failure.reason], f"kinds.http: {failure.describe(self._client.url)}"
        )

    async def close(self) -> None:
        await self._client.close()


class RewardEngine:
    """Combines the configured kinds' scores with their weights."""

    def __init__(self, kinds: dict[str, tuple[KindScorer, float]], max_batch_samples: int) -> None:
        if not kinds:
            raise ValueError("a reward engine needs at least one kind")
        self._kinds = dict(kinds)
        self.max_batch_samples = max_batch_samples

    @property
    def kind_weights(self) -> dict[str, float]:
        return {name: weight for name, (_, weight) in self._kinds.items()}

    @property
    def reads_tensors(self) -> bool:
        """Whether a kind reads the request's tensors (a model's token ids)."""
        return any(scorer.vocab_size is not None for scorer, _ in self._kinds.values())

    def parse(self, batch: Rows, field: str = "batch") -> RewardInputs:
        """Checks `batch` against what the kinds need; errors name the field."""
        require_rows(batch, self.max_batch_samples, field)
        scorers = [scorer for scorer, _ in self._kinds.values()]
        limits = [s.max_text_chars for s in scorers if s.max_text_chars is not None]
        max_chars = min(limits) if limits else None
        if any(s.needs_text for s in scorers):
            _require_strings(batch, RESPONSE_TEXT, field, max_chars)
        if any(s.needs_ground_truth for s in scorers):
            _require_strings(batch, GROUND_TRUTH, field, max_chars)
        input_ids = attention_mask = None
        vocab_sizes = [s.vocab_size for s in scorers if s.vocab_size is not None]
        if vocab_sizes:
            # Only a model kind reads tensors, and it brings torch (rlserve-reward[model]).
            from rlserve.core.tensor_checks import require_mask, require_token_ids

            input_ids = require_token_ids(batch, "input_ids", min(vocab_sizes), field)
            attention_mask = require_mask(batch, "attention_mask", input_ids, "input_ids", field)
            empty = (attention_mask.sum(dim=-1) == 0).nonzero()
            if len(empty):
                raise invalid_argument(
                    f"{field}.tensors['attention_mask']",
                    f"row {int(empty[0])} has no real token (all zeros); every row needs one",
                )
        return RewardInputs(
            size=len(batch),
            columns={key: list(values) for key, values in batch.non_tensors.items()},
            input_ids=input_ids,
            attention_mask=attention_mask,
        )

    async def score(self, inputs: RewardInputs, deadline: Deadline | None = None) -> RewardResult:
        """Scores with every kind concurrently and combines them."""
        deadline = deadline or Deadline()
        deadline.check("reward scoring")
        tasks = {
            name: asyncio.ensure_future(scorer.score(inputs, deadline))
            for name, (scorer, _) in self._kinds.items()
        }
        try:
            await asyncio.gather(*tasks.values())
        except BaseException:
            for task in tasks.values():
                task.cancel()
            await asyncio.gather(*tasks.values(), return_exceptions=True)
            raise
        kind_scores: dict[str, np.ndarray] = {}
        metrics: dict[str, float] = {"samples": float(inputs.size)}
        combined = np.zeros(inputs.size, dtype=np.float64)
        for name, task in tasks.items():
            scores, kind_metrics = task.result()
            kind_scores[name] = scores
            metrics.update(kind_metrics)
            combined += self._kinds[name][1] * scores.astype(np.float64)
        return RewardResult(combined.astype(np.float32), kind_scores, metrics)

    async def close(self) -> None:
        for scorer, _ in self._kinds.values():
            await scorer.close()


def _require_strings(batch: Rows, key: str, field: str, max_chars: int | None) -> list[str]:
    values = require_non_tensor(batch, key, field)
    for row, value in enumerate(values):
        if not isinstance(value, str):
            raise invalid_argument(
                f"{field}.non_tensors[{key!r}][{row}]",
                f"must be a string, got {type(value).__name__} {value!r:.80}",
            )
        if max_chars is not None and len(value) > max_chars:
            raise invalid_argument(
                f"{field}.non_tensors[{key!r}][{row}]",
                f"has {len(value)} characters; the rule reads at most {max_chars} "
                "(kinds.rule.max_text_chars): shorten it or raise that limit",
            )
    return values


def build_engine(config: RewardServiceConfig) -> RewardEngine:
    """The engine a config describes (loads the reward model, if any)."""
    kinds: dict[str, tuple[KindScorer, float]] = {}
    rule, model, http = config.kinds.rule, config.kinds.model, config.kinds.http
    if rule is not None:
        scorer = RuleScorer(
            resolve_rule(rule.rule_name), rule.rule_name, rule.max_text_chars, rule.time_budget_s
        )
        kinds["rule"] = (scorer, rule.weight)
    if model is not None:
        # Imported here: transformers is heavy, and rule/HTTP-only replicas never need it.
        from rlserve.reward.reward_model import RewardModel

        reward_model = RewardModel(model.model_path, model.dtype, model.micro_batch_samples)
        kinds["model"] = (ModelScorer(reward_model), model.weight)
    if http is not None:
        client = HttpScoreClient(
            http.url,
            headers=resolve_header_values(http.headers),
            timeout_s=http.timeout_s,
            max_concurrency=http.max_concurrency,
            retries=http.retries,
            backoff_initial_s=http.backoff_initial_s,
            backoff_max_s=http.backoff_max_s,
            deadline_reserve_s=http.deadline_reserve_s,
            redirects=http.redirects,
            max_response_bytes=http.max_response_bytes,
        )
        kinds["http"] = (HttpScorer(client, http.on_failure, http.fallback_score), http.weight)
    return RewardEngine(kinds, config.max_batch_samples)
