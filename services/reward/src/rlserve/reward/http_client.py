"""Scores samples with an external HTTP API: pooled, bounded, retried, deadline-aware.

One `HttpScoreClient` per replica holds one aiohttp `ClientSession` (one connection
pool, keep-alive) and one `asyncio.Semaphore` of `max_concurrency`, shared by every call
the replica is serving, so the API never sees more than that many requests in flight
from one replica. A batch's samples are scored concurrently up to that bound, so 64
samples against a 50 ms API take ≈ 2 × 50 ms with a bound of 32, not 64 × 50 ms.

Per sample: one POST (JSON body = the sample's fields), response {"score": number}.
- Each attempt has its own timeout (`timeout_s`), clamped to the time left before the
  caller's deadline minus `deadline_reserve_s`; the reserve leaves time to answer.
- Timeouts, connection errors, 5xx, 408 and 429 are retried up to `retries` times with
  exponential backoff (`backoff_initial_s` doubling, capped at `backoff_max_s`, times a
  jitter in [0.5, 1] so a failed burst does not retry in lockstep; a Retry-After header
  in seconds lengthens the wait). A retry whose backoff would end past the deadline is
  not started. Other statuses and malformed bodies fail at once (retrying cannot help).
- The semaphore is held only while a request is on the wire, never during backoff.
- A sample that still fails yields an `HttpFailure` (row, reason, detail, attempts);
  the caller applies its policy (raise or fallback). With `fail_fast` the first failure
  cancels the batch's other requests, since the call fails anyway.
- Redirects are refused unless `redirects="same_origin"`, and then followed (up to
  MAX_REDIRECTS, the POST re-sent) only to the url's own scheme, host and port: a
  redirect is never a way to send the headers and the samples' ground truth elsewhere.
  A body over `max_response_bytes` fails the sample without reading the rest.
- Each sample is one span `reward.http_call` (row, attempts, retries, the last HTTP
  status, ERROR with the reason when it failed), its attempts and backoffs inside.

The session and semaphore are created lazily inside the running event loop (aiohttp
requires it) and re-created if a different loop calls (tests running several loops).
"""

import asyncio
import json
import math
import random
import time
from dataclasses import dataclass, field
from typing import Any, Literal

import aiohttp
from opentelemetry.trace import Status, StatusCode
from yarl import URL

from rlserve.core import tracing

FailureReason = Literal["timeout", "unavailable", "rejected", "deadline"]
_RETRYABLE_STATUSES = frozenset({408, 429})
_BODY_SNIPPET_CHARS = 200
_REDIRECT_STATUSES = frozenset({301, 302, 303, 307, 308})
MAX_REDIRECTS = 5


@dataclass(frozen=True)
class HttpFailure:
    """Why one sample got no score from the API."""

    row: int
    """Row of the sample in the request batch."""
    reason: FailureReason
    """'timeout' (last attempt timed out), 'unavailable' (connection error / 5xx / 429 /
    408 after all retries), 'rejected' (another status or a malformed body),
    'deadline' (no time left before the caller's deadline to try)."""
    detail: str
    """Human-readable cause of the last attempt's failure."""
    attempts: int
    """Requests sent for this sample."""

    def describe(self, url: str) -> str:
        return (
            f"row {self.row}: {self.reason} after {self.attempts} attempt(s) to {url}: "
            f"{self.detail}"
        )


@dataclass
class HttpBatchResult:
    """Outcome of one batch: a score or a failure per row, and retry accounting."""

    scores: list[float | None]
    """Score per row; None where the row failed (see failures)."""
    failures: list[HttpFailure] = field(default_factory=list)
    """Failed rows, in row order."""
    requests: int = 0
    """Requests sent (first attempts + retries)."""
    retries: int = 0
    """Retries sent."""


class _AttemptError(Exception):
    """One failed attempt: whether it may be retried and how long the server asked to wait."""

    def __init__(
        self, reason: FailureReason, detail: str, retryable: bool, retry_after_s: float = 0.0
    ):
        super().__init__(detail)
        self.reason = reason
        self.detail = detail
        self.retryable = retryable
        self.retry_after_s = retry_after_s


class HttpScoreClient:
    """Pooled, bounded, retrying client of one scoring endpoint (one per replica)."""

    def __init__(
        self,
        url: str,
        *,
        headers: dict[str, str] | None = None,
        timeout_s: float = 3.0,
        max_concurrency: int = 32,
        retries: int = 2,
        backoff_initial_s: float = 0.1,
        backoff_max_s: float = 2.0,
        deadline_reserve_s: float = 0.1,
        redirects: Literal["refuse", "same_origin"] = "refuse",
        max_response_bytes: int = 65536,
    ) -> None:
        self.url = url
        self._redirects = redirects
        self._max_response_bytes = max_response_bytes
        self._headers = dict(headers or {})
        self._timeout_s = timeout_s
        self._max_concurrency = max_concurrency
        self._retries = retries
        self._backoff_initial_s = backoff_initial_s
        self._backoff_max_s = backoff_max_s
        self._deadline_reserve_s = deadline_reserve_s
        self._session: aiohttp.ClientSession | None = None
        self._semaphore: asyncio.Semaphore | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    def _ensure_session(self) -> tuple[aiohttp.ClientSession, asyncio.Semaphore]:
        loop = asyncio.get_running_loop()
        if self._session is None or self._loop is not loop or self._session.closed:
            # A session belongs to the loop that created it; a new loop needs its own.
            connector = aiohttp.TCPConnector(
                limit=self._max_concurrency, limit_per_host=self._max_concurrency
            )
            self._session = aiohttp.ClientSession(
                connector=connector, headers=self._headers, raise_for_status=False
            )
            self._semaphore = asyncio.Semaphore(self._max_concurrency)
            self._loop = loop
        assert self._semaphore is not None
        return self._session, self._semaphore

    async def close(self) -> None:
        """Closes the session (its pooled connections); a later call opens a new one."""
        # A session of another (finished) loop cannot be closed from this one; drop it.
        session_open = self._session is not None and not self._session.closed
        if session_open and self._loop is asyncio.get_running_loop():
            await self._session.close()
        self._session = None
        self._semaphore = None
        self._loop = None

    async def score_rows(
        self,
        payloads: list[dict[str, Any]],
        deadline_unix_s: float | None = None,
        fail_fast: bool = False,
    ) -> HttpBatchResult:
        """Scores every payload concurrently (up to max_concurrency in flight).

        Args:
            payloads: JSON body of each row's request.
            deadline_unix_s: the caller's deadline (absolute Unix time); None = none.
            fail_fast: cancel the remaining requests at the first failed row.
        """
        session, semaphore = self._ensure_session()
        stop_at = None if deadline_unix_s is None else deadline_unix_s - self._deadline_reserve_s
        result = HttpBatchResult(scores=[None] * len(payloads))
        tasks = [
            asyncio.ensure_future(self._score_one(session, semaphore, row, body, stop_at, result))
            for row, body in enumerate(payloads)
        ]
        if not tasks:
            return result
        try:
            if fail_fast:
                pending = set(tasks)
                while pending and not result.failures:
                    done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                    for task in done:
                        task.result()  # re-raises a bug instead of losing it with the batch
            else:
                await asyncio.gather(*tasks)
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        result.failures.sort(key=lambda failure: failure.row)
        return result

    async def _score_one(
        self,
        session: aiohttp.ClientSession,
        semaphore: asyncio.Semaphore,
        row: int,
        body: dict[str, Any],
        stop_at: float | None,
        result: HttpBatchResult,
    ) -> None:
        with tracing.span("reward.http_call", row=row) as span:
            attempts = await self._try_row(session, semaphore, row, body, stop_at, result)
            if span.is_recording():
                span.set_attribute("rlserve.attempts", attempts)
                span.set_attribute("rlserve.retries", max(0, attempts - 1))
                if result.scores[row] is None:
                    failure = next(f for f in reversed(result.failures) if f.row == row)
                    span.set_status(Status(StatusCode.ERROR, f"{failure.reason}: {failure.detail}"))

    async def _try_row(
        self,
        session: aiohttp.ClientSession,
        semaphore: asyncio.Semaphore,
        row: int,
        body: dict[str, Any],
        stop_at: float | None,
        result: HttpBatchResult,
    ) -> int:
        """Attempts until a score, a permanent failure or no time is left; the attempts."""
        attempts = 0
        while True:
            async with semaphore:
                left_s = math.inf if stop_at is None else stop_at - time.time()
                if left_s <= 0:
                    detail = "the caller's deadline left no time for a request"
                    result.failures.append(HttpFailure(row, "deadline", detail, attempts))
                    return attempts
                attempts += 1
                result.requests += 1
                try:
                    result.scores[row] = await self._attempt(
                        session, body, min(self._timeout_s, left_s)
                    )
                    return attempts
                except _AttemptError as error:
                    failure = error
            if not failure.retryable or attempts > self._retries:
                result.failures.append(HttpFailure(row, failure.reason, failure.detail, attempts))
                return attempts
            delay_s = self._backoff_s(attempts, failure.retry_after_s)
            if stop_at is not None and time.time() + delay_s >= stop_at:
                # The retry could not even start before the deadline: give up now.
                result.failures.append(HttpFailure(row, failure.reason, failure.detail, attempts))
                return attempts
            await asyncio.sleep(delay_s)
            result.retries += 1

    def _backoff_s(self, attempts: int, retry_after_s: float) -> float:
        base_s = min(self._backoff_max_s, self._backoff_initial_s * 2 ** (attempts - 1))
        delay_s = base_s * random.uniform(0.5, 1.0)
        return max(delay_s, min(retry_after_s, self._backoff_max_s))

    async def _attempt(
        self, session: aiohttp.ClientSession, body: dict[str, Any], timeout_s: float
    ) -> float:
        url = URL(self.url)
        try:
            async with asyncio.timeout(timeout_s):  # the attempt's time, redirects included
                for _hop in range(MAX_REDIRECTS + 1):
                    async with session.post(url, json=body, allow_redirects=False) as response:
                        status = response.status
                        retry_after = response.headers.get("Retry-After", "")
                        location = response.headers.get("Location", "")
                        raw = await self._read_bounded(response)
                    if status not in _REDIRECT_STATUSES:
                        break
                    url = self._redirect_target(url, location, status)
                else:
                    raise _AttemptError("rejected", f"more than {MAX_REDIRECTS} redirects", False)
            tracing.annotate(status=status)  # the last attempt's status stays on the span
        except TimeoutError:
            raise _AttemptError("timeout", f"no response within {timeout_s:.3g} s", True) from None
        except (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError) as error:
            detail = f"{type(error).__name__}: {error}"
            raise _AttemptError("unavailable", detail, True) from None
        except aiohttp.ClientError as error:  # a bad URL: retrying cannot help
            raise _AttemptError("rejected", f"{type(error).__name__}: {error}", False) from None
        if status >= 500 or status in _RETRYABLE_STATUSES:
            raise _AttemptError(
                "unavailable", f"HTTP {status}: {_snippet(raw)}", True, _seconds(retry_after)
            )
        if not 200 <= status < 300:
            raise _AttemptError("rejected", f"HTTP {status}: {_snippet(raw)}", False)
        return _parse_score(raw)

    async def _read_bounded(self, response: aiohttp.ClientResponse) -> bytes:
        cap = self._max_response_bytes
        if response.content_length is not None and response.content_length > cap:
            raise _AttemptError(
                "rejected",
                f"body of {response.content_length} bytes is over max_response_bytes {cap}",
                False,
            )
        raw = await response.content.read(cap + 1)
        if len(raw) > cap:
            raise _AttemptError(
                "rejected", f"body is over max_response_bytes {cap} (not read further)", False
            )
        return raw

    def _redirect_target(self, current: URL, location: str, status: int) -> URL:
        """Where a redirect may go (same_origin only), or the refusal naming it."""
        target = current.join(URL(location)) if location else None
        if target is None:
            raise _AttemptError("rejected", f"HTTP {status} without a Location", False)
        if self._redirects == "refuse":
            raise _AttemptError(
                "rejected", f"HTTP {status} redirect to {target} refused (redirects: refuse)",
                False)  # fmt: skip
        if target.origin() != URL(self.url).origin():
            raise _AttemptError(
                "rejected",
                f"HTTP {status} redirect to another origin, {target.origin()}, refused "
                "(it would carry the headers and samples there)",
                False,
            )
        return target


def _parse_score(raw: bytes) -> float:
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        raise _AttemptError("rejected", f"body is not JSON: {_snippet(raw)}", False) from None
    score = body.get("score") if isinstance(body, dict) else None
    if isinstance(score, bool) or not isinstance(score, int | float) or not math.isfinite(score):
        raise _AttemptError(
            "rejected", f'body needs a finite number "score": {_snippet(raw)}', False
        )
    return float(score)


def _seconds(header: str) -> float:
    """Retry-After in seconds (the HTTP-date form is ignored)."""
    try:
        value = float(header)
    except ValueError:
        return 0.0
    return value if math.isfinite(value) and value > 0 else 0.0


def _snippet(raw: bytes) -> str:
    text = raw.decode("utf-8", errors="replace").strip()
    return text if len(text) <= _BODY_SNIPPET_CHARS else text[:_BODY_SNIPPET_CHARS] + "..."
