"""The namespace plumbing of the hosts harness (``cmx.bench.harness.hosts``): whether hosts can
be made here, a network namespace of its own for the driver's host, the sweep of what a dead
harness left behind, and the shell calls under them. Every name it makes starts with ``PREFIX``
and its owner's pid."""

from __future__ import annotations

import os
import random
import re
import shlex
import shutil
import signal
import subprocess
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from cmx.errors import CmxError
from cmx.operate.local_ray import is_running

__all__ = ["PREFIX", "UNSHARE", "WORKDIR_PREFIX", "HostsError", "driver_network",
           "free_subnet", "in_machines_network", "kill", "netns_pids", "own_network", "run",
           "sweep", "tail", "unavailable"]

PREFIX = "cmx"  # every netns, bridge and veth this harness makes starts with it, then its pid
WORKDIR_PREFIX = "cmx-hosts-"  # its directory in the temp dir: this, then its pid
# A host's own mounts, hostname and System V IPC: UCX counts two processes as on one node (and
# moves bytes by shared memory or CMA) unless their IPC namespaces differ; with them apart, its
# endpoints between hosts are TCP only ("inter-node" in UCX_LOG_LEVEL=info).
UNSHARE = ("unshare", "--mount", "--uts", "--ipc", "--propagation", "private")


class HostsError(CmxError):
    """The hosts harness could not make or start a host (the message says what failed)."""


def unavailable() -> str | None:
    """Why hosts cannot be made on this machine, or None where they can."""
    if os.environ.get("CMX_HOSTS", "0") != "1":
        return ("CMX_HOSTS=1 is not set (`make test` sets it for the suites marked hosts, "
                "run apart: beside a busy cluster a host may miss its join bound)")
    if os.geteuid() != 0:
        return "namespaces need root"
    for tool in ("ip", "unshare"):
        if shutil.which(tool) is None:
            return f"`{tool}` is not installed"
    probe = f"{PREFIX}{os.getpid():06x}probe"
    made = run(["ip", "netns", "add", probe], check=False)
    if made.returncode != 0:
        return f"`ip netns add` failed: {made.stderr.strip()}"
    try:
        tried = run(["ip", "netns", "exec", probe, *UNSHARE, "true"], check=False)
        if tried.returncode != 0:
            return f"`{shlex.join(UNSHARE)}` failed: {tried.stderr.strip()}"
    finally:
        run(["ip", "netns", "del", probe], check=False)
    return None


@contextmanager
def own_network() -> Iterator[list[str]]:
    """A network namespace for the driver's host, with only its loopback: yields the command
    prefix that runs a process there (``[*prefix, python, ...]``). The harness's bridge and
    cables are then made inside it, never in this machine's own namespace, where every
    process's UCX would count them as its own devices (and fail once they are gone)."""
    sweep()
    name = f"{PREFIX}{os.getpid():06x}h1-{random.randrange(1 << 16):04x}"
    run(["ip", "netns", "add", name])
    try:
        run(["ip", "-n", name, "link", "set", "lo", "up"])
        yield ["ip", "netns", "exec", name]
    finally:
        for pid in netns_pids(name):
            kill(pid)
        run(["ip", "netns", "del", name], check=False)


@contextmanager
def driver_network() -> Iterator[list[str]]:
    """``own_network()`` where hosts can be made; elsewhere no prefix (then ``hosts_or_local``
    runs every node on this one machine)."""
    if unavailable() is not None:
        yield []
        return
    with own_network() as prefix:
        yield prefix


def in_machines_network() -> bool:
    """Whether this process runs in no named network namespace (the machine's own)."""
    done = run(["ip", "netns", "identify", str(os.getpid())], check=False)
    return not done.stdout.strip()


def sweep() -> None:
    """Remove what a harness of a process no longer alive left behind."""
    names = set(run(["ip", "netns", "list"], check=False).stdout.split())
    links = re.findall(r"^\d+: ([^:@]+)", run(["ip", "-o", "link"], check=False).stdout,
                       flags=re.M)
    for name in names | set(links):
        found = re.fullmatch(rf"{PREFIX}([0-9a-f]{{6}})(?:h|v|br|r|probe).*", name)
        if found is None or is_running(int(found.group(1), 16)):
            continue
        if name in names:
            for pid in netns_pids(name):
                kill(pid)
            run(["ip", "netns", "del", name], check=False)
        else:
            run(["ip", "link", "del", name], check=False)
    for workdir in Path(tempfile.gettempdir()).glob(f"{WORKDIR_PREFIX}*"):
        found = re.fullmatch(rf"{WORKDIR_PREFIX}([0-9a-f]{{6}})-.*", workdir.name)
        if found is not None and not is_running(int(found.group(1), 16)):
            shutil.rmtree(workdir, ignore_errors=True)


def free_subnet() -> str:
    """A 10.x.y /24 no interface of this machine is on."""
    used = run(["ip", "-4", "-o", "addr"], check=False).stdout
    rng = random.Random(os.getpid())
    for _ in range(200):
        subnet = f"10.{rng.randrange(200, 255)}.{rng.randrange(0, 256)}"
        if f" {subnet}." not in used:
            return subnet
    raise HostsError("no free 10.x.y.0/24 subnet for the bridge")


def netns_pids(netns: str) -> list[int]:
    done = run(["ip", "netns", "pids", netns], check=False)
    return [int(p) for p in done.stdout.split()]


def kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def run(cmd: list[str], check: bool = True,
         timeout_s: float = 300.0) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
    if check and done.returncode != 0:
        raise HostsError(f"{shlex.join(cmd)}: {done.stderr.strip()}")
    return done


def tail(path: Path, nbytes: int = 1500) -> str:
    try:
        return path.read_bytes()[-nbytes:].decode(errors="replace")
    except OSError:
        return "(no log)"

