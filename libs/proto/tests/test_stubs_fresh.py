"""The committed stubs must equal what the pinned generator makes from proto/ today."""

import importlib
import runpy
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]
gen_protos = runpy.run_path(str(REPO / "tools" / "gen_protos.py"))


def test_committed_stubs_match_a_fresh_generation(tmp_path):
    fresh = gen_protos["generate"](tmp_path)
    committed_root = gen_protos["STUBS_ROOT"]
    committed = sorted(
        p.relative_to(committed_root)
        for p in committed_root.rglob("*_pb2*.py*")
        if "__pycache__" not in p.parts  # any import writes x_pb2.cpython-311.pyc there
    )
    assert committed == fresh, "stub files differ from proto/: run `make protos` and commit"
    stale = [p for p in fresh if (tmp_path / p).read_bytes() != (committed_root / p).read_bytes()]
    assert not stale, f"stale stubs {stale}: run `make protos` and commit"


def test_every_proto_has_importable_messages_and_services():
    for proto in gen_protos["proto_files"]():
        module = importlib.import_module(f"rlserve.v1.{proto.stem}_pb2")
        assert module.DESCRIPTOR.package == "rlserve.v1"
        importlib.import_module(f"rlserve.v1.{proto.stem}_pb2_grpc")


def test_required_rpcs_exist():
    required = {
        "rollout": {"GenerateSequences", "ComputeLogProb", "UpdateActor", "GetInfo"},
        "critic": {"ComputeValues", "UpdateCritic", "GetInfo"},
        "reference": {"ComputeRefLogProb", "GetInfo"},
        "reward": {"ComputeReward", "GetInfo"},
        "trainer": {"GetStatus", "RequestCheckpoint", "Stop"},
    }
    stateful = {"rollout", "critic"}
    for role, rpcs in required.items():
        module = importlib.import_module(f"rlserve.v1.{role}_pb2")
        (service,) = module.DESCRIPTOR.services_by_name.values()
        names = {method.name for method in service.methods}
        assert rpcs <= names, f"{service.name} lacks {rpcs - names}"
        if role in stateful:
            assert {"SaveCheckpoint", "LoadCheckpoint"} <= names
