"""The HTTP kind against real local servers: normal, slow, failing, concurrency, deadline.

Each test drives `HttpScorer` (client + failure policy) on its own event loop, against
a ThreadingHTTPServer from conftest whose answer is computed from the request.
"""

import asyncio
import time

import grpc
import pytest

from rlserve.core.serving import Deadline, RpcError
from rlserve.reward.engine import HttpScorer, RewardInputs
from rlserve.reward.http_client import HttpScoreClient


def _inputs(n: int) -> RewardInputs:
    texts = [f"answer {i}" + "!" * i for i in range(n)]  # lengths differ by row
    truths = [t if i % 2 else "other" for i, t in enumerate(texts)]
    return RewardInputs(
        size=n,
        columns={"response_text": texts, "ground_truth": truths, "data_source": ["t"] * n},
    )


def _scorer(url: str, on_failure: str = "raise", fallback_score: float = -1.0, **client_kwargs):
    client_kwargs.setdefault("backoff_initial_s", 0.01)
    client_kwargs.setdefault("backoff_max_s", 0.05)
    return HttpScorer(HttpScoreClient(url, **client_kwargs), on_failure, fallback_score)


def _expected(server, inputs: RewardInputs) -> list[float]:
    columns = inputs.columns
    return [
        server.expected_score({"response_text": text, "ground_truth": truth})
        for text, truth in zip(columns["response_text"], columns["ground_truth"], strict=True)
    ]


def _run(scorer: HttpScorer, inputs: RewardInputs, deadline: Deadline | None = None):
    async def go():
        try:
            return await scorer.score(inputs, deadline or Deadline())
        finally:
            await scorer.close()

    start_s = time.perf_counter()
    scores, metrics = asyncio.run(go())
    return scores, metrics, time.perf_counter() - start_s


def _run_error(scorer: HttpScorer, inputs: RewardInputs, deadline: Deadline | None = None):
    start_s = time.perf_counter()
    with pytest.raises(RpcError) as error:
        _run(scorer, inputs, deadline)
    return error.value, time.perf_counter() - start_s


def test_normal_server_scores_every_row_from_its_request(score_server):
    server = score_server()
    inputs = _inputs(8)
    scores, metrics, _ = _run(_scorer(server.url, headers={"Authorization": "Bearer t0k"}), inputs)
    expected = [
        server.expected_score({"response_text": t, "ground_truth": g})
        for t, g in zip(
            inputs.columns["response_text"], inputs.columns["ground_truth"], strict=True
        )
    ]
    assert scores.tolist() == expected
    assert len(set(expected)) > 2  # the scores really differ by row
    assert metrics["http_requests"] == 8 and metrics["http_retries"] == 0
    assert metrics["http_failures"] == 0 and metrics["http_s"] > 0
    # Each request carried the row's columns and the configured header.
    assert sorted(r["response_text"] for r in server.requests) == sorted(
        inputs.columns["response_text"]
    )
    assert all(r["data_source"] == "t" for r in server.requests)
    assert all(h["Authorization"] == "Bearer t0k" for h in server.headers)


def test_batch_runs_concurrently_up_to_the_bound(score_server):
    server = score_server(delay_s=0.05)
    scores, metrics, elapsed_s = _run(_scorer(server.url, max_concurrency=32), _inputs(64))
    print(
        f"\n64 samples x 50 ms API, max_concurrency 32: {elapsed_s:.3f} s "
        f"(sequential would be {64 * 0.05:.1f} s)"
    )
    assert metrics["http_failures"] == 0 and len(scores) == 64
    assert elapsed_s < 1.0
    assert 2 <= server.max_in_flight <= 32


def test_concurrency_bound_is_respected(score_server):
    server = score_server(delay_s=0.05)
    _, metrics, elapsed_s = _run(_scorer(server.url, max_concurrency=4), _inputs(16))
    assert metrics["http_failures"] == 0
    assert server.max_in_flight == 4
    assert elapsed_s >= 4 * 0.05  # 16 requests, 4 at a time, 50 ms each


def test_retries_recover_from_transient_500s(score_server):
    server = score_server(fail_first=2)
    inputs = _inputs(6)
    scores, metrics, _ = _run(_scorer(server.url, retries=3), inputs)
    assert scores.tolist() == [
        server.expected_score({"response_text": t, "ground_truth": g})
        for t, g in zip(
            inputs.columns["response_text"], inputs.columns["ground_truth"], strict=True
        )
    ]
    assert metrics["http_retries"] == 2 * 6
    assert metrics["http_requests"] == 3 * 6
    assert metrics["http_failures"] == 0
    assert set(server.attempts.values()) == {3}


def test_always_500_with_fallback_counts_failures(score_server):
    server = score_server(fail_first=-1)
    scores, metrics, _ = _run(
        _scorer(server.url, on_failure="fallback", fallback_score=-1.5, retries=2), _inputs(5)
    )
    assert scores.tolist() == [-1.5] * 5
    assert metrics["http_failures"] == 5
    assert metrics["http_retries"] == 2 * 5
    assert metrics["http_requests"] == 3 * 5


def test_always_500_with_raise_is_unavailable_naming_the_row(score_server):
    server = score_server(fail_first=-1)
    error, _ = _run_error(_scorer(server.url, retries=1), _inputs(5))
    assert error.code == grpc.StatusCode.UNAVAILABLE
    assert error.message.startswith("kinds.http: row ")
    assert "unavailable after 2 attempt(s)" in error.message
    assert "HTTP 500" in error.message and server.url in error.message


def test_slow_server_times_out_then_fallback(score_server):
    server = score_server(delay_s=1.0)
    scores, metrics, elapsed_s = _run(
        _scorer(server.url, on_failure="fallback", timeout_s=0.2, retries=1), _inputs(4)
    )
    assert scores.tolist() == [-1.0] * 4
    assert metrics["http_failures"] == 4
    assert metrics["http_retries"] == 4 and metrics["http_requests"] == 8
    assert elapsed_s < 0.9  # two 0.2 s attempts + backoff, not the server's 1 s


def test_slow_server_times_out_then_raise_is_deadline_exceeded(score_server):
    server = score_server(delay_s=1.0)
    error, elapsed_s = _run_error(_scorer(server.url, timeout_s=0.2, retries=0), _inputs(4))
    assert error.code == grpc.StatusCode.DEADLINE_EXCEEDED
    assert "timeout after 1 attempt(s)" in error.message
    assert "no response within 0.2 s" in error.message
    assert elapsed_s < 0.9


def test_callers_deadline_clamps_attempts_and_fallback_answers_in_time(score_server):
    server = score_server(delay_s=2.0)
    deadline = Deadline(time.time() + 0.6)
    scores, metrics, elapsed_s = _run(
        _scorer(
            server.url, on_failure="fallback", timeout_s=3.0, retries=3, deadline_reserve_s=0.1
        ),
        _inputs(3),
        deadline,
    )
    assert scores.tolist() == [-1.0] * 3
    assert metrics["http_failures"] == 3
    assert metrics["http_retries"] == 0  # no time was left for a retry
    assert 0.4 < elapsed_s < 0.9  # stopped at deadline - reserve (0.5 s), not after 3 s


def test_callers_deadline_with_raise_is_deadline_exceeded(score_server):
    server = score_server(delay_s=2.0)
    error, elapsed_s = _run_error(
        _scorer(server.url, timeout_s=3.0, retries=3), _inputs(3), Deadline(time.time() + 0.5)
    )
    assert error.code == grpc.StatusCode.DEADLINE_EXCEEDED
    assert elapsed_s < 0.9  # stopped at the deadline, not after the 3 s timeout


def test_no_retry_is_started_that_cannot_finish_before_the_deadline(score_server):
    server = score_server(fail_first=-1)
    _, metrics, elapsed_s = _run(
        _scorer(
            server.url,
            on_failure="fallback",
            retries=5,
            backoff_initial_s=1.0,
            backoff_max_s=1.0,
        ),
        _inputs(4),
        Deadline(time.time() + 0.5),
    )
    assert metrics["http_requests"] == 4 and metrics["http_retries"] == 0
    assert metrics["http_failures"] == 4
    assert elapsed_s < 1.0  # gave up at once; 5 retries would have slept ≥ 2.5 s


def test_broken_body_is_rejected_without_retries(score_server):
    server = score_server(bad_body=True)
    _, metrics, _ = _run(_scorer(server.url, on_failure="fallback", retries=3), _inputs(3))
    assert metrics["http_failures"] == 3 and metrics["http_retries"] == 0
    error, _ = _run_error(_scorer(server.url, retries=3), _inputs(3))
    assert error.code == grpc.StatusCode.FAILED_PRECONDITION
    assert 'needs a finite number "score"' in error.message


def test_connection_refused_is_retried_then_unavailable():
    from rlserve.core.cluster import free_port

    url = f"http://127.0.0.1:{free_port()}/score"  # nothing listens there
    _, metrics, _ = _run(_scorer(url, on_failure="fallback", retries=2), _inputs(2))
    assert metrics["http_failures"] == 2 and metrics["http_retries"] == 4
    error, _ = _run_error(_scorer(url, retries=0), _inputs(2))
    assert error.code == grpc.StatusCode.UNAVAILABLE
    assert "ClientConnectorError" in error.message


def test_one_session_is_reused_across_batches(score_server):
    server = score_server()
    scorer = _scorer(server.url)

    async def go():
        await scorer.score(_inputs(4), Deadline())
        session = scorer._client._session
        await scorer.score(_inputs(4), Deadline())
        same = scorer._client._session is session
        await scorer.close()
        return same

    assert asyncio.run(go())
    assert len(server.requests) == 8


def test_redirects_are_refused_by_default(score_server):
    elsewhere = score_server()
    server = score_server(redirect_location=elsewhere.url)
    scorer = _scorer(server.url, on_failure="fallback", headers={"Authorization": "k"})
    scores, metrics, _ = _run(scorer, _inputs(3))
    assert scores.tolist() == [-1.0] * 3 and metrics["http_failures"] == 3
    assert not elsewhere.requests  # neither the key nor the samples went there
    error, _ = _run_error(_scorer(server.url), _inputs(1))
    assert f"HTTP 307 redirect to {elsewhere.url} refused (redirects: refuse)" in error.message


def test_same_origin_redirects_are_followed_and_others_refused(score_server):
    here = score_server(redirect_location="/moved")
    scores, _, _ = _run(_scorer(here.url, redirects="same_origin"), _inputs(2))
    assert scores.tolist() == _expected(here, _inputs(2))
    elsewhere = score_server()
    away = score_server(redirect_location=elsewhere.url)
    error, _ = _run_error(_scorer(away.url, redirects="same_origin"), _inputs(1))
    assert "redirect to another origin" in error.message and not elsewhere.requests
    loop = score_server(redirect_location="/score")  # to itself, forever
    error, _ = _run_error(_scorer(loop.url, redirects="same_origin"), _inputs(1))
    assert "more than 5 redirects" in error.message


@pytest.mark.parametrize("send_length", [True, False])
def test_an_oversized_body_fails_the_sample_unread(score_server, send_length):
    big = score_server(body_bytes=10_000_000, send_length=send_length)
    error, _ = _run_error(_scorer(big.url, max_response_bytes=4096), _inputs(1))
    assert "over max_response_bytes 4096" in error.message
    fits = score_server(body_bytes=4000, send_length=send_length)
    scores, _, _ = _run(_scorer(fits.url, max_response_bytes=4096), _inputs(1))
    assert scores.tolist() == _expected(fits, _inputs(1))
