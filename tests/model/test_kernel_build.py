"""Loading the compiled kernels survives a builder that was killed: torch's lock file, left in
the build folder, is removed by the next process that takes the build folder's flock, instead of
making every later start of pdserve wait for it without end."""

from __future__ import annotations

import subprocess
import sys

from pdserve.model import fused


def test_a_lock_left_by_a_killed_builder_does_not_stop_the_next_load() -> None:
    assert fused.compiled() is not None  # built (or loaded) here first, as `make install` does
    directory = fused.build_directory()
    with open(directory / "pdserve.lock", "a") as turn:
        fused.take_turn(turn, 300)  # as a builder would, so no other process is building
        (directory / "lock").touch()  # what torch leaves behind when its builder is killed
    load = subprocess.run(
        [sys.executable, "-m", "pdserve.model.fused"], capture_output=True, text=True, timeout=300
    )
    assert "compiled CPU kernels: ready" in load.stdout, load.stderr
    assert not (directory / "lock").exists()
