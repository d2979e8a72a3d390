"""A new run on services an earlier run trained (what `rlserve train` does on a running
cluster whose services already have this run's settings): nothing is redeployed, the run
resets the rollout and critic to their initial weights and computes exactly what the
first run on freshly deployed services computed."""

import asyncio

from integration_tests.support import (
    assert_same_step_metrics,
    fresh_services,
    run_inputs,
    tiny_run_config,
)
from rlserve.core.placement import serve_replicas
from rlserve.trainer.deploy import deploy_services, service_args
from rlserve.trainer.metrics import read_metrics
from rlserve.trainer.run import train_on_services

ROLES = ("rollout", "critic", "reference", "reward")


def _replica_ids() -> dict[str, list[str]]:
    return {role: sorted(r["replica_id"] for r in serve_replicas(role)) for role in ROLES}


def test_a_second_run_resets_the_trained_services_and_repeats_the_first(
    serve_cluster, embedded, tmp_path
):
    config = tiny_run_config(tmp_path)
    inputs = run_inputs(embedded)
    fresh_services(config, inputs)
    replicas = _replica_ids()

    def run(name: str):
        return asyncio.run(
            train_on_services(
                config, inputs, tmp_path / name, serve_cluster.grpc_address, show_progress=False
            )
        )

    first = run("first")
    assert "reset_services" not in first.phases_s  # freshly deployed: nothing to reset
    # the run's own deployment step: same settings, so every app is left as it is
    deploy_services(service_args(config, inputs.model_dir), timeout_s=60)
    second = run("second")
    assert second.phases_s["reset_services"] > 0
    assert _replica_ids() == replicas  # the same replicas served both runs

    def steps(name: str) -> list[dict]:
        return [r for r in read_metrics(tmp_path / name / "metrics.jsonl") if "reward_mean" in r]

    assert [r["step"] for r in steps("second")] == [1, 2, 3]
    assert_same_step_metrics(steps("first"), steps("second"))
