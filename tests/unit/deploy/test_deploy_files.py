"""The deployment files: Ray's own schemas accept them and they name what the code expects.
The images they name, and where they ask for GPUs: ``test_deploy_images``."""

from __future__ import annotations

import re
from importlib import resources
from pathlib import Path
from typing import Any

import pytest
import yaml

from cmx.config import ServiceConfig
from cmx.deploy.app import build_app
from cmx.deploy.config import ServeOptions

DEPLOY = resources.files("cmx.deploy")
ROOT = Path(__file__).resolve().parents[3]
# Fixed by the process that starts the service for every node's actors, so the same everywhere.
SERVICE_WIDE = ("dpu_access", "nvme_dir", "pool_bytes")
RAYSERVICES = ("kuberay/rayservice.yaml", "kuberay/rayservice-gpu.yaml")  # CPU hosts, GPU hosts
DOCKERFILES = ("Dockerfile", "Dockerfile.gpu")  # the CPU image (and its arm64 build), the GPU one
GPU = "nvidia.com/gpu"


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


def _embedded_args(name: str) -> dict[str, Any]:
    serve_config = yaml.safe_load(load(name)["spec"]["serveConfigV2"])
    return dict(serve_config["applications"][0]["args"])


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


@pytest.mark.parametrize("name", RAYSERVICES)
def test_gcs_fault_tolerance_points_at_the_external_redis(name: str) -> None:
    cluster = load(name)["spec"]["rayClusterConfig"]
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


@pytest.mark.parametrize("name", RAYSERVICES)
def test_worker_groups_carry_the_labels_the_agent_placement_uses(name: str) -> None:
    config = ServiceConfig()
    groups = {g["groupName"]: g for g in
              load(name)["spec"]["rayClusterConfig"]["workerGroupSpecs"]}
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


def _pod_specs(name: str) -> dict[str, dict[str, Any]]:
    """A RayService's pod specs by group ("head" for the head)."""
    cluster = load(name)["spec"]["rayClusterConfig"]
    groups = {"head": cluster["headGroupSpec"],
              **{g["groupName"]: g for g in cluster["workerGroupSpecs"]}}
    return {name: g["template"]["spec"] for name, g in groups.items()}


def _env(container: dict[str, Any]) -> dict[str, str]:
    return {e["name"]: str(e["value"]) for e in container.get("env", []) if "value" in e}


def _mount_of(container: dict[str, Any], path: str) -> dict[str, Any] | None:
    """The volume mount ``path`` lies on, if any (the deepest)."""
    on = [m for m in container.get("volumeMounts", [])
          if path == m["mountPath"] or path.startswith(m["mountPath"].rstrip("/") + "/")]
    return max(on, key=lambda m: len(m["mountPath"]), default=None)


@pytest.mark.parametrize("name", RAYSERVICES)
def test_every_container_starts_the_same_service_with_dpus_on_the_network(name: str) -> None:
    specs = _pod_specs(name)
    seen = {f"{group}/{c['name']}": tuple(getattr(ServiceConfig.from_env(_env(c)), f)
                                          for f in SERVICE_WIDE)
            for group, spec in specs.items() for c in spec["containers"]}
    assert len(set(seen.values())) == 1, f"{SERVICE_WIDE} differ: {seen}"
    for c in specs["dpus"]["containers"]:  # a BlueField maps no host memory
        assert _env(c).get("CMX_DPU_ACCESS") == "nixl", f"dpus/{c['name']}: not NIXL access"


@pytest.mark.parametrize("name", RAYSERVICES)
def test_every_node_with_tiers_can_write_its_nvme_dir(name: str) -> None:
    dpu_label = ServiceConfig().dpu_label
    groups = load(name)["spec"]["rayClusterConfig"]["workerGroupSpecs"]
    dpus = {g["groupName"] for g in groups if dpu_label in g["rayStartParams"].get("labels", "")}
    for group, spec in _pod_specs(name).items():
        if group in dpus:  # a DPU holds no tier
            continue
        volumes = {v["name"]: v for v in spec.get("volumes", [])}
        for c in spec["containers"]:
            nvme_dir = ServiceConfig.from_env(_env(c)).nvme_dir
            mount = _mount_of(c, nvme_dir)
            assert mount is not None, f"{group}: {nvme_dir} is on no volume"
            if "hostPath" not in volumes[mount["name"]]:
                continue
            # A host path is root's; the stores refuse a directory the image's user does not own.
            chowns = [i for i in spec.get("initContainers", [])
                      if _mount_of(i, nvme_dir) == mount
                      and f"chown 1000:100 {nvme_dir}" in " ".join(i["command"])]
            assert chowns, f"{group}: nothing hands {nvme_dir} on a host path to uid 1000"


@pytest.mark.parametrize("name", RAYSERVICES)
def test_a_pool_group_labels_its_nodes_and_keeps_their_disk(name: str) -> None:
    config = ServiceConfig()
    groups = load(name)["spec"]["rayClusterConfig"]["workerGroupSpecs"]
    pools = [g for g in groups
             if config.pool_label in _labels(g["rayStartParams"], {"NODE_NAME": "store-3"})]
    assert pools, f"no worker group labels its nodes {config.pool_label}"
    for group in pools:
        assert _labels(group["rayStartParams"], {"NODE_NAME": "store-3"}) == \
            {config.pool_label: "store-3"}  # the value names the node's disk
        assert group["rayStartParams"]["num-cpus"] == "0"  # no replica lands on a pool node
        spec = group["template"]["spec"]
        volumes = {v["name"]: v for v in spec["volumes"]}
        for c in spec["containers"]:
            mount = _mount_of(c, ServiceConfig.from_env(_env(c)).nvme_dir)
            assert mount is not None, f"{group['groupName']}: no volume holds the pool's store"
            volume = volumes[mount["name"]]
            assert "hostPath" in volume or "persistentVolumeClaim" in volume, \
                f"{group['groupName']}: the pool's store on {volume} dies with the pod"
