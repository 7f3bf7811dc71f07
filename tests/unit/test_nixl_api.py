"""NIXL is imported so that a process using it exits cleanly."""

import subprocess
import sys
import textwrap

from cmx.nixl_api import has_rdma_device


def test_no_rdma_device_in_an_empty_or_missing_class_dir(tmp_path):
    assert not has_rdma_device(tmp_path / "missing")
    assert not has_rdma_device(tmp_path)
    (tmp_path / "mlx5_0").mkdir()
    assert has_rdma_device(tmp_path)


def test_a_process_with_a_ucx_agent_exits_zero():
    script = textwrap.dedent("""
        from cmx.nixl_api import nixl_api
        api = nixl_api()
        agent = api.nixl_agent("exit-check", api.nixl_agent_config(backends=["UCX"]))
        print("ready", flush=True)
    """)
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120
    )
    assert "ready" in done.stdout
    assert done.returncode == 0, done.stderr[-2000:]
