"""The NIXL transport cases (nixl_transport_cases.py) run in a pytest process of their own:
NIXL's wheel bundles its own abseil, and loading it into the test process beside grpc_tools'
protoc extension (in either order) aborts that process."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

CASES = Path(__file__).with_name("nixl_transport_cases.py")


def test_nixl_transport_cases_pass_in_their_own_process() -> None:
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(CASES)]
    env = {**os.environ, "UCX_NET_DEVICES": "lo"}  # UCX would pick network interfaces itself
    result = subprocess.run(command, capture_output=True, text=True, timeout=300, env=env)
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-3000:]
    assert "9 passed" in result.stdout, result.stdout[-2000:]  # every case ran
