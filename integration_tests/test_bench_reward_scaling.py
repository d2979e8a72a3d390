"""Quick run of benchmarks/bench_reward_scaling.py: 1 and 2 replicas, 3 s each.

In a subprocess, since the benchmark starts its own simulated multi-node cluster and
this pytest process may already be connected to the session's Ray. Checks that the
benchmark scores through the service on every replica count, that every replica ran
on a node of the cheap pool, and that a second replica really adds throughput.
"""

import json

import pytest

from integration_tests.support import run_benchmark

# Measured 87–120 s on this 2-core machine while other test runs shared it: cluster
# start (3 nodes) ≈ 30 s, each replica start ≈ 15–35 s (torch import), two 5 s loads.
TIMEOUT_S = 600


@pytest.mark.slow
def test_two_replicas_on_cheap_nodes_nearly_double_throughput(tmp_path):
    out_path = tmp_path / "scaling.json"
    result = run_benchmark(
        "benchmarks.bench_reward_scaling",
        *("--replicas", "1,2", "--seconds", "3", "--cheap-nodes", "2"),
        *("--json-out", str(out_path)),
        timeout_s=TIMEOUT_S,
    )
    assert "every replica ran on a cheap node: True" in result.stdout
    report = json.loads(out_path.read_text())
    rows = {row["replicas"]: row for row in report["rows"]}
    assert sorted(rows) == [1, 2]
    assert all(row["samples_per_s"] > 0 and row["calls"] > 0 for row in rows.values())
    assert all(row["on_cheap_nodes"] for row in rows.values())
    assert len(set(rows[2]["replica_nodes"])) == 2  # one logical CPU per cheap node
    # Each replica keeps max_concurrency (4) API requests busy; 2 replicas, twice that.
    assert rows[1]["api_max_in_flight"] == 4
    assert rows[2]["api_max_in_flight"] == 8
    speedup = rows[2]["samples_per_s"] / rows[1]["samples_per_s"]
    assert speedup > 1.5, (speedup, result.stdout)
    assert rows[2]["speedup"] == pytest.approx(speedup)
