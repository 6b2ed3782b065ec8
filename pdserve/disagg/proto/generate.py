"""Regenerates the protobuf/gRPC stubs next to pdserve.proto with grpcio-tools
(`python -m pdserve.disagg.proto.generate [OUT_DIR]`: the repository root by default)."""

from __future__ import annotations

import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
PROTO = "pdserve/disagg/proto/pdserve.proto"


def generate(out_dir: Path) -> None:
    from grpc_tools import protoc

    root = HERE.parent.parent.parent
    args = [
        "protoc",
        f"-I{root}",
        f"--python_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        f"--pyi_out={out_dir}",
    ]
    if protoc.main([*args, str(root / PROTO)]) != 0:
        raise RuntimeError("protoc failed")


if __name__ == "__main__":
    generate(Path(sys.argv[1]) if len(sys.argv) > 1 else HERE.parent.parent.parent)
    sys.exit(0)
