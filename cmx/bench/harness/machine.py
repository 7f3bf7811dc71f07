"""A description of the machine a benchmark ran on: CPU, cores, memory, disk, kernel."""

from __future__ import annotations

import os
import platform
import subprocess
from pathlib import Path

__all__ = ["code_version", "machine_info", "machine_line"]


def _read(path: str) -> str:
    try:
        return Path(path).read_text().strip()
    except OSError:
        return ""


def _cpu_model() -> str:
    for line in _read("/proc/cpuinfo").splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def _mem_gib() -> float:
    for line in _read("/proc/meminfo").splitlines():
        if line.startswith("MemTotal:"):
            return int(line.split()[1]) / (1 << 20)
    return 0.0


def _mount_of(path: Path) -> tuple[str, str, str]:
    """(device, mount point, filesystem type) of the mount holding ``path``."""
    target = str(path.resolve())
    best = ("?", "/", "?")
    for line in _read("/proc/mounts").splitlines():
        parts = line.split()
        if len(parts) < 3:
            continue
        dev, mnt, fstype = parts[0], parts[1], parts[2]
        inside = target == mnt or target.startswith(mnt.rstrip("/") + "/")
        if inside and len(mnt) >= len(best[1]):
            best = (dev, mnt, fstype)
    return best


def _disk(dev: str) -> str:
    """Model and kind of the block device behind ``dev`` (e.g. "virtio 1af4, SSD")."""
    name = Path(dev).name
    sys_dir = Path("/sys/class/block") / name
    if (sys_dir / "partition").exists():
        sys_dir = sys_dir.resolve().parent
    base = f"/sys/block/{sys_dir.name}"
    model = _read(f"{base}/device/model")
    vendor = _read(f"{base}/device/vendor")
    if not model and sys_dir.name.startswith("vd"):
        model = f"virtio disk, vendor {vendor}" if vendor else "virtio disk"
    # The flag as the kernel reports it; virtual disks often claim rotational=1.
    rotational = _read(f"{base}/queue/rotational") or "?"
    return f"{sys_dir.name} ({model or vendor or 'model unknown'}, rotational={rotational})"


def machine_info(bench_dir: Path) -> dict[str, object]:
    dev, mnt, fstype = _mount_of(bench_dir)
    return {
        "cpu": _cpu_model(),
        "cores": os.cpu_count() or 0,
        "memory_gib": round(_mem_gib(), 1),
        "disk": _disk(dev) if dev.startswith("/dev/") else dev,
        "filesystem": f"{fstype} on {dev} mounted at {mnt}",
        "kernel": platform.release(),
        "python": platform.python_version(),
    }


PACKAGES = ("cmx", "actors", "policies", "api", "deploy")  # the project's code, at its root


def code_version(root: Path | None = None) -> str:
    """The commit of the code that runs, as ``git`` names it (short), and whether its files
    differ from it (a tracked file changed, or a file git does not track among the packages);
    "not a git checkout" where the code is not the top of a repository that tracks it (an
    installed wheel, even one in a virtual environment inside a checkout). ``root``: the
    project's root, by default the one this file is in. Git's environment (``GIT_DIR`` and
    the like) is not passed on: it would name another repository."""
    root = (root or Path(__file__).resolve().parents[3]).resolve()
    env = {k: v for k, v in os.environ.items() if not k.startswith("GIT_")}

    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True,
                              timeout=10, check=True, env=env).stdout.strip()

    try:
        if Path(git("rev-parse", "--show-toplevel")).resolve() != root:
            return "not a git checkout"
        commit = git("rev-parse", "--short=7", "HEAD")
        packages = [d for d in PACKAGES if (root / d).is_dir()]
        changed = git("status", "--porcelain", "--untracked-files=no") or (
            packages and git("status", "--porcelain", "--untracked-files=all", "--", *packages))
    except (OSError, subprocess.SubprocessError):
        return "not a git checkout"
    return f"{commit} with uncommitted changes" if changed else commit


def machine_line(info: dict[str, object]) -> str:
    return (
        f"{info['cpu']}, {info['cores']} cores, {info['memory_gib']} GiB memory; "
        f"disk {info['disk']}, {info['filesystem']}; Linux {info['kernel']}"
    )
