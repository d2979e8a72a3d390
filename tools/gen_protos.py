"""Generates the Python stubs of proto/rlserve/v1 into libs/proto/src (committed).

The generator is grpcio-tools at the version pinned in tools/constraints.txt; its
protoc writes the messages (*_pb2.py), their type stubs (*_pb2.pyi) and the gRPC
client/server code (*_pb2_grpc.py). `--out DIR` writes elsewhere, which the freshness
test uses to compare a fresh generation with the committed files.
"""

import argparse
import sys
from importlib import resources
from pathlib import Path

from grpc_tools import protoc

REPO = Path(__file__).resolve().parent.parent
PROTO_ROOT = REPO / "proto"
STUBS_ROOT = REPO / "libs" / "proto" / "src"


def proto_files() -> list[Path]:
    return sorted((PROTO_ROOT / "rlserve" / "v1").glob("*.proto"))


def generate(out_dir: Path) -> list[Path]:
    """Runs protoc over every contract; returns the files written, relative to out_dir."""
    out_dir.mkdir(parents=True, exist_ok=True)
    well_known = resources.files("grpc_tools") / "_proto"
    protos = [str(p.relative_to(PROTO_ROOT)) for p in proto_files()]
    args = [
        "protoc",
        f"-I{PROTO_ROOT}",
        f"-I{well_known}",
        f"--python_out={out_dir}",
        f"--pyi_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        *protos,
    ]
    if protoc.main(args) != 0:
        raise RuntimeError(f"protoc failed: {' '.join(args)}")
    return sorted(p.relative_to(out_dir) for p in (out_dir / "rlserve" / "v1").glob("*.py*"))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=STUBS_ROOT, help="output root")
    args = parser.parse_args()
    stale = args.out / "rlserve" / "v1"
    for old in stale.glob("*_pb2*.py*") if stale.exists() else []:
        old.unlink()
    for path in generate(args.out):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
