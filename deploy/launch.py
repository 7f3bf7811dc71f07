"""``cmx serve``: the application on the local Ray cluster, in the background, and its stop.

start: every setting read and checked (``check``) -> a cluster (the one ``cmx up`` recorded,
       else one answering at 127.0.0.1:6379, else a local head started now with
       ``ray start --head --block``) -> the service on it -> Serve's HTTP proxy on loopback ->
       the application -> wait until every replica is routable -> record what was started in
       ``<state dir>/serve.json`` -> return the OpenAI base URL.
stop:  the application -> Serve, if nothing else runs on it -> the service, if ``start`` started
       it -> the Ray head, if ``start`` started it -> forget.

The state directory is the one ``cmx up`` uses (``CMX_STATE_DIR``, default ``~/.cache/cmx``);
``serve.json`` sits beside its ``state.json`` and never changes it.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

from cmx.config import AdminConfig, ServiceConfig
from cmx.deploy.config import ServeOptions, SettingsError
from cmx.errors import CmxError
from cmx.operate.local_ray import HeadOptions

__all__ = ["ServeState", "StopResult", "check", "head_options", "serve_state_path", "start",
           "stop"]

DEFAULT_RAY_PORT = 6379
Step = Callable[[str], None]


@dataclass(frozen=True)
class ServeState:
    base_url: str  # http://127.0.0.1:PORT/v1
    app: str  # Serve application name
    ray_address: str
    started_ray: bool  # `cmx serve` started the Ray head, so `cmx serve --stop` stops it
    ray_pid: int | None
    started_service: bool  # the service's actors were not running before
    started_serve: bool  # Serve was not running before
    replicas: int
    model: str
    started_at: float

    def save(self, path: str) -> None:
        os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
        tmp = f"{path}.tmp"
        with open(tmp, "w") as f:
            json.dump(asdict(self), f, indent=2)
        os.replace(tmp, path)

    @classmethod
    def load(cls, path: str) -> ServeState | None:
        try:
            with open(path) as f:
                return cls(**json.load(f))
        except (OSError, ValueError, TypeError):
            return None


@dataclass(frozen=True)
class StopResult:
    had_state: bool
    app_deleted: bool
    service_stopped: int  # actors
    ray_stopped: bool


def serve_state_path(admin: AdminConfig | None = None) -> str:
    if admin is None:
        try:
            admin = AdminConfig.from_env()
        except ValueError as exc:
            raise SettingsError(str(exc)) from None
    return os.path.join(os.path.dirname(admin.state_path), "serve.json")


def _alive(url: str) -> bool:
    import httpx

    try:
        return httpx.get(f"{url}/models", timeout=5).status_code == 200
    except httpx.HTTPError:
        return False


def _cluster(address: str | None, state_dir: str, step: Step) -> tuple[str, int | None]:
    """The Ray address to use, and the pid of a head started for it (None: it was running)."""
    from cmx.operate.local_ray import is_local, port_open, split_address, start_head
    from cmx.operate.ray_cluster import locate
    from cmx.operate.state import ServiceState

    if address is None:
        up = ServiceState.load(os.path.join(state_dir, "state.json"))
        address = up.ray_address if up is not None else f"127.0.0.1:{DEFAULT_RAY_PORT}"
    if address == "auto":
        return locate(address), None  # a cluster that runs, recorded by its address
    host, port = split_address(address)
    if port_open(host, port):
        return address, None
    if not is_local(host):
        raise CmxError(f"no Ray cluster answers at {address}")
    step(f"starting a local Ray head on port {port}")
    pid = start_head(head_options(port), os.path.join(state_dir, "serve-ray-head.log"))
    return address, pid


def head_options(port: int) -> HeadOptions:
    """The local head ``cmx serve`` starts: GCS on ``port``, no dashboard, and a free port for
    each fixed one another head here holds (Ray's client server on 10001 above all: two heads
    there would split ``ray://`` clients between unrelated clusters), as ``cmx up`` does."""
    return HeadOptions(port=port, dashboard=False).with_free_ports()


def check(options: ServeOptions) -> None:
    """Every setting ``start`` reads, read and checked before it starts anything (a refusal
    after Serve started would leave its proxy on the port with nothing recorded to stop it):
    the state directory's, the API key file (``KeyFileError``), the service's ``CMX_*`` and
    slots that hold one of the model's blocks (``app.check_options``). A setting that cannot
    be used is a ``CmxError``."""
    from cmx.deploy.app import check_options

    serve_state_path()
    try:
        check_options(options)
    except CmxError:
        raise
    except ValueError as exc:  # the service's CMX_* (ServiceConfig.from_env)
        raise SettingsError(str(exc)) from None


def start(options: ServeOptions, address: str | None = None, port: int = 8000,
          step: Step = lambda _s: None) -> tuple[ServeState, bool]:
    """Start (or find) the application; returns its state and whether it was already up.
    Every setting is checked first (``check``): a refused one starts nothing."""
    check(options)
    path = serve_state_path()
    prior = ServeState.load(path)
    if prior is not None and _alive(prior.base_url):
        return prior, True
    state_dir = os.path.dirname(path)
    address, pid = _cluster(address, state_dir, step)
    try:
        state = _deploy(options, address, pid, port, step)
    except BaseException:
        if pid is not None:
            from cmx.operate.ray_cluster import stop_local_head

            stop_local_head(pid, address)
        raise
    state.save(path)
    return state, False


def _deploy(options: ServeOptions, address: str, pid: int | None, port: int,
            step: Step) -> ServeState:
    import ray
    from ray import serve

    from cmx.client import ContextMemory
    from cmx.deploy.app import build
    from cmx.deploy.local import wait_replicas
    from cmx.operate.ray_cluster import join

    step(f"connecting to the Ray cluster at {address}")
    join(address, logging_level=logging.ERROR, log_to_driver=False)
    try:
        named = {a["name"] for a in ray.util.list_named_actors(all_namespaces=True)}
        had_service = "cmx:controller" in named
        had_serve = "SERVE_CONTROLLER_ACTOR" in named
        config, options = _fit(options, had_service)
        step("starting the context memory service" if not had_service
             else "joining the running context memory service")
        cm = ContextMemory.connect(address=address, config=config)
        step(f"starting Serve and {options.replicas} LLM replica(s) (loading the model)")
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        from ray.serve.context import _get_global_client

        client = _get_global_client()
        assert client is not None, "serve.start() returned without a controller"
        port = client.http_config.port  # a running Serve keeps its own port
        serve.run(build(options), name=options.app_name, route_prefix=options.route_prefix)
        base = f"http://127.0.0.1:{port}{options.route_prefix.rstrip('/')}"
        step("waiting until every replica is routable")
        wait_replicas(base, options.replicas, cm.node_id)
        return ServeState(
            base_url=f"{base}/v1", app=options.app_name, ray_address=address,
            started_ray=pid is not None, ray_pid=pid, started_service=not had_service,
            started_serve=not had_serve, replicas=options.replicas,
            model=options.model.model_id, started_at=time.time())
    finally:
        ray.shutdown()


def _fit(options: ServeOptions, joining: bool) -> tuple[ServiceConfig, ServeOptions]:
    """The service's config, with slots of one model block where this command starts it.

    A running service keeps its slots; the replicas check that one of the model's blocks fits
    and fail at startup, with the number to set, if it does not.
    """
    from cmx.deploy.model import model_info
    from cmx.deploy.service import service_config

    config = service_config(options, model_info(options.model, options.engine))
    if joining and options.service is None:
        config = ServiceConfig.from_env()
    return config, options.replace(service=config)


def stop(step: Step = lambda _s: None) -> StopResult:
    import ray
    from ray import serve

    from cmx.operate.local_ray import port_open, split_address
    from cmx.operate.ray_cluster import join, stop_local_head

    path = serve_state_path()
    state = ServeState.load(path)
    if state is None:
        return StopResult(False, False, 0, False)
    deleted, killed = False, 0
    reachable = state.ray_address == "auto" or port_open(*split_address(state.ray_address))
    if reachable:
        step(f"stopping the application {state.app}")
        join(state.ray_address, logging_level=logging.ERROR, log_to_driver=False)
        try:
            try:
                serve.delete(state.app)
                deleted = True
                if state.started_serve and not serve.status().applications:
                    serve.shutdown()
            except Exception:  # noqa: BLE001 - Serve is gone already: nothing to delete
                pass
            if state.started_service:
                from cmx.actors.service import stop_service

                step("stopping the context memory service")
                killed = stop_service()
        finally:
            ray.shutdown()
    stopped = False
    if state.started_ray and state.ray_pid is not None:
        step("stopping the Ray head")
        stopped = stop_local_head(state.ray_pid, state.ray_address)
    os.unlink(path)
    return StopResult(True, deleted, killed, stopped)
