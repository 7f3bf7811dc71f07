"""The deployment files: Ray's own schemas accept them, and they name what the code expects."""

from __future__ import annotations

import re
from importlib import resources
from typing import Any

import yaml

from cmx.config import ServiceConfig
from cmx.deploy.app import build_app
from cmx.deploy.config import ServeOptions

DEPLOY = resources.files("cmx.deploy")


def load(name: str) -> Any:
    return yaml.safe_load((DEPLOY / name).read_text())


def check_serve_config(config: dict[str, Any]) -> list[ServeOptions]:
    from ray.serve.schema import ServeApplicationSchema, ServeDeploySchema

    schema = ServeDeploySchema.model_validate(config)
    options = []
    for app in schema.applications:
        assert isinstance(app, ServeApplicationSchema)
        assert app.import_path == "cmx.deploy.app:build_app"
        options.append(ServeOptions.from_args(app.args))  # every arg is an option
    return options


def test_the_serve_config_validates_and_its_args_are_serve_options() -> None:
    (options,) = check_serve_config(load("serve_config.yaml"))
    assert options.replicas == 2 and options.max_replicas_per_node == 1
    assert options.engine.prefetch == "wait_complete" and options.engine.connector == "cmx"
    assert options.model.path is None  # the packaged SmolLM2
    assert options.service is None  # sized to the model's blocks by the replicas themselves
    assert ServeOptions.from_args(options.to_args()) == options


def test_the_app_builder_takes_the_same_args() -> None:
    app = build_app(load("serve_config.yaml")["applications"][0]["args"])
    assert type(app).__name__ == "Application"


def test_the_rayservice_embeds_the_same_serve_config_with_a_model_directory() -> None:
    manifest = load("kuberay/rayservice.yaml")
    assert manifest["apiVersion"] == "ray.io/v1" and manifest["kind"] == "RayService"
    serve_config = yaml.safe_load(manifest["spec"]["serveConfigV2"])
    (options,) = check_serve_config(serve_config)
    assert options.model.path == "/models/llm"
    standalone = load("serve_config.yaml")["applications"][0]["args"]
    embedded = serve_config["applications"][0]["args"]
    assert {k: v for k, v in embedded.items() if k != "model"} == \
        {k: v for k, v in standalone.items() if k != "model"}


def test_gcs_fault_tolerance_points_at_the_external_redis() -> None:
    cluster = load("kuberay/rayservice.yaml")["spec"]["rayClusterConfig"]
    ft = cluster["gcsFaultToleranceOptions"]
    host, _, port = ft["redisAddress"].partition(":")
    redis = list(yaml.safe_load_all((DEPLOY / "kuberay/redis.yaml").read_text()))
    service = next(d for d in redis if d["kind"] == "Service")
    secret = next(d for d in redis if d["kind"] == "Secret")
    assert service["metadata"]["name"] == host and service["spec"]["ports"][0]["port"] == int(port)
    ref = ft["redisPassword"]["valueFrom"]["secretKeyRef"]
    assert ref["name"] == secret["metadata"]["name"] and ref["key"] in secret["stringData"]


def _labels(params: dict[str, str], env: dict[str, str]) -> dict[str, str]:
    """The labels a worker group's ray start gets, its $(VAR) and ${VAR%suffix} expanded."""
    from ray._private.label_utils import parse_node_labels_string

    text = params["labels"]
    text = re.sub(r"\$\((\w+)\)", lambda m: env[m.group(1)], text)
    text = re.sub(r"\$\{(\w+)%([^}]*)\}",
                  lambda m: env[m.group(1)].removesuffix(m.group(2)), text)
    return parse_node_labels_string(text)


def test_worker_groups_carry_the_labels_the_agent_placement_uses() -> None:
    config = ServiceConfig()
    groups = {g["groupName"]: g for g in
              load("kuberay/rayservice.yaml")["spec"]["rayClusterConfig"]["workerGroupSpecs"]}
    host = _labels(groups["hosts"]["rayStartParams"], {"NODE_NAME": "gpu-7"})
    dpu = _labels(groups["dpus"]["rayStartParams"], {"NODE_NAME": "gpu-7-dpu"})
    assert host == {config.host_label: "gpu-7"}
    assert dpu == {config.dpu_label: "bluefield", config.host_label: "gpu-7"}
    assert groups["dpus"]["rayStartParams"]["num-cpus"] == "0"  # no replica lands on a DPU
    env = {e["name"] for c in groups["hosts"]["template"]["spec"]["containers"]
           for e in c.get("env", [])}
    assert {"NODE_NAME", "CMX_NVME_DIR"} <= env


def test_the_ray_up_config_validates_and_labels_hosts_and_dpus() -> None:
    from ray.autoscaler._private.util import validate_config

    config = load("cluster.yaml")
    validate_config(config)
    service = ServiceConfig()
    head = " ".join(config["head_start_ray_commands"])
    workers = " ".join(config["worker_start_ray_commands"])
    assert f"{service.host_label}=" in head
    assert f"{service.dpu_label}=bluefield,{service.host_label}=" in workers
    assert f"{service.host_label}=$(hostname -s)" in workers
