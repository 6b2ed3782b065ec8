"""The generated stubs in the package are what grpcio-tools makes of pdserve.proto today."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from pdserve.disagg.proto import generate

STUBS = ("pdserve_pb2.py", "pdserve_pb2.pyi", "pdserve_pb2_grpc.py")


def test_generated_stubs_match_the_proto(tmp_path: Path) -> None:
    # In a process of its own: protoc's extension crashes where NIXL's bundled abseil was
    # loaded first (as the NIXL transport tests do in this process).
    command = [sys.executable, "-m", "pdserve.disagg.proto.generate", str(tmp_path)]
    subprocess.run(command, check=True, timeout=120)
    produced = tmp_path / "pdserve" / "disagg" / "proto"
    for name in STUBS:
        assert (produced / name).read_text() == (generate.HERE / name).read_text(), name
