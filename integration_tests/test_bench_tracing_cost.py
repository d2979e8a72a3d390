"""Smoke run of benchmarks/bench_tracing_cost.py: one step per mode on tiny services.

Too short to measure anything; it checks that the benchmark runs every mode on the
deployed services, and that in mode "on 1.0" spans of all five processes' services
reach the OTLP receiver (so the benchmark's "on" really traces).
"""

import time

import pytest
from ray import serve

from benchmarks.bench_tracing_cost import MODES, format_table, measure, summarise
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
    assert summaries[0].overhead_pct == 0.0
    assert all(s.mean_s > 0 for s in summaries)
    assert "on 0.01" in format_table(summaries)
    assert set(counts) == SERVICES, counts
