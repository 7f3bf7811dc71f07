"""The application on an embedded local cluster: two Ray nodes on this machine, the service on
both, one LLM replica per node, Serve's HTTP proxy on a free loopback port. For ``cmx demo`` and
the "e2e" benchmark; everything stops when the context exits.
"""

from __future__ import annotations

import logging
import shutil
import socket
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from cmx.config import ServiceConfig
from cmx.deploy.config import ServeOptions

__all__ = ["LocalApp", "free_port", "local_app", "service_config_for", "wait_replicas"]

MiB = 1 << 20
log = logging.getLogger(__name__)


@dataclass
class LocalApp:
    base_url: str  # http://127.0.0.1:PORT<route prefix>, without /v1
    replicas: list[dict[str, str]]  # {"replica", "node"}, the head node's first
    info: dict[str, Any]  # GET /cmx/info: the namespace the replicas share
    cm: Any  # the driver's ContextMemory (on the head node)
    options: ServeOptions

    @property
    def openai_url(self) -> str:
        return f"{self.base_url}/v1"

    def namespace(self, salt: str = "") -> Any:
        """The replicas' namespace for a tenant's salt, for the driver's lookups."""
        from cmx.layout import KVLayout

        ns = self.info["namespace"]
        layout = KVLayout(ns["num_layers"], ns["num_kv_heads"], ns["head_dim"], ns["dtype"],
                          ns["block_tokens"])
        return self.cm.namespace(ns["model"], layout, salt, ns["weights"])


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def service_config_for(options: ServeOptions, nvme_dir: str, **changes: Any) -> ServiceConfig:
    """A service whose slots fit the model's blocks exactly (no slot holds unused bytes)."""
    from cmx.deploy.model import model_info

    block = model_info(options.model, options.engine).layout.block_bytes
    base: dict[str, Any] = dict(block_bytes=block, hbm_bytes=max(256 * MiB // block, 16) * block,
                dram_bytes=max(1024 * MiB // block, 32) * block,
                nvme_bytes=max(4096 * MiB // block, 64) * block, nvme_dir=nvme_dir,
                nvme_segment_bytes=max(64 * MiB // block, 4) * block)
    base.update(changes)
    return ServiceConfig(**base)


@contextmanager
def local_app(
    options: ServeOptions, service: dict[str, Any] | None = None,
    step: Callable[[str], None] = lambda _s: None, scratch: str = "/var/tmp",
) -> Iterator[LocalApp]:
    """Start everything; ``service`` overrides fields of the service's config; the NVMe tier's
    files go in a new directory under ``scratch``, removed at the end."""
    import httpx
    import ray
    from ray import serve

    from cmx.client import ContextMemory
    from cmx.deploy.app import build

    if ray.is_initialized():
        raise RuntimeError("the local application needs a process without Ray")
    root = tempfile.mkdtemp(prefix="cmx-local-nvme-", dir=scratch)
    config = service_config_for(options, root, **(service or {}))
    options = options.replace(service=config, max_replicas_per_node=1)
    step("starting a two-node Ray cluster")
    try:
        cluster = _two_nodes()
    except BaseException:
        shutil.rmtree(root, ignore_errors=True)
        raise
    cm = None
    try:
        ray.init(address=cluster.address, namespace="cmx", log_to_driver=False,
                 logging_level=logging.ERROR)
        step("starting the context memory service")
        cm = ContextMemory.connect(address=cluster.address, config=config)
        step(f"starting {options.replicas} LLM replicas")
        logging.getLogger("ray.serve").setLevel(logging.WARNING)  # the steps say it all
        port = free_port()
        serve.start(http_options={"host": "127.0.0.1", "port": port},
                    logging_config={"log_level": "WARNING"})
        serve.run(build(options), name=options.app_name, route_prefix=options.route_prefix)
        base = f"http://127.0.0.1:{port}{options.route_prefix.rstrip('/')}"
        replicas = wait_replicas(base, options.replicas, cm.node_id)
        info = httpx.get(f"{base}/cmx/info", timeout=60).json()
        yield LocalApp(base, replicas, info, cm, options)
    finally:
        # Serve first, so that each replica stops its engine and unlinks the shared memory the
        # engine leaves; then the service, so that its tiers unlink their arenas.
        if cm is not None:
            try:
                serve.shutdown()
            except Exception as exc:  # noqa: BLE001 - the cluster goes down regardless
                log.warning("Serve did not shut down: %s", exc)
            cm.shutdown(stop_service=True)
        ray.shutdown()
        cluster.shutdown()
        shutil.rmtree(root, ignore_errors=True)


def _two_nodes(attempts: int = 3) -> Any:
    """A head and one more node; retried, since a raylet that takes over Ray's fixed 30 s to
    register (a loaded machine) fails the start."""
    from ray.cluster_utils import Cluster

    for attempt in range(1, attempts + 1):
        cluster = None
        try:
            # Ray runs its workers at nice 15 so that its own daemons stay responsive; here the
            # workers (the replicas above all) are the workload, and run at the machine's
            # priority.
            cluster = Cluster(initialize_head=True, head_node_args={
                "num_cpus": 2, "include_dashboard": False,
                "_system_config": {"worker_niceness": 0}})
            cluster.add_node(num_cpus=1)
            cluster.wait_for_nodes()
            return cluster
        except Exception as exc:
            if cluster is not None:
                cluster.shutdown()
            if attempt == attempts:
                raise
            log.warning("the local cluster did not start (%s); trying again", exc)
    raise AssertionError("unreachable")


def wait_replicas(base: str, count: int, head: str, timeout_s: float = 180) -> list[dict]:
    import httpx

    deadline = time.monotonic() + timeout_s
    replicas: list[dict[str, str]] = []
    while time.monotonic() < deadline:
        replicas = httpx.get(f"{base}/cmx/replicas", timeout=60).json()["replicas"]
        if len(replicas) >= count:
            return sorted(replicas, key=lambda r: r["node"] != head)
        time.sleep(0.5)
    raise RuntimeError(f"only {len(replicas)} of {count} replicas came up")
