"""``cmx up`` and ``cmx down``: the Ray head, the service, the admin API actor and the state file.

up:   a cluster (the one at ``address``, or a local head started now if none answers there)
      -> the service on it (``ensure_service``) -> the admin API actor on this node, with a
      token (CMX_ADMIN_TOKEN, else the one recorded, else a new one) -> wait until it is ready
      -> record the state.
down: the admin API and the service actors -> the Ray head if ``up`` started it -> forget.
"""

from __future__ import annotations

import logging
import os
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from cmx.config import AdminConfig, ServiceConfig
from cmx.errors import CmxError
from cmx.operate.admin_client import AdminApiError, AdminClient
from cmx.operate.local_ray import (
    HeadOptions,
    is_local,
    is_our_head,
    port_open,
    split_address,
    start_head,
)
from cmx.operate.ray_cluster import join, locate, match_ray_auth, stop_local_head
from cmx.operate.state import ServiceState
from cmx.tiers import tier_specs

__all__ = ["DownResult", "UpOptions", "UpResult", "down", "match_auth_for", "orphans", "up"]

Step = Callable[[str], None]  # reports the step under way


@dataclass(frozen=True)
class UpOptions:
    address: str | None  # a cluster's host:port or "auto"; None: 127.0.0.1:<head.port>
    head: HeadOptions  # for a local head, if one must be started
    admin: AdminConfig  # host, port, token (None: recorded or new), token_all, state_dir
    service: ServiceConfig
    ready_timeout_s: float = 120.0


@dataclass(frozen=True)
class UpResult:
    state: ServiceState
    already_up: bool  # a healthy API was recorded: nothing was started


@dataclass(frozen=True)
class DownResult:
    actors_stopped: int
    ray_stopped: bool
    had_state: bool


def up(opts: UpOptions, step: Step = lambda s: None) -> UpResult:
    path = opts.admin.state_path
    prior = ServiceState.load(path)
    step("looking for a running service")
    if prior is not None and _ready(AdminClient(prior.admin_url, prior.token, 5.0)):
        return UpResult(prior, already_up=True)

    # "auto" names a cluster that runs (a head is never started for it); its address is what
    # is recorded, so `cmx down` finds the same cluster after the current-cluster file moves.
    auto = opts.address == "auto"
    address = locate("auto") if auto else opts.address or f"127.0.0.1:{opts.head.port}"
    match_auth_for(address)
    pid = None
    ray_dashboard: str | None = None
    log_path = os.path.join(os.path.dirname(path), "ray-head.log")
    if prior is not None and prior.started_ray and prior.ray_address == address and \
            prior.ray_pid and is_our_head(prior.ray_pid):
        pid = prior.ray_pid  # our head still runs (only the API went away): still ours to stop
        ray_dashboard = prior.ray_dashboard
    elif not auto:
        host, port = split_address(address)
        if not port_open(host, port):
            if not is_local(host):
                raise CmxError(f"no Ray cluster answers at {address}")
            step(f"starting a local Ray head on port {port}")
            head = replace(opts.head, port=port).with_free_ports()
            pid = start_head(head, log_path)
            if head.dashboard:
                ray_dashboard = f"http://127.0.0.1:{head.dashboard_port}"
    try:
        token = opts.admin.token or (prior.token if prior else None) or secrets.token_urlsafe(32)
        url, node = _start_on_cluster(address, opts, opts.admin.replace(token=token), step)
        step("waiting for the admin API to be ready")
        _wait_ready(AdminClient(url, token, 5.0), opts.ready_timeout_s)
    except BaseException:
        if pid is not None and pid != (prior.ray_pid if prior else None):
            stop_local_head(pid, address)
        raise
    state = ServiceState(admin_url=url, token=token, ray_address=address,
                         started_ray=pid is not None, ray_pid=pid,
                         ray_log=log_path if pid is not None else None, node_id=node,
                         ray_dashboard=ray_dashboard, started_at=time.time())
    state.save(path)
    return UpResult(state, already_up=False)


def match_auth_for(address: str) -> bool:
    """Token authentication for ``cmx up`` at ``address``: a cluster that already answers there
    decides by whether it refuses a call without a token (it may run without one on a machine
    where a token exists); a head that ``up`` is about to start, by whether a token exists, as
    ``ray start`` decides. True if it is on."""
    running = address != "auto" and port_open(*split_address(address))
    return match_ray_auth(address if running else None)


def down(admin: AdminConfig, address: str | None = None, step: Step = lambda s: None
         ) -> DownResult:
    path = admin.state_path
    state = ServiceState.load(path)
    address = address or (state.ray_address if state else None)
    stopped = 0
    if address is not None and _reachable(address):
        step("stopping the admin API and the service's actors")
        stopped = _stop_on_cluster(address)
    ray_stopped = False
    if state is not None and state.started_ray and state.ray_pid:
        step("stopping the local Ray head")
        ray_stopped = stop_local_head(state.ray_pid, state.ray_address)
    ServiceState.clear(path)
    return DownResult(stopped, ray_stopped, state is not None)


def orphans(admin: AdminConfig, address: str | None, collect: bool, older_than_s: float
            ) -> dict[str, list[Any]]:
    """The orphaned store directories of the service's nodes (removed if ``collect``)."""
    import ray

    from cmx.operate.orphans import collect_orphans, list_orphans

    state = ServiceState.load(admin.state_path)
    address = address or (state.ray_address if state else None)
    if address is None:
        raise CmxError("no service recorded here: run `cmx up`, or pass --address")
    join(address, logging_level=logging.WARNING, log_to_driver=False)
    try:
        return collect_orphans(older_than_s) if collect else list_orphans()
    finally:
        ray.shutdown()


# -- helpers -----------------------------------------------------------------------------------


def _start_on_cluster(address: str, opts: UpOptions, admin: AdminConfig, step: Step
                      ) -> tuple[str, str]:
    import ray

    from cmx.api.server import start_admin_actor, stop_admin_actor
    from cmx.client import ContextMemory

    step("starting the service (tiers, agents, directory)")
    cm = ContextMemory.connect(address=address, config=opts.service,
                               logging_level=logging.WARNING, log_to_driver=False)
    try:
        step("starting the admin API")
        stop_admin_actor()  # a new token or port takes effect
        url = start_admin_actor(opts.service, admin, cm.node_id)
        return url, cm.node_id
    finally:
        ray.shutdown()


def _stop_on_cluster(address: str) -> int:
    import ray

    from cmx.actors.service import stop_service
    from cmx.api.server import stop_admin_actor

    join(address, logging_level=logging.WARNING, log_to_driver=False)
    try:
        stopped = int(stop_admin_actor())
        _close_stores()
        return stopped + stop_service()
    finally:
        ray.shutdown()


def _close_stores(timeout_s: float = 30.0) -> None:
    """Close the agents, then the tiers, before they are killed: a killed tier leaves its
    shared-memory arena behind (GiBs of /dev/shm), a closed one unlinks it."""
    import ray

    from cmx.links import RAY_NAMESPACE

    names = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
             if a.get("namespace") == RAY_NAMESPACE]
    for kinds in (("agent",), tuple(s.name for s in tier_specs())):  # the pool's nodes too
        refs: list[Any] = []
        for name in names:
            if name.split(":")[1:2] and name.split(":")[1] in kinds:
                try:
                    refs.append(ray.get_actor(name, namespace=RAY_NAMESPACE).close.remote())
                except (ValueError, AttributeError):
                    continue
        try:
            ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
        except Exception:  # noqa: BLE001 - they are killed next anyway
            pass


def _reachable(address: str) -> bool:
    if address == "auto":
        return True
    try:
        return port_open(*split_address(address))
    except ValueError:
        return False


def _ready(client: AdminClient) -> bool:
    try:
        return bool(client.get("/readyz").get("ready"))
    except AdminApiError:
        return False


def _wait_ready(client: AdminClient, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    last = "no answer"
    while time.monotonic() < deadline:
        try:
            if client.get("/readyz").get("ready"):
                return
        except AdminApiError as exc:
            last = str(exc)
        time.sleep(0.5)
    raise CmxError(f"the admin API at {client.url} was not ready in {timeout_s:.0f} s: {last}")
