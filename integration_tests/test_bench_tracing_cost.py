"""Smoke run of benchmarks/bench_tracing_cost.py: one step per mode on tiny services.

Too short to measure anything; it checks that the benchmark runs every mode on the
deployed services, and that in mode "on 1.0" spans of all five processes' services
reach the OTLP receiver (so the benchmark's "on" really traces).
"""

import time

import pytest
from ray import serve

from benchmarks.bench_tracing_cost import MODES, StepTime, format_table, measure, summarise
from benchmarks.otlp_sink import OtlpSink
from integration_tests.support import TRACED_SERVICES as SERVICES
from integration_tests.support import run_inputs, tiny_run_config
from rlserve.core import tracing


@pytest.mark.slow
def test_benchmark_runs_every_mode_and_traces_when_on(serve_cluster, embedded, tmp_path):
    config = tiny_run_config(tmp_path, trainer={"total_steps": 1})
    sink = OtlpSink(tmp_path / "counts.json")
    try:
        samples = measure(
            config,
            run_inputs(embedded),
            tmp_path,
            serve_cluster.grpc_address,
            sink.endpoint,
            rounds=1,
            steps_per_round=1,
            warmup_steps=1,
        )
        time.sleep(3 * tracing.EXPORT_DELAY_MS / 1000)  # the services' last batch
    finally:
        for role in ("rollout", "critic", "reference", "reward"):
            serve.delete(role)
        counts = sink.stop()
    assert [s.mode for s in samples] == [mode for mode, _ in MODES]
    assert [s.step for s in samples] == [2, 3, 4]  # after one warm-up step
    summaries = summarise(samples)
    assert [s.mode for s in summaries] == [mode for mode, _ in MODES]
    assert all(s.mean_s > 0 for s in summaries)
    assert "on 0.01" in format_table(summaries)
    assert set(counts) == SERVICES, counts


def test_overhead_is_each_modes_mean_against_off_with_a_standard_error_over_rounds():
    # two rounds; "on 1.0" is 10% and 30% slower than "off" in them, "on 0.01" 0% and 2%
    per_round = {"off": (1.0, 2.0), "on 1.0": (1.1, 2.6), "on 0.01": (1.0, 2.04)}
    samples = [
        StepTime(round=r, mode=mode, step=step, seconds=values[r])
        for mode, values in per_round.items()
        for r in (0, 1)
        for step in (0, 1)
    ]
    off, on, sampled = summarise(samples)
    assert (off.mode, off.steps, off.mean_s, off.median_s) == ("off", 4, 1.5, 1.5)
    assert off.overhead_pct == pytest.approx(0.0) and off.overhead_se_pct == pytest.approx(0.0)
    # overhead: the modes' means over all steps (1.85 against 1.5)
    assert on.overhead_pct == pytest.approx(100 * (1.85 / 1.5 - 1))
    # its standard error: of the per-round ratios 10% and 30%
    assert on.overhead_se_pct == pytest.approx(10.0)
    assert sampled.overhead_pct == pytest.approx(100 * (1.52 / 1.5 - 1))
    assert sampled.overhead_se_pct == pytest.approx(1.0)
