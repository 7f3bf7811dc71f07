"""`cmx serve` on a machine where a Ray token exists: the head it starts turns token
authentication on, and `cmx serve` joins it as Ray's own CLI would; `--stop` leaves no dead head
in Ray's current-cluster file."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from lifecycle_support import free_port, new_machine

from cmx.operate.local_ray import port_open


@pytest.mark.timeout(900)
def test_serve_starts_and_stops_with_token_authentication(tmp_path: Path) -> None:
    m = new_machine(tmp_path)
    gcs, http = free_port(), free_port()
    m.env.pop("CMX_BLOCK_BYTES")  # the served model's blocks size the slots

    def serve(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "cmx.cli", "serve", *args], env=m.env,
                              capture_output=True, text=True, timeout=600)

    started = serve("--replicas", "1", "--port", str(http), "--address", f"127.0.0.1:{gcs}")
    try:
        assert started.returncode == 0, started.stderr[-4000:]
        base = started.stdout.strip().splitlines()[-1]
        assert httpx.get(f"{base}/models", timeout=30).status_code == 200
    finally:
        stopped = serve("--stop")
    assert stopped.returncode == 0, stopped.stderr[-4000:]
    assert not port_open("127.0.0.1", gcs)
    assert not m.current_cluster_file.exists()
    shutil.rmtree(m.ray_tmp, ignore_errors=True)
