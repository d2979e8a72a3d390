"""A rule or HTTP reward needs no torch, transformers or DeepSpeed: `pip install
rlserve-reward` brings none of them, and the app builds and serves where they are gone.

"Gone" is a `sitecustomize` that makes importing them fail (ModuleNotFoundError, as if
not installed) in every process started with it on PYTHONPATH: a plain subprocess, and
through a runtime_env the reward replica itself.
"""

import json
import os
import subprocess
import sys
from importlib.metadata import PackageNotFoundError, requires
from pathlib import Path

import grpc
import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from ray import serve

from rlserve.core.batch import Batch
from rlserve.core.codec import batch_from_proto, batch_to_proto
from rlserve.core.rpc import call_metadata
from rlserve.reward.app import deployment_options
from rlserve.reward.config import RewardServiceConfig
from rlserve.reward.deployment import RewardDeployment
from rlserve.v1 import reward_pb2, reward_pb2_grpc

MODEL_LIBRARIES = frozenset(
    {"torch", "transformers", "deepspeed", "peft", "accelerate", "gguf", "safetensors"}
)
APP = "reward-test-without-torch"
RULE_CONFIG = {"kinds": {"rule": {"rule_name": "arithmetic_exact_match"}}}

_SITECUSTOMIZE = """
import importlib.abc, os, sys

BLOCKED = {blocked!r}


class _Gone(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in BLOCKED:
            raise ModuleNotFoundError(f"No module named {{name!r}} (blocked)", name=name)
        return None


sys.meta_path.insert(0, _Gone())
marker = os.environ.get("RLSERVE_TEST_BLOCK_MARKER")
if marker:
    with open(marker, "a") as file:
        file.write(f"{{os.getpid()}}\\n")
"""


def dependency_closure(name: str, extras: frozenset[str] = frozenset()) -> set[str]:
    """Every distribution `pip install name[extras]` resolves to, from installed metadata."""
    seen: set[tuple[str, frozenset[str]]] = set()
    todo = [(canonicalize_name(name), extras)]
    while todo:
        key = todo.pop()
        if key in seen:
            continue
        seen.add(key)
        try:
            lines = requires(key[0]) or []
        except PackageNotFoundError:  # an optional dependency of a dependency, not installed
            continue
        for line in lines:
            requirement = Requirement(line)
            wanted = requirement.marker is None or any(
                requirement.marker.evaluate({"extra": extra}) for extra in (*key[1], "")
            )
            if wanted:
                todo.append((canonicalize_name(requirement.name), frozenset(requirement.extras)))
    return {dist for dist, _ in seen}


@pytest.fixture(scope="module")
def blocking_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("no_torch")
    (directory / "sitecustomize.py").write_text(
        _SITECUSTOMIZE.format(blocked=sorted(MODEL_LIBRARIES))
    )
    return directory


def test_reward_package_resolves_no_model_library():
    light = dependency_closure("rlserve-reward")
    assert "rlserve-core" in light
    assert not light & MODEL_LIBRARIES, sorted(light & MODEL_LIBRARIES)
    # The extra is where they are: the walk does see them when asked to.
    assert dependency_closure("rlserve-reward", frozenset({"model"})) >= MODEL_LIBRARIES


def test_app_builds_where_torch_cannot_be_imported(blocking_path):
    script = f"""
import json, sys
try:
    import torch
except ModuleNotFoundError:
    pass
else:
    sys.exit("the blocker let torch in")
from rlserve.reward.app import build_app
build_app({RULE_CONFIG!r})
blocked = {sorted(MODEL_LIBRARIES)!r}
print(json.dumps(sorted(m for m in sys.modules if m.partition(".")[0] in blocked)))
"""
    env = {**os.environ, "PYTHONPATH": str(blocking_path)}
    done = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout.strip().splitlines()[-1]) == []


@pytest.mark.cluster
def test_rule_reward_serves_where_torch_cannot_be_imported(serve_cluster, blocking_path, tmp_path):
    marker = tmp_path / "blocked_pids"
    config = RewardServiceConfig.model_validate({**RULE_CONFIG, "num_cpus_per_replica": 0.5})
    options = deployment_options(config)
    env_vars = options["ray_actor_options"]["runtime_env"]["env_vars"]
    env_vars.update(PYTHONPATH=str(blocking_path), RLSERVE_TEST_BLOCK_MARKER=str(marker))
    serve.run(
        RewardDeployment.options(**options).bind(config.model_dump()),
        name=APP,
        route_prefix=f"/{APP}",
    )
    channel = serve_cluster.channel()
    try:
        stub = reward_pb2_grpc.RewardServiceStub(channel)
        import torch

        # The trainer's request: tensors too, which this replica checks but never decodes.
        batch = Batch(
            tensors={"input_ids": torch.ones(3, 4, dtype=torch.int64)},
            non_tensors={"response_text": ["3", "31", "12"], "ground_truth": ["3", "30", "12"]},
            meta={"step": 5},
        )
        response = stub.ComputeReward(
            reward_pb2.ComputeRewardRequest(batch=batch_to_proto(batch)),
            metadata=call_metadata(APP),
            timeout=60,
        )
        scores = batch_from_proto(response.batch)
        assert scores["scores"].tolist() == [1.0, 0.0, 1.0]
        assert scores["scores_rule"].tolist() == [1.0, 0.0, 1.0]
        assert scores.meta["step"] == 5

        bad = reward_pb2.ComputeRewardRequest(batch=batch_to_proto(batch))
        bad.batch.tensors["input_ids"].data = b"\0"
        with pytest.raises(grpc.RpcError) as error:
            stub.ComputeReward(bad, metadata=call_metadata(APP), timeout=60)
        assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "tensors['input_ids'].data" in error.value.details()

        # The replica that answered is one the blocker started in.
        info = stub.GetInfo(
            reward_pb2.RewardServiceGetInfoRequest(), metadata=call_metadata(APP), timeout=60
        )
        blocked_pids = {int(line) for line in marker.read_text().split()}
        assert info.info.workers[0].pid in blocked_pids
    finally:
        channel.close()
        serve.delete(APP)
