"""A traced multi-turn run, read back from a real OTLP backend (Phoenix): its turns and
tool calls are spans under their PPO step, and `rlserve trace report` names the slowest
tool and the share of the step spent waiting on tools.

The run is one GRPO step of the tool-using tiny model (agent_support.py): every
response generates a turn, calls the calculator through the environment service, and
generates its answer.
"""

import asyncio
import contextlib
import io
import time
from collections import Counter

import pytest
from ray import serve

from integration_tests.agent_support import agent_run_config
from integration_tests.support import fresh_services
from rlserve.trainer import cli, trace_report
from rlserve.trainer.run import train_on_services

SAMPLES = 2 * 2
COMPLETE_TIMEOUT_S = 90.0
SERVICES = {"rlserve-trainer", "rlserve-rollout", "rlserve-reward", "rlserve-environment"}


@pytest.fixture(scope="module")
def traced(serve_cluster, agent_inputs, phoenix_backend, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("traced_agent_run")
    spans_file = run_dir / "spans.jsonl"
    config = agent_run_config(
        run_dir,
        {"tool": "calculator"},
        total_steps=1,
        prompts_per_step=2,
        tracing={
            "enabled": True,
            "otlp_endpoint": phoenix_backend.otlp_endpoint,
            "sampling_ratio": 1.0,
            "file_path": str(spans_file),
        },
    )
    fresh_services(config, agent_inputs)
    try:
        asyncio.run(
            train_on_services(
                config, agent_inputs, run_dir, serve_cluster.grpc_address, show_progress=False
            )
        )
        step = _complete_step(spans_file)
    finally:
        # later tests deploy their own services; these would keep exporting to Phoenix
        for role in ("rollout", "reward", "environment"):
            serve.delete(role)
    return spans_file, step


def _complete_step(spans_file):
    """The step's trace once every service's spans arrived, with no orphan (services
    export on their own schedule)."""
    deadline = time.monotonic() + COMPLETE_TIMEOUT_S
    while time.monotonic() < deadline:
        if spans_file.exists():
            steps = trace_report.find_steps(trace_report.read_spans(spans_file))
            tools = (
                [s for s in steps[0].spans if s.name == "environment.tool/calc"] if steps else []
            )
            if (
                steps
                and not steps[0].orphans
                and {s.service for s in steps[0].spans} == SERVICES
                and len(tools) == SAMPLES
            ):
                return steps[0]
        time.sleep(1.0)
    raise AssertionError(f"the traced step was not complete after {COMPLETE_TIMEOUT_S} s")


def test_turns_and_tool_calls_are_spans_under_their_step_in_the_backend(traced, phoenix_backend):
    _, step = traced
    spans = phoenix_backend.wait_for_spans(
        len(step.spans), [step.trace_id], timeout_s=COMPLETE_TIMEOUT_S
    )
    by_id = {s["context"]["span_id"]: s for s in spans}

    def ancestors(span):
        names = []
        while span["parent_id"]:
            span = by_id[span["parent_id"]]
            names.append(span["name"])
        return names

    names = Counter(s["name"] for s in spans)
    # each response: a turn, its call, the answer's turn; a generation round runs the
    # turns of every sample ready at once
    rounds = [s["attributes"] for s in spans if s["name"] == "agent.generate"]
    assert len(rounds) >= 2 and sum(r["rlserve.samples"] for r in rounds) == 2 * SAMPLES
    assert names["agent.tool/calc"] == SAMPLES
    assert names["environment.tool/calc"] == SAMPLES
    assert names["rpc.server/EnvironmentService/CallTool"] == SAMPLES
    for span in spans:
        if span["name"] in ("agent.generate", "agent.tool/calc", "environment.tool/calc"):
            chain = ancestors(span)
            assert chain[-1] == "ppo.step", (span["name"], chain)
            assert "rpc.server/RolloutService/GenerateSequences" in chain
        if span["name"] == "environment.tool/calc":
            assert span["attributes"]["rlserve.service"] == "rlserve-environment"
            chain = ancestors(span)
            assert chain[0] == "rpc.server/EnvironmentService/CallTool", chain
            assert "agent.tool/calc" in chain  # the rollout's call it answers


def test_trace_report_names_the_slowest_tool_and_the_wait_on_tools(traced):
    spans_file, step = traced
    report = trace_report.analyse_step(step)
    assert list(report.tools) == ["calc"]
    assert report.tools["calc"].calls == SAMPLES
    assert 0 < report.tool_wait_ns < report.duration_ns
    output = io.StringIO()
    with contextlib.redirect_stdout(output):
        assert cli.main(["trace", "report", str(spans_file), "--step", "1"]) == 0
    text = output.getvalue()
    assert "tools: slowest calc; some call pending" in text, text
    assert "of the step)" in text
