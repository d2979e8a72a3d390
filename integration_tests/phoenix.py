"""A real OTLP trace backend for tests: Arize Phoenix, started once per test session.

Jaeger cannot be installed on these machines; Phoenix (PyPI `arize-phoenix`) receives
OTLP over gRPC like Jaeger's collector and answers span queries over REST. It lives in
its own venv (`tools/setup_phoenix.sh` creates .phoenix-venv) because its dependency
tree must not move the pins of .venv. A missing venv fails the fixture — never skips —
so CI cannot pass without the backend test having run.

Phoenix facts this module relies on (arize-phoenix 20.26.1):
- configured by environment: PHOENIX_HOST / PHOENIX_PORT (HTTP: UI, REST, /healthz),
  PHOENIX_GRPC_PORT (OTLP), PHOENIX_WORKING_DIR (its SQLite database);
- `GET /v1/projects/{project}/spans?limit=&cursor=` pages through stored spans
  (`next_cursor` until null); ingestion is asynchronous, so readers poll;
- it keeps no resource attributes (so no `service.name`): rlserve.core.tracing also
  stamps the service on every span as the attribute `rlserve.service`. It files a whole
  trace under one project (that of the trace's first span to arrive; "default" unless
  the resource sets `openinference.project.name`), so all of a step is in one project;
- its OTLP gRPC server binds `[::]:<port>` whatever PHOENIX_HOST says (hard-coded in
  phoenix/server/grpc_server.py), so while a test runs that port is open on every
  interface: the port is random and short-lived, and the HTTP side stays on loopback.
"""

import contextlib
import json
import os
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[1]
PHOENIX_VENV = REPO / ".phoenix-venv"
START_TIMEOUT_S = 180.0
PAGE_LIMIT = 1000


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@dataclass
class PhoenixBackend:
    """A running Phoenix: where to send spans and how to read them back."""

    http_url: str
    otlp_endpoint: str
    """OTLP gRPC endpoint for setup_tracing, e.g. "http://127.0.0.1:43171"."""
    working_dir: Path
    start_s: float
    """Seconds from launch to ready."""

    def _get(self, path: str, **query: Any) -> dict[str, Any] | None:
        url = f"{self.http_url}{path}"
        if query:
            url += "?" + urllib.parse.urlencode(query, doseq=True)
        try:
            with urllib.request.urlopen(url, timeout=30) as response:
                return json.loads(response.read())
        except urllib.error.HTTPError as error:
            if error.code == 404:
                return None  # no such project (yet): no span reached it
            raise

    def projects(self) -> list[dict[str, Any]]:
        """Phoenix's projects (name, id, description); one page is plenty for tests."""
        page = self._get("/v1/projects", limit=PAGE_LIMIT)
        return [] if page is None else page["data"]

    def spans(
        self, project: str = "default", trace_ids: Iterable[str] = ()
    ) -> list[dict[str, Any]]:
        """Every span stored in `project` (of `trace_ids` only, when given), paging
        through the REST API.

        Each is Phoenix's span JSON: name, context.trace_id / context.span_id (hex),
        parent_id, start_time / end_time (ISO 8601), attributes, status_code.
        """
        found: list[dict[str, Any]] = []
        query: dict[str, Any] = {"limit": PAGE_LIMIT, "trace_id": list(trace_ids)}
        while True:
            page = self._get(f"/v1/projects/{urllib.parse.quote(project)}/spans", **query)
            if page is None:
                return found
            found += page["data"]
            query["cursor"] = page.get("next_cursor")
            if not query["cursor"]:
                return found

    def wait_for_spans(
        self,
        count: int,
        trace_ids: Iterable[str] = (),
        project: str = "default",
        timeout_s: float = 60.0,
    ) -> list[dict[str, Any]]:
        """The spans (of `trace_ids`, when given) once at least `count` are stored —
        ingestion is asynchronous; raises AssertionError saying what arrived after
        `timeout_s`."""
        trace_ids = list(trace_ids)
        deadline = time.monotonic() + timeout_s
        while True:
            spans = self.spans(project, trace_ids)
            if len(spans) >= count or time.monotonic() > deadline:
                break
            time.sleep(0.25)
        if len(spans) < count:
            projects = {p["name"]: len(self.spans(p["name"])) for p in self.projects()}
            raise AssertionError(
                f"Phoenix holds {len(spans)} spans of traces {trace_ids or 'any'} in "
                f"project {project!r} after {timeout_s} s, expected {count}: "
                f"{sorted(s['name'] for s in spans)}; spans per project: {projects}"
            )
        return spans


def _ready(http_url: str, grpc_port: int) -> bool:
    try:
        with urllib.request.urlopen(f"{http_url}/healthz", timeout=2) as response:
            if response.status != 200:
                return False
        with socket.create_connection(("127.0.0.1", grpc_port), timeout=2):
            return True
    except OSError:
        return False


def _log_tail(path: Path, lines: int = 40) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


class PhoenixMissing(RuntimeError):
    """.phoenix-venv has no `phoenix` (tools/setup_phoenix.sh was not run)."""


@contextlib.contextmanager
def running_phoenix(working_dir: Path) -> Iterator[PhoenixBackend]:
    """Phoenix on free loopback ports, storing into `working_dir`; stopped on exit.

    Raises PhoenixMissing without the venv, RuntimeError (with the log's tail) when it
    exits or is not ready within START_TIMEOUT_S.
    """
    executable = PHOENIX_VENV / "bin" / "phoenix"
    if not executable.exists():
        raise PhoenixMissing(
            f"{executable} is missing: run tools/setup_phoenix.sh to install the OTLP "
            "backend the tracing tests use"
        )
    http_port, grpc_port = _free_port(), _free_port()
    # Phoenix must not pick up the test process's own OpenTelemetry or Phoenix settings.
    env = {
        key: value for key, value in os.environ.items() if not key.startswith(("PHOENIX_", "OTEL_"))
    }
    env.update(
        PHOENIX_HOST="127.0.0.1",
        PHOENIX_PORT=str(http_port),
        PHOENIX_GRPC_PORT=str(grpc_port),
        PHOENIX_WORKING_DIR=str(working_dir),
        PHOENIX_TELEMETRY_ENABLED="false",
    )
    log_path = working_dir / "phoenix.log"
    http_url = f"http://127.0.0.1:{http_port}"
    started = time.monotonic()
    with log_path.open("wb") as log:
        # Own session: teardown signals Phoenix and any worker it forks, nothing else.
        process = subprocess.Popen(
            [str(executable), "serve"],
            env=env,
            cwd=working_dir,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
    try:
        while not _ready(http_url, grpc_port):
            if process.poll() is not None:
                raise RuntimeError(
                    f"phoenix serve exited with {process.returncode}:\n{_log_tail(log_path)}"
                )
            if time.monotonic() - started > START_TIMEOUT_S:
                raise RuntimeError(
                    f"phoenix not ready after {START_TIMEOUT_S} s:\n{_log_tail(log_path)}"
                )
            time.sleep(0.25)
        yield PhoenixBackend(
            http_url=http_url,
            otlp_endpoint=f"http://127.0.0.1:{grpc_port}",
            working_dir=working_dir,
            start_s=time.monotonic() - started,
        )
    finally:
        _stop(process)


@pytest.fixture(scope="session")
def phoenix_backend(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PhoenixBackend]:
    """Phoenix for the whole session (a missing venv fails the test, never skips it)."""
    try:
        with running_phoenix(tmp_path_factory.mktemp("phoenix")) as backend:
            print(
                f"phoenix ready in {backend.start_s:.1f} s ({backend.http_url}, "
                f"OTLP {backend.otlp_endpoint})"
            )
            yield backend
    except (PhoenixMissing, RuntimeError) as error:
        pytest.fail(str(error), pytrace=False)


def _stop(process: subprocess.Popen) -> None:
    if process.poll() is not None:
        return
    os.killpg(process.pid, signal.SIGTERM)
    try:
        process.wait(timeout=20)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait(timeout=10)
