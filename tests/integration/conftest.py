"""One Ray cluster for the whole integration session: two nodes of ray.cluster_utils.Cluster.

The driver is attached to the head node; tests that need a client on the other node run it in
an actor pinned there. Layouts and tiers are small so the suite stays fast on two cores.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from support import BLOCK

from cmx.config import ServiceConfig


def patiently(start: Callable[[], Any], attempts: int = 3) -> Any:
    """Start a Ray node: Ray gives a raylet 30 s to register, which a loaded machine can miss,
    so a timed-out start is tried again."""
    for attempt in range(attempts):
        try:
            return start()
        except Exception as exc:  # noqa: BLE001 - Ray raises a bare Exception on this timeout
            if "timed out during startup" not in str(exc) or attempt == attempts - 1:
                raise
    raise AssertionError("unreachable")


@pytest.fixture(scope="session")
def cluster() -> Iterator[Any]:
    import ray
    from ray.cluster_utils import Cluster

    c = patiently(lambda: Cluster(
        initialize_head=True,
        head_node_args={"num_cpus": 2, "resources": {"head": 1}},
    ))
    patiently(lambda: c.add_node(num_cpus=1, resources={"worker": 1}))
    c.wait_for_nodes()
    # Workers import the test helpers (support.py) by module name, as the driver does.
    here = os.path.dirname(__file__)
    path = os.pathsep.join(p for p in (here, os.environ.get("PYTHONPATH")) if p)
    ray.init(address=c.address, namespace="cmx",
             runtime_env={"env_vars": {"PYTHONPATH": path}})
    yield c
    ray.shutdown()
    c.shutdown()


@pytest.fixture(scope="session")
def config() -> Iterator[ServiceConfig]:
    root = tempfile.mkdtemp(prefix="cmx-it-")
    yield ServiceConfig(
        block_bytes=BLOCK,
        hbm_bytes=8 * BLOCK,
        dram_bytes=16 * BLOCK,
        nvme_bytes=1024 * BLOCK,
        nvme_dir=root,
        nvme_segment_bytes=64 * BLOCK,
        directory_shards=2,
        call_timeout_s=10.0,
        load_timeout_s=20.0,
        heartbeat_s=0.5,
        lease_s=15.0,  # what a killed holder leaves goes back within the storm test's bound
        pool_bytes=256 * BLOCK,
        pool_staging_bytes=16 * BLOCK,
        pool_admission_min_count=1,  # every stored block is pooled, where a pool exists
    )
    shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="session")
def cm(cluster: Any, config: ServiceConfig) -> Iterator[Any]:
    from cmx import ContextMemory

    memory = ContextMemory.connect(address=cluster.address, config=config)
    yield memory
    memory.shutdown(stop_service=True)


@pytest.fixture(scope="session")
def nodes(cm: Any) -> tuple[str, str]:
    """(head node id, worker node id)."""
    import ray

    head = cm.node_id
    other = [n["NodeID"] for n in ray.nodes() if n["Alive"] and n["NodeID"] != head]
    return head, other[0]


@pytest.fixture(scope="session")
def admin_api(cm: Any) -> Iterator[Any]:
    """The admin API on a free loopback port over the session's service: ``.url``, ``.token``."""
    from types import SimpleNamespace

    from cmx.api.app import create_app
    from cmx.api.backend import ServiceBackend
    from cmx.api.ray_metrics import RayMetricsMirror
    from cmx.api.server import ServerThread
    from cmx.config import AdminConfig

    admin = AdminConfig(token="integration-admin-token", sample_s=0.5, history_s=300.0)
    app = create_app(lambda: ServiceBackend(cm), admin, mirror=RayMetricsMirror())
    server = ServerThread(app, "127.0.0.1", 0).start()
    yield SimpleNamespace(url=server.url, token=admin.token)
    server.stop()
