"""Ray Serve LLM as shipped in ``deploy/serve_llm_config.yaml``, on a one-node cluster of two
CPUs in a process of its own, for ``test_serve_llm_replicas``.

It does what ``serve run deploy/serve_llm_config.yaml`` does (``ray.serve.scripts.run``): the
file's applications go to Serve's controller, which runs the builder each names with its
``args`` (``cmx.deploy.serve_llm:build_app``). One thing differs: Serve's HTTP proxy listens on a
free loopback port, not the file's 0.0.0.0:8000, which another run on the machine may hold.
JSON lines on stdin/stdout (``app_process``):

    -> {"ready": {"base_url": ..., "app": ..., "replicas": N}}   once the application runs
    <- {"lookup": {"salt": "...", "ids": [...]}} -> {"tokens": N}
    <- {"serve_shutdown": true} -> {"shut_down": true}   Serve shut down (``serve shutdown``:
       each replica stops its engine); the cluster and the context memory service run on
    stdin closed: what ``serve run`` does on Ctrl-C: Serve shut down (if it runs), then the
    cluster, the context memory service on it never stopped by itself; the process exits 0.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from collections.abc import Callable
from importlib import resources
from typing import Any

import yaml

CONFIG = "serve_llm_config.yaml"  # in cmx.deploy, as the package ships it
NUM_CPUS = 2  # the machine the file is sized for
DEPLOY_TIMEOUT_S = 840.0  # a bound: within the test's bound on the whole start


def shipped_config() -> Any:
    from ray.serve.schema import ServeDeploySchema

    text = resources.files("cmx.deploy").joinpath(CONFIG).read_text()
    return ServeDeploySchema.model_validate(yaml.safe_load(text))


def wait_running(name: str, timeout_s: float) -> None:
    from ray import serve

    deadline = time.monotonic() + timeout_s
    status = None
    while time.monotonic() < deadline:
        status = serve.status().applications.get(name)
        if status is not None and status.status == "RUNNING":
            return
        if status is not None and status.status == "DEPLOY_FAILED":
            raise RuntimeError(f"{name} failed to deploy: {status.message}")
        time.sleep(1.0)
    raise TimeoutError(f"{name} did not run within {timeout_s:.0f} s: {status}")


def namespace_of(args: dict[str, Any]) -> tuple[Any, Callable[[str], Any]]:
    """A client of the service, and the namespace of a salt as the application's engines open
    it: the same model, layout and weights, derived from the same args as the builder's."""
    from cmx.client import ContextMemory
    from cmx.deploy.config import ServeOptions
    from cmx.deploy.model import model_info
    from cmx.deploy.service import service_config

    options = ServeOptions.from_args(args)
    model = model_info(options.model, options.engine)
    cm = ContextMemory.connect(config=service_config(options, model), start_service="wait")
    return cm, lambda salt: cm.namespace(model.name, model.layout, salt, model.weights)


def main() -> None:
    import ray
    from ray import serve
    from ray.serve._private import api as serve_api

    from cmx.deploy.local import free_port

    config = shipped_config()
    (app,) = config.applications
    # Ray runs its workers at nice 15 so that its own daemons stay responsive; here the
    # replicas are the workload, and run at the machine's priority.
    ray.init(num_cpus=NUM_CPUS, include_dashboard=False, namespace="serve", log_to_driver=False,
             logging_level=logging.ERROR, _system_config={"worker_niceness": 0})
    cm = None
    try:
        port = free_port()
        client = serve_api.serve_start(
            http_options={**config.http_options.model_dump(), "host": "127.0.0.1",
                          "port": port},
            proxy_location=config.proxy_location, global_logging_config={"log_level": "WARNING"})
        client.deploy_apps(config)
        wait_running(app.name, DEPLOY_TIMEOUT_S)
        cm, namespace = namespace_of(app.args)
        ready = {"base_url": f"http://127.0.0.1:{port}{app.route_prefix.rstrip('/')}",
                 "app": app.name, "replicas": app.args["replicas"]}
        print(json.dumps({"ready": ready}), flush=True)
        for line in sys.stdin:
            print(json.dumps(answer(json.loads(line), namespace)), flush=True)
        serve.shutdown()
    finally:
        if cm is not None:
            cm.shutdown()  # this client only: the service goes with the cluster
        ray.shutdown()


def answer(command: dict[str, Any], namespace: Callable[[str], Any]) -> dict[str, Any]:
    from ray import serve

    try:
        if command.get("serve_shutdown"):
            serve.shutdown()
            return {"shut_down": True}
        lookup = command["lookup"]
        return {"tokens": namespace(lookup["salt"]).lookup(lookup["ids"]).num_tokens}
    except Exception as exc:  # noqa: BLE001 - told to the test, which fails on it
        return {"error": repr(exc)}


if __name__ == "__main__":
    main()
