"""Two real PPO steps with tracing on, read back from a real OTLP backend and reported.

The four services are deployed with the run's `trainer.tracing` (as `rlserve train` does),
exporting to Phoenix (OTLP/gRPC, like Jaeger) and to one OTLP/JSON-lines file. Then:

- Phoenix: each step is one trace rooted at `ppo.step`, holding spans of the trainer,
  rollout, reference, critic and reward (by the `rlserve.service` attribute, since
  Phoenix keeps no resource attributes); every client span's parent is the step, every
  server span's parent is the client span of the same RPC, every work span hangs under
  a server span of its own service, and no span is an orphan.
- The file: the resources name replica, node and (for workers) rank; `rlserve trace
  report` finds both steps, a critical path that tiles each step, every RPC matched to
  its server span, and writes the PNG timeline.
"""

import asyncio
import contextlib
import io
import json
import time
from collections import Counter, defaultdict
from dataclasses import dataclass
from pathlib import Path

import pytest

from integration_tests.support import TRACED_SERVICES as SERVICES
from integration_tests.support import fresh_services, run_inputs, tiny_run_config
from rlserve.trainer import cli, trace_report
from rlserve.trainer.run import RunSummary, train_on_services

RPCS = {
    "RolloutService/GenerateSequences",
    "RolloutService/ComputeLogProb",
    "RolloutService/UpdateActor",
    "ReferenceService/ComputeRefLogProb",
    "CriticService/ComputeValues",
    "CriticService/UpdateCritic",
    "RewardService/ComputeReward",
}
WORK_SPANS = {
    "trainer.advantages",
    "worker.generate",
    "rollout.generate",
    "worker.compute_log_prob",
    "rollout.forward",
    "worker.update_actor",
    "actor.mini_batch",
    "actor.forward",
    "actor.backward",
    "actor.optimizer_step",
    "actor.weight_sync",
    "worker.compute_ref_log_prob",
    "reference.forward",
    "worker.compute_values",
    "worker.update_critic",
    "critic.mini_batch",
    "critic.forward",
    "critic.backward",
    "critic.optimizer_step",
    "reward.rule",
}
STEPS = 2
# Services export every second; allow for a loaded machine.
COMPLETE_TIMEOUT_S = 90.0


@dataclass
class TracedRun:
    summary: RunSummary
    spans_file: Path
    step_traces: dict[int, str]
    """step -> trace id (hex) of its `ppo.step` trace."""
    file_spans: int
    """Spans of those traces in the file."""


def _complete_steps(spans_file: Path) -> tuple[dict[int, str], int] | None:
    """step -> trace id and the spans count, once both steps' traces hold every
    service and no orphan (the services export on their own schedule)."""
    if not spans_file.exists():
        return None
    steps = trace_report.find_steps(trace_report.read_spans(spans_file))
    if len(steps) != STEPS:
        return None
    for step in steps:
        if step.orphans or {s.service for s in step.spans} != SERVICES:
            return None
    return {s.step: s.trace_id for s in steps}, sum(len(s.spans) for s in steps)


def _wait_until_stable(probe, what: str):
    """probe() once it gives the same non-None answer twice, 2 export intervals apart."""
    deadline = time.monotonic() + COMPLETE_TIMEOUT_S
    previous = None
    while time.monotonic() < deadline:
        current = probe()
        if current is not None and current == previous:
            return current
        previous = current
        time.sleep(2.0)
    raise AssertionError(f"{what} not complete after {COMPLETE_TIMEOUT_S} s: {previous}")


@pytest.fixture(scope="module")
def traced_run(serve_cluster, embedded, phoenix_backend, tmp_path_factory) -> TracedRun:
    run_dir = tmp_path_factory.mktemp("traced_run")
    spans_file = run_dir / "spans.jsonl"
    config = tiny_run_config(
        run_dir,
        trainer={
            "total_steps": STEPS,
            "tracing": {
                "enabled": True,
                "otlp_endpoint": phoenix_backend.otlp_endpoint,
                "sampling_ratio": 1.0,
                "file_path": str(spans_file),
            },
        },
    )
    inputs = run_inputs(embedded)
    fresh_services(config, inputs)
    try:
        summary = asyncio.run(
            train_on_services(
                config, inputs, run_dir, serve_cluster.grpc_address, show_progress=False
            )
        )
        step_traces, file_spans = _wait_until_stable(
            lambda: _complete_steps(spans_file), "the step traces in the span file"
        )
    finally:
        # Later tests deploy their own services; these would keep exporting to Phoenix.
        from ray import serve

        for role in ("rollout", "critic", "reference", "reward"):
            serve.delete(role)
    return TracedRun(summary, spans_file, step_traces, file_spans)


def _phoenix_traces(phoenix_backend, run: TracedRun) -> dict[int, list[dict]]:
    stored = phoenix_backend.wait_for_spans(
        run.file_spans, list(run.step_traces.values()), timeout_s=COMPLETE_TIMEOUT_S
    )
    by_trace = defaultdict(list)
    for span in stored:
        by_trace[span["context"]["trace_id"]].append(span)
    return {step: by_trace[trace_id] for step, trace_id in run.step_traces.items()}


def test_each_step_is_one_linked_trace_in_the_backend(traced_run, phoenix_backend):
    traces = _phoenix_traces(phoenix_backend, traced_run)
    assert sum(len(spans) for spans in traces.values()) == traced_run.file_spans
    for step, spans in traces.items():
        _check_step_trace(step, spans)


def _check_step_trace(step: int, spans: list[dict]) -> None:
    """One step's spans as Phoenix stores them: one root, linked, every service."""
    by_id = {s["context"]["span_id"]: s for s in spans}
    assert len(by_id) == len(spans), "span ids are unique"

    def service(span):
        return span["attributes"]["rlserve.service"]

    def parent(span):
        return by_id.get(span["parent_id"]) if span["parent_id"] else None

    roots = [s for s in spans if not s["parent_id"]]
    assert [r["name"] for r in roots] == ["ppo.step"]
    root = roots[0]
    assert root["attributes"]["rlserve.step"] == step
    assert service(root) == "rlserve-trainer"
    orphans = [s["name"] for s in spans if s["parent_id"] and s["parent_id"] not in by_id]
    assert orphans == [], f"step {step}: spans whose parent is missing"
    assert {service(s) for s in spans} == SERVICES

    names = Counter(s["name"] for s in spans)
    for rpc in RPCS:
        # One attempt per call in a healthy run, each answered by one server span.
        assert names[f"rpc.client/{rpc}"] == 1, rpc
        assert names[f"rpc.server/{rpc}"] == 1, rpc
    assert set(names) >= WORK_SPANS, WORK_SPANS - set(names)

    for span in spans:
        name, up = span["name"], parent(span)
        if span is root:
            continue
        if name.startswith("rpc.client/"):
            assert up is root and service(span) == "rlserve-trainer", name
        elif name.startswith("rpc.server/"):
            rpc = name.removeprefix("rpc.server/")
            assert up["name"] == f"rpc.client/{rpc}", name
            assert service(span) != "rlserve-trainer"
        elif service(span) == "rlserve-trainer":
            assert up is root, name  # trainer.advantages
        else:
            # A work span: under its service's server span, directly or via work spans.
            assert service(up) == service(span), name
            while not up["name"].startswith("rpc.server/"):
                up = parent(up)
                assert service(up) == service(span), name

    def one(name):
        (found,) = [s for s in spans if s["name"] == name]
        return found["attributes"]

    assert one("rollout.generate")["rlserve.tokens"] > 0
    assert one("rollout.generate")["rlserve.batch_size"] == 16
    assert one("rpc.server/RolloutService/UpdateActor")["rlserve.step"] == step
    assert one("rpc.server/RolloutService/UpdateActor")["rlserve.weights_version"] == step
    assert one("rpc.server/RewardService/ComputeReward")["rlserve.role"] == "reward"
    assert one("worker.update_critic")["rlserve.rank"] == 0
    assert one("rpc.client/CriticService/ComputeValues")["rlserve.attempt"] == 0


def _resources(spans_file: Path) -> dict[str, list[dict]]:
    """Resource attributes of every exported batch, by service.name."""
    found = defaultdict(list)
    for line in spans_file.read_text().splitlines():
        for resource_spans in json.loads(line)["resourceSpans"]:
            attributes = {
                a["key"]: next(iter(a["value"].values()))
                for a in resource_spans["resource"]["attributes"]
            }
            found[attributes["service.name"]].append(attributes)
    return found


def test_resources_name_replica_node_and_rank(traced_run):
    resources = _resources(traced_run.spans_file)
    assert set(resources) == SERVICES
    for service, batches in resources.items():
        for attributes in batches:
            assert attributes["host.name"] and attributes["process.pid"]
            if service == "rlserve-trainer":
                continue
            assert attributes["rlserve.replica"], service
            assert attributes["rlserve.node_id"], service
    # The model services' work runs in their worker actors, which say their rank.
    for service in ("rlserve-rollout", "rlserve-reference", "rlserve-critic"):
        assert any("rlserve.rank" in a for a in resources[service]), service


def test_evaluation_and_checkpoints_are_traces_of_their_own(traced_run):
    spans = trace_report.read_spans(traced_run.spans_file)
    roots = Counter(s.name for s in spans if s.parent_id is None)
    # The services' check (and reset, had an earlier run trained them) at the start;
    # evaluation before step 1 and after the last step; a checkpoint before step 1
    # (where a recovery returns to) and one at the end; the run's leases, taken at the
    # start, renewed every ttl_s / 3 and released at the end, one trace per round.
    assert roots["trainer.reset_services"] == 1
    assert roots["ppo.step"] == STEPS
    assert roots["trainer.evaluate"] == 2
    assert roots["trainer.checkpoint"] == 2
    leases = sorted((s for s in spans if s.name == "trainer.lease"), key=lambda s: s.start_ns)
    actions = [s.attributes["rlserve.action"] for s in leases]
    assert actions[0] == "take" and actions[-1] == "release", actions
    assert set(actions[1:-1]) <= {"renew"}, actions
    assert all(s.parent_id is None for s in leases)
    assert set(roots) == {
        "trainer.lease",
        "trainer.reset_services",
        "ppo.step",
        "trainer.evaluate",
        "trainer.checkpoint",
    }


def test_report_on_the_run_finds_both_steps_and_their_critical_paths(traced_run, tmp_path):
    steps = trace_report.find_steps(trace_report.read_spans(traced_run.spans_file))
    assert [s.step for s in steps] == [1, 2]  # as metrics.jsonl counts them
    for step in steps:
        assert step.orphans == []
        report = trace_report.analyse_step(step)
        # The path tiles the step: contiguous, from its start to its end.
        assert report.path[0].start_ns == step.root.start_ns
        assert report.path[-1].end_ns == step.root.end_ns
        for before, after in zip(report.path, report.path[1:], strict=False):
            assert before.end_ns == after.start_ns
        assert sum(s.duration_ns for s in report.path) == report.duration_ns
        on_path = {segment.span.service for segment in report.path}
        assert {"rlserve-trainer", "rlserve-rollout"} <= on_path
        assert set(report.services) == SERVICES
        assert {r.client.name.removeprefix("rpc.client/") for r in report.rpcs} == RPCS
        assert all(r.matched and r.instrumented for r in report.rpcs)
        assert all(0 <= r.work_ns <= r.client.duration_ns for r in report.rpcs)

    timeline = tmp_path / "step1.png"
    output = io.StringIO()
    with contextlib.redirect_stdout(output):
        code = cli.main(
            [
                "trace",
                "report",
                str(traced_run.spans_file),
                "--step",
                "1",
                "--timeline",
                str(timeline),
            ]
        )
    assert code == 0
    text = output.getvalue()
    assert "step 1  trace " + traced_run.step_traces[1] in text
    assert "critical path by stage:" in text
    assert "rpc.server/RolloutService/UpdateActor" in text or "actor." in text
    assert "RPC overhead" in text and "unmatched" not in text
    assert timeline.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert timeline.stat().st_size > 10_000

    output = io.StringIO()
    with contextlib.redirect_stdout(output):
        assert trace_report.main([str(traced_run.spans_file)]) == 0
    assert "2 steps, mean" in output.getvalue()
