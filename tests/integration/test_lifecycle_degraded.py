"""Loud degradation: a NIXL agent that cannot start (no plugins) and a filesystem that refuses
O_DIRECT (ramfs) are each a warning in the log, a field in the stats, a metric and a detail of
``/readyz`` — never silent."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from lifecycle_support import new_machine

PROBE = """
import json, httpx
from cmx import ContextMemory
from cmx.api.app import create_app
from cmx.api.backend import ServiceBackend
from cmx.api.ray_metrics import RayMetricsMirror
from cmx.api.server import ServerThread
from cmx.config import AdminConfig
from cmx.tiers import Tier

cm = ContextMemory.connect(num_cpus=1, include_dashboard=False)
node = cm.stats().nodes[cm.node_id]
admin = AdminConfig(token="degraded-test-token-1234", sample_s=0.5, history_s=60.0)
server = ServerThread(create_app(lambda: ServiceBackend(cm), admin, mirror=RayMetricsMirror()),
                      "127.0.0.1", 0).start()
ready = httpx.get(server.url + "/readyz", timeout=60).json()
metrics = httpx.get(server.url + "/metrics", timeout=60).text
tiers = httpx.get(server.url + "/api/v1/tiers", timeout=60).json()
server.stop()
cm.shutdown()
print(json.dumps({
    "agent": node.agent.degraded, "nvme": node.tiers[Tier.NVME].degraded,
    "ready": ready, "api_agent": tiers["nodes"][0]["agent"].get("degraded"),
    "api_nvme": tiers["nodes"][0]["tiers"][2]["extra"].get("degraded"),
    "metrics": [l for l in metrics.splitlines() if l.startswith("cmx_degraded{")],
}))
"""


def _private_mounts() -> bool:
    """Whether this process may mount a filesystem in a mount namespace of its own."""
    probe = subprocess.run(["unshare", "-m", "sh", "-c", "mount -t ramfs none /mnt"],
                           capture_output=True, timeout=30)
    return probe.returncode == 0


@pytest.mark.timeout(600)
def test_each_fallback_is_a_warning_a_stat_a_metric_and_a_readiness_detail(
    tmp_path: Path,
) -> None:
    if shutil.which("unshare") is None or not _private_mounts():
        pytest.skip("needs a private mount namespace to mount a filesystem without O_DIRECT")
    m = new_machine(tmp_path, with_token=False)
    nvme = tmp_path / "ramfs"
    nvme.mkdir()
    env = {**m.env, "CMX_NVME_DIR": str(nvme), "NIXL_PLUGIN_DIR": str(tmp_path / "no-plugins"),
           "RAY_ADDRESS": ""}
    script = tmp_path / "probe.py"
    script.write_text(PROBE)
    # ramfs has no O_DIRECT; mounted in a namespace of the test's own, seen by Ray's processes
    result = subprocess.run(
        ["unshare", "-m", "sh", "-c", f'mount -t ramfs none "{nvme}" && exec "$0" "$1"',
         sys.executable, str(script)],
        env=env, capture_output=True, text=True, timeout=400)
    assert result.returncode == 0, f"{result.stdout}\n{result.stderr[-4000:]}"
    out = json.loads(result.stdout.strip().splitlines()[-1])

    assert out["agent"].startswith("object_store_transport: NIXL did not start")
    assert out["nvme"].startswith("buffered_io: ") and "O_DIRECT" in out["nvme"]
    assert (out["api_agent"], out["api_nvme"]) == (out["agent"], out["nvme"])
    assert out["ready"]["ready"] is True
    assert "object_store_transport" in out["ready"]["detail"]
    assert "buffered_io" in out["ready"]["detail"]
    kinds = {line.split('kind="')[1].split('"')[0] for line in out["metrics"]}
    assert kinds == {"object_store_transport", "buffered_io"}
    assert "moves bytes between nodes through Ray's object store" in result.stderr
    assert "runs on buffered I/O" in result.stderr
    shutil.rmtree(m.ray_tmp, ignore_errors=True)
