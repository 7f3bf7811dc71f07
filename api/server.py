"""Serving the admin app: uvicorn in a thread, and the detached actor ``cmx up`` starts.

The socket is bound before the thread starts, so a taken port fails at once, and port 0 gives
a free port whose number is known right away.
"""

from __future__ import annotations

import socket
import threading
import time
from typing import Any

from cmx.config import AdminConfig, ServiceConfig

__all__ = ["ADMIN_ACTOR", "AdminServerActor", "ServerThread", "start_admin_actor",
           "stop_admin_actor", "url_of"]

ADMIN_ACTOR = "cmx:admin"  # in the Ray namespace "cmx"; stop_service() ends it too


def url_of(host: str, port: int) -> str:
    """The URL a local client uses (a wildcard bind is reached on loopback)."""
    shown = {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}.get(host, host)
    return f"http://[{shown}]:{port}" if ":" in shown else f"http://{shown}:{port}"


def bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    sock.listen(128)
    sock.set_inheritable(True)
    return sock


class ServerThread:
    """uvicorn serving ``app`` on ``host:port`` from a daemon thread."""

    def __init__(self, app: Any, host: str = "127.0.0.1", port: int = 0) -> None:
        import uvicorn

        self.host = host
        self._sock = bind(host, port)
        self.port = int(self._sock.getsockname()[1])
        config = uvicorn.Config(app, log_level="warning", access_log=False, lifespan="on")
        self.server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self._sock]},
                                        name="cmx-api-http", daemon=True)

    @property
    def url(self) -> str:
        return url_of(self.host, self.port)

    def start(self, timeout_s: float = 15.0) -> ServerThread:
        self._thread.start()
        deadline = time.monotonic() + timeout_s
        while not self.server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the admin API did not start on {self.url}")
            time.sleep(0.05)
        return self

    def stop(self, timeout_s: float = 10.0) -> None:
        self.server.should_exit = True
        self._thread.join(timeout_s)
        self._sock.close()


class AdminServerActor:
    """The admin API inside the cluster, next to the service; made by ``start_admin_actor``."""

    def __init__(self, service: ServiceConfig, admin: AdminConfig) -> None:
        from cmx.api.app import create_app
        from cmx.api.backend import ServiceBackend
        from cmx.api.ray_metrics import RayMetricsMirror

        app = create_app(lambda: ServiceBackend.connect(None, service), admin,
                         mirror=RayMetricsMirror())
        self.http = ServerThread(app, admin.host, admin.port).start()

    def url(self) -> str:
        return self.http.url

    def stop(self) -> None:
        self.http.stop()


def start_admin_actor(service: ServiceConfig, admin: AdminConfig, node_id: str,
                      timeout_s: float = 60.0) -> str:
    """Start (or find) the admin actor on ``node_id``; returns its URL."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    from cmx.links import RAY_NAMESPACE

    actor: Any = ray.remote(AdminServerActor).options(
        name=ADMIN_ACTOR, namespace=RAY_NAMESPACE, get_if_exists=True, lifetime="detached",
        num_cpus=0, max_restarts=3,
        scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False),
    ).remote(service, admin)
    return str(ray.get(actor.url.remote(), timeout=timeout_s))


def stop_admin_actor(timeout_s: float = 15.0) -> bool:
    """Stop the admin actor if it runs; returns whether it did."""
    import ray

    from cmx.links import RAY_NAMESPACE

    try:
        actor = ray.get_actor(ADMIN_ACTOR, namespace=RAY_NAMESPACE)
    except ValueError:
        return False
    try:
        ray.get(actor.stop.remote(), timeout=timeout_s)
    except Exception:  # noqa: BLE001 - it is killed next anyway
        pass
    ray.kill(actor, no_restart=True)
    return True
