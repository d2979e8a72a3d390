"""Run-config settings reach the deployed services, and a run never silently replaces a
service deployed with other settings."""

import json

import pytest

from integration_tests.support import deployed_services, run_inputs, tiny_run_config
from rlserve.core.rpc import call_metadata
from rlserve.trainer.deploy import ServiceSettingsConflict, deploy_services, service_args
from rlserve.v1 import critic_pb2, critic_pb2_grpc, rollout_pb2, rollout_pb2_grpc


def _settings(serve_cluster, role: str) -> dict:
    channel = serve_cluster.channel()
    if role == "rollout":
        stub, request = (
            rollout_pb2_grpc.RolloutServiceStub(channel),
            rollout_pb2.RolloutServiceGetInfoRequest(),
        )
    else:
        stub, request = (
            critic_pb2_grpc.CriticServiceStub(channel),
            critic_pb2.CriticServiceGetInfoRequest(),
        )
    info = stub.GetInfo(request, metadata=call_metadata(role), timeout=60).info
    return json.loads(info.settings_json)


def test_forward_settings_reach_the_services_and_a_conflicting_run_stops(
    serve_cluster, embedded, tmp_path
):
    config = tiny_run_config(
        tmp_path,
        actor={"forward_micro_batch_samples": 7, "logits_chunk_tokens": 5},
        critic={"forward_micro_batch_samples": 3},
    )
    inputs = run_inputs(embedded)
    deployed_services(config, inputs, serve_cluster.grpc_address)
    rollout = _settings(serve_cluster, "rollout")
    assert (rollout["forward_micro_batch_samples"], rollout["logits_chunk_tokens"]) == (7, 5)
    assert _settings(serve_cluster, "critic")["forward_micro_batch_samples"] == 3

    other = tiny_run_config(tmp_path, actor={"forward_micro_batch_samples": 9})
    with pytest.raises(ServiceSettingsConflict) as conflict:
        deploy_services(service_args(other, inputs.model_dir), timeout_s=300)
    message = str(conflict.value)
    assert "rollout.forward_micro_batch_samples: deployed 7, run wants 9" in message
    assert "trainer.replace_deployed_services=true" in message
    # Nothing was replaced.
    assert _settings(serve_cluster, "rollout")["forward_micro_batch_samples"] == 7

    deploy_services(service_args(other, inputs.model_dir), timeout_s=300, replace_different=True)
    assert _settings(serve_cluster, "rollout")["forward_micro_batch_samples"] == 9
