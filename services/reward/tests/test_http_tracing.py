"""Spans of the HTTP kind: one `reward.http_call` per sample with its last HTTP status and
retry count, under the batch's `reward.http` span; a sample that failed is an error."""

import asyncio

import pytest
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import StatusCode

from rlserve.core import tracing
from rlserve.core.serving import Deadline
from rlserve.reward.engine import HttpScorer, RewardInputs
from rlserve.reward.http_client import HttpScoreClient


@pytest.fixture
def spans(tmp_path):
    provider = tracing.setup_tracing("rlserve-reward", None, 1.0, True, tmp_path / "s.jsonl")
    memory = InMemorySpanExporter()
    provider.add_span_processor(SimpleSpanProcessor(memory))
    yield memory
    tracing.shutdown_tracing()


def _score(url: str, rows: int, on_failure: str = "raise"):
    client = HttpScoreClient(url, retries=2, backoff_initial_s=0.01, backoff_max_s=0.02)
    scorer = HttpScorer(client, on_failure, fallback_score=0.0)
    inputs = RewardInputs(
        size=rows,
        columns={"response_text": [f"r{i}" for i in range(rows)], "ground_truth": ["r0"] * rows},
    )

    async def go():
        try:
            with tracing.span("rpc.server/RewardService/ComputeReward"):
                return await scorer.score(inputs, Deadline())
        finally:
            await scorer.close()

    return asyncio.run(go())


def test_each_sample_is_a_span_with_status_and_retries(score_server, spans):
    server = score_server(fail_first=1)  # every sample: 500 once, then 200
    _, metrics = _score(server.url, 3)
    finished = spans.get_finished_spans()
    batch = next(s for s in finished if s.name == "reward.http")
    calls = sorted(
        (s for s in finished if s.name == "reward.http_call"),
        key=lambda s: s.attributes["rlserve.row"],
    )
    assert [c.attributes["rlserve.row"] for c in calls] == [0, 1, 2]
    for call in calls:
        assert call.parent.span_id == batch.context.span_id
        assert call.attributes["rlserve.status"] == 200  # the last attempt's
        assert call.attributes["rlserve.attempts"] == 2
        assert call.attributes["rlserve.retries"] == 1
        assert call.status.status_code is StatusCode.UNSET
    assert batch.attributes["rlserve.retries"] == metrics["http_retries"] == 3
    assert batch.attributes["rlserve.batch_size"] == 3


def test_a_sample_that_fails_is_an_error_span(score_server, spans):
    server = score_server(fail_first=-1)  # always 500
    _, metrics = _score(server.url, 1, on_failure="fallback")
    (call,) = [s for s in spans.get_finished_spans() if s.name == "reward.http_call"]
    assert metrics["http_failures"] == 1
    assert call.attributes["rlserve.status"] == 500
    assert call.attributes["rlserve.attempts"] == 3 and call.attributes["rlserve.retries"] == 2
    assert call.status.status_code is StatusCode.ERROR
    assert call.status.description.startswith("unavailable: HTTP 500")
