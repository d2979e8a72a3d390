"""Deploy names a resource shortfall within seconds (what waits, what each node offers,
the fix) instead of waiting out trainer.deploy_timeout_s."""

import time

import pytest
import ray

from rlserve.trainer.deploy import ResourceShortfallError, deploy_applications, remove_application

TIMEOUT_S = 240.0  # what the deploy would wait without the shortfall check
SHORTFALL_TIMEOUT_S = 3.0


def _deploy_expecting_shortfall(app: dict) -> tuple[str, float]:
    started = time.monotonic()
    try:
        with pytest.raises(ResourceShortfallError) as error:
            deploy_applications([app], TIMEOUT_S, shortfall_timeout_s=SHORTFALL_TIMEOUT_S)
        return str(error.value), time.monotonic() - started
    finally:
        remove_application(app["name"], timeout_s=120)


def test_a_replica_larger_than_every_node_is_named_in_seconds(serve_cluster):
    app = {
        "name": "shortfall-reward",
        "route_prefix": "/shortfall-reward",
        "import_path": "rlserve.reward.app:build_app",
        "args": {
            "kinds": {"rule": {"rule_name": "arithmetic_exact_match"}},
            "num_cpus_per_replica": 1000,
        },
    }
    message, waited_s = _deploy_expecting_shortfall(app)
    assert waited_s < 60, waited_s
    assert "{CPU: 1000} (larger than every node)" in message
    assert "ServeReplica:shortfall-reward:RewardDeployment" in message
    total_cpus = ray.cluster_resources()["CPU"]
    assert f"/{total_cpus:g}" in message  # every node's free/total CPUs
    assert "add a node that large" in message


@ray.remote(num_cpus=0)
class _Holder:
    def ready(self) -> bool:
        return True


def test_workers_waiting_on_cpus_other_work_holds_are_named_in_seconds(
    serve_cluster, tiny_model_dir, tmp_path
):
    # The case: the replica starts (it reserves no CPU) and its workers wait on
    # {CPU: 1} while every CPU is taken.
    free_cpus = ray.available_resources().get("CPU", 0)
    holder = _Holder.options(num_cpus=free_cpus).remote()
    ray.get(holder.ready.remote())
    app = {
        "name": "shortfall-critic",
        "route_prefix": "/shortfall-critic",
        "import_path": "rlserve.critic.app:build_app",
        "args": {
            "model_path": str(tiny_model_dir),
            "checkpoint_root": str(tmp_path),
            "workers": 2,
            "num_cpus_per_worker": 1,
        },
    }
    try:
        message, waited_s = _deploy_expecting_shortfall(app)
    finally:
        ray.kill(holder)
    assert waited_s < 90, waited_s
    assert "{CPU: 1} (other work holds it)" in message
    assert "pending actors: CriticWorker" in message
    assert "CPU 0/" in message
    assert "shortfall-critic" in message and "DEPLOYING" in message
    assert "free the resources other work holds" in message
