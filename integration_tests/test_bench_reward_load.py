"""Quick run of benchmarks/bench_reward_load.py: 16 clients for 4 s per kind (rule, HTTP).

In a subprocess, since the benchmark starts its own cluster and this pytest process is
connected to the session's Ray. Every call must succeed with the right scores (the
benchmark checks each one), and the replica's memory is measured before and after.
"""

import json

import pytest

from integration_tests.support import run_benchmark

TIMEOUT_S = 600


@pytest.mark.slow
def test_concurrent_clients_get_every_score_right_from_both_kinds(tmp_path):
    out_path = tmp_path / "load.json"
    result = run_benchmark(
        "benchmarks.bench_reward_load",
        *("--clients", "16", "--seconds", "4", "--json-out", str(out_path)),
        timeout_s=TIMEOUT_S,
    )
    rows = {row["kind"]: row for row in json.loads(out_path.read_text())}
    assert sorted(rows) == ["http", "rule"]
    for row in rows.values():
        assert row["errors"] == 0 and row["calls"] >= 16, row
        # Little's law for closed-loop clients: each keeps one call in flight, so calls/s ×
        # mean latency ≈ clients (a little under: a client's own work between calls). The
        # median and the maximum bracket the mean here, unless the figures are wrong.
        in_flight_at_median = row["calls_per_s"] * row["p50_ms"] / 1000
        in_flight_at_max = row["calls_per_s"] * row["max_ms"] / 1000
        assert in_flight_at_median <= 2 * row["clients"] <= 4 * in_flight_at_max, row
        assert row["replica_mib_start"] > 50 and row["replica_mib_end"] > 50, row
    assert "| rule | 16 |" in result.stdout
