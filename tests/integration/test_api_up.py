"""`cmx up`, `cmx status --json`, `cmx down` as a user runs them, on a Ray head of their own.

The head gets its own free ports (GCS, client server, dashboard) and RAY_ADDRESS points the
commands at it, so the session's cluster is never touched.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest

from cmx.operate.local_ray import is_running, port_open


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def cmx(env: dict[str, str], *args: str, timeout_s: float = 300) -> Any:
    result = subprocess.run([sys.executable, "-m", "cmx.cli", *args], env=env,
                            capture_output=True, text=True, timeout=timeout_s)
    assert result.returncode == 0, f"cmx {' '.join(args)}:\n{result.stdout}\n{result.stderr}"
    return json.loads(result.stdout)


@pytest.mark.timeout(900)
def test_up_status_down_on_a_head_started_for_the_service(tmp_path: Path) -> None:
    gcs, api, client, dashboard = (free_port() for _ in range(4))
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("CMX_", "RAY_"))}  # nothing of the session's cluster
    env.update({
        "RAY_ADDRESS": f"127.0.0.1:{gcs}", "CMX_STATE_DIR": str(tmp_path / "state"),
        "CMX_NVME_DIR": str(tmp_path / "nvme"), "CMX_HBM_BYTES": str(16 << 20),
        "CMX_DRAM_BYTES": str(32 << 20), "CMX_NVME_BYTES": str(256 << 20),
        "CMX_NVME_SEGMENT_BYTES": str(32 << 20), "CMX_STAGING_BYTES": str(16 << 20),
    })
    state_file = tmp_path / "state" / "state.json"
    up = cmx(env, "up", "--num-cpus", "1", "--port", str(api), "--no-dashboard",
             "--dashboard-port", str(dashboard), f"--ray-arg=--ray-client-server-port={client}",
             "--json")
    try:
        assert up["started_ray"] is True and up["already_up"] is False
        assert up["admin_url"] == f"http://127.0.0.1:{api}"
        assert up["ray_address"] == f"127.0.0.1:{gcs}"
        assert oct(state_file.stat().st_mode & 0o777) == "0o600"
        ray_pid = json.loads(state_file.read_text())["ray_pid"]

        view = cmx(env, "status", "--json")
        assert len(view["nodes"]) == 1
        node = view["nodes"][0]["node"]
        tiers = view["nodes"][0]["tiers"]
        assert [t["tier"] for t in tiers] == ["hbm", "dram", "nvme"]
        assert all(t["available"] for t in tiers)
        assert [t["capacity_bytes"] for t in tiers] == [16 << 20, 32 << 20, 256 << 20]
        assert view["nodes"][0]["agent"]["available"] is True
        assert httpx.get(f"{up['admin_url']}/", timeout=10).status_code == 200

        again = cmx(env, "up", "--json")
        assert again["already_up"] is True and again["admin_url"] == up["admin_url"]
    finally:
        down = cmx(env, "down", "--json")
    assert down["ray_stopped"] is True and down["actors_stopped"] >= 1
    assert not port_open("127.0.0.1", gcs) and not port_open("127.0.0.1", api)
    assert not is_running(ray_pid)
    assert not state_file.exists()
    # The tiers were closed before they were killed: their shared-memory arenas are gone.
    assert not list(Path("/dev/shm").glob(f"cmx-*-{node[:12]}-*"))
