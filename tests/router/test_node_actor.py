"""The cluster's node actor (`pdserve cluster` wraps it with `ray.remote`; here it runs as a
plain object, so what it does when its node goes is observed instead of ending this process):
a node that stays up but is broken for good — a tensor-parallel prefill node that lost a rank,
answering /health with 503 — is ended by the actor, which then ends itself so that Ray
restarts it; a healthy node is left alone."""

from __future__ import annotations

import os
import signal
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from pdserve.cluster.actors import HEALTH_POLL_S, NodeActor
from tests.disagg.cluster import worker_pids
from tests.helpers import make_tiny_model

pytestmark = pytest.mark.slow


def health(url: str) -> int:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=5) as r:
            return int(r.status)
    except urllib.error.HTTPError as e:
        return e.code


def test_a_node_broken_for_good_is_ended_so_that_its_actor_restarts(tmp_path: Path) -> None:
    model = make_tiny_model(tmp_path / "tiny", num_attention_heads=8, num_key_value_heads=4)
    args = ["--model", str(model), "--dtype", "float32", "--threads", "1", "-tp", "2"]
    args += ["--kv-cache-memory", "32", "--host", "127.0.0.1", "--port", "0", "--grpc-port", "0"]
    gone = threading.Event()
    actor = NodeActor("prefill", args, "127.0.0.1", on_node_gone=gone.set)
    try:
        url = actor.info()["http"]
        assert health(url) == 200
        time.sleep(2 * HEALTH_POLL_S)  # healthy: the watcher's polls leave it running
        assert actor.proc.poll() is None and not gone.is_set()
        [rank1] = worker_pids(actor.proc.pid)
        os.kill(rank1, signal.SIGKILL)
        assert gone.wait(15), "the actor did not end its broken node"
        assert actor.proc.poll() is not None  # the node process is gone, not just unhealthy
        assert "tensor-parallel group broken: rank 1 died" in Path(actor.log).read_text()
    finally:
        actor.stop()
