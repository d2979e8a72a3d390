"""A 200-step run keeps its memory flat: the object store and every service's resident
memory (replicas with their workers), recorded by the trainer every 10 steps."""

from pathlib import Path

import pytest

from integration_tests.support import (
    deployed_services,
    run_inputs,
    session_runs_root,
    tiny_run_config,
)
from integration_tests.test_ppo_loop import _run
from rlserve.trainer.metrics import read_metrics

pytestmark = pytest.mark.slow

STEPS = 200
EVERY_STEPS = 10
# Growth allowed from the sample at step 50 (allocator pools and caches have filled by
# then) to the end, 150 steps later: a process leaking ≥ 220 KiB a step, or the object
# store keeping ≥ 7 KiB a step, fails. Measured on 2 cores: ≤ 7.4 MiB and 0.0 MiB.
SETTLED_STEP = 50
OBJECT_STORE_GROWTH_MIB = 1.0
SERVICE_GROWTH_MIB = 32.0


def test_200_steps_keep_object_store_and_service_memory_flat(serve_cluster, embedded, tmp_path):
    config = tiny_run_config(
        tmp_path,
        session_runs_root(tmp_path),
        trainer={"total_steps": STEPS, "resources_every_steps": EVERY_STEPS},
    )
    inputs = run_inputs(embedded)
    deployed_services(config, inputs, serve_cluster.grpc_address)
    summary = _run(config, inputs, tmp_path, serve_cluster.grpc_address)
    samples = [
        r for r in read_metrics(Path(summary.metrics_jsonl)) if "resources/object_store_mib" in r
    ]
    assert [r["step"] for r in samples] == list(range(EVERY_STEPS, STEPS + 1, EVERY_STEPS))
    series = {key: [r[key] for r in samples] for key in samples[0] if key.startswith("resources/")}
    for app in ("rollout", "critic", "reference", "reward", "trainer"):
        assert min(series[f"resources/{app}_mib"]) > 50, series  # every process is measured
    settled = [r["step"] for r in samples].index(SETTLED_STEP)
    store = series["resources/object_store_mib"]
    assert max(store[settled:]) - store[settled] <= OBJECT_STORE_GROWTH_MIB, store
    for key, values in series.items():
        if key != "resources/object_store_mib":
            assert max(values[settled:]) - values[settled] <= SERVICE_GROWTH_MIB, (key, values)
