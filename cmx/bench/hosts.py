"""Ray nodes on hosts that share nothing but a network: one Linux network, mount and UTS
namespace per node, joined by veth pairs to a bridge.

A "host" here has its own address on the bridge, its own loopback, its own hostname, a private
``/dev/shm`` (so Ray's object store and the service's arenas are its own) and its own copy of
every directory named in ``private_dirs`` (the NVMe roots). Between hosts there is only TCP
over the bridge: UCX, Ray's object transfers and the service's calls cross it as they would
cross a network. The driver and the head run in the namespace the harness is started in, which
must be one of its own (``own_network``, or ``driver_network`` for a test): the bridge and its
cables are made there, never in this machine's own namespace, where every other process's UCX
would take them for its own devices. Every node added after the head is a host of its own.

The interface is ``ray.cluster_utils.Cluster``'s (``address``, ``add_node``, ``remove_node``,
``wait_for_nodes``, ``shutdown``), so a suite written for one runs on the other; faults a
network has and one machine does not are ``kill_host`` (every process of a host, at once) and
``link`` (the host's cable pulled, then put back).

Needs root, ``ip``, ``unshare`` and ``CMX_HOSTS=1`` (``make test`` sets it for the suites marked
``hosts``, run apart); ``unavailable()`` says why not where one is missing, and
``hosts_or_local`` then gives ``ray.cluster_utils``' one-machine cluster. Names carry this
process's id, so a harness that died without cleaning up is swept by the next one.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import random
import re
import shlex
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cmx.errors import CmxError
from cmx.operate.local_ray import is_running, ray_executable
from cmx.operate.ray_cluster import needs_token

__all__ = ["HostNode", "Hosts", "HostsError", "driver_network", "hosts_or_local",
           "own_network", "unavailable"]

log = logging.getLogger(__name__)

PREFIX = "cmx"  # every netns, bridge and veth this harness makes starts with it, then its pid
WORKDIR_PREFIX = "cmx-hosts-"  # its directory in the temp dir: this, then its pid
JOIN_TIMEOUT_S = 180.0  # a host's raylet registers with the head within this, on a busy machine
STOP_TIMEOUT_S = 30.0
SHM_BYTES = 4 << 30  # a host's /dev/shm: tmpfs, so only what is used takes memory
OBJECT_STORE_BYTES = 150 << 20  # as ray.cluster_utils.Cluster gives each node
# Health checks a host's raylet may miss in a row before the head counts it dead: a live one
# whose cable was down for two timed-out loads, on a busy two-core machine, missed Ray's 5. A
# killed host is still found dead within about a minute.
HEALTH_CHECK_FAILURES = 20
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
    made = _run(["ip", "netns", "add", probe], check=False)
    if made.returncode != 0:
        return f"`ip netns add` failed: {made.stderr.strip()}"
    try:
        tried = _run(["ip", "netns", "exec", probe, *UNSHARE, "true"], check=False)
        if tried.returncode != 0:
            return f"`{shlex.join(UNSHARE)}` failed: {tried.stderr.strip()}"
    finally:
        _run(["ip", "netns", "del", probe], check=False)
    return None


@dataclass
class HostNode:
    """One host: its name, address, network namespace and the Ray node running there."""

    name: str
    index: int
    address: str  # its IP on the bridge
    netns: str
    veth: str  # this machine's end of its cable
    root: Path  # its private directories live under here
    process: subprocess.Popen[bytes] | None = None
    node_id: str = ""
    labels: dict[str, str] = field(default_factory=dict)

    @property
    def log_path(self) -> Path:
        return self.root / "ray-start.log"


class Hosts:
    """A Ray cluster whose nodes after the head each run on a host of their own."""

    def __init__(self, head_node_args: dict[str, Any] | None = None,
                 private_dirs: tuple[str, ...] = ("/var/tmp/cmx",),
                 env: dict[str, str] | None = None) -> None:
        from ray.cluster_utils import Cluster

        reason = unavailable()
        if reason is not None:
            raise HostsError(f"hosts cannot be made here: {reason}")
        if _in_machines_network():
            raise HostsError("the hosts harness runs in a network namespace of its own "
                             "(own_network): its devices would otherwise be every process's")
        sweep()
        self.tag = f"{PREFIX}{os.getpid():06x}"
        self.private_dirs = tuple(str(Path(d)) for d in private_dirs)
        self.env = dict(env or {})
        self.workdir = Path(tempfile.mkdtemp(prefix=f"{WORKDIR_PREFIX}{os.getpid():06x}-"))
        self.bridge = f"{self.tag}br"
        self.cable = f"{self.tag}r"  # this machine's veth into the bridge
        self.subnet = _free_subnet()
        self.hosts: list[HostNode] = []
        self._next = 1
        args = {**(head_node_args or {}), "node_ip_address": self.ip(1)}
        args["_system_config"] = {"health_check_failure_threshold": HEALTH_CHECK_FAILURES,
                                  **args.get("_system_config", {})}
        try:
            self._make_bridge()
            self._head = Cluster(initialize_head=True, head_node_args=args)
        except BaseException:
            self._unmake()
            raise
        self.head_node = self._head.head_node
        atexit.register(self._at_exit)
        self._token = needs_token(self.address)

    # ray.cluster_utils.Cluster's interface
    @property
    def address(self) -> str:
        return str(self._head.address)

    def ip(self, index: int) -> str:
        return f"{self.subnet}.{index}"

    def add_node(self, wait: bool = True, num_cpus: int = 1,
                 resources: dict[str, float] | None = None,
                 labels: dict[str, str] | None = None, name: str | None = None) -> HostNode:
        """Start a host and a Ray node on it that joins the head. With ``wait``, return once
        the head lists the node alive (HostsError after JOIN_TIMEOUT_S, with its log)."""
        self._next += 1
        index = self._next
        host = HostNode(name=name or f"host{index}", index=index, address=self.ip(index),
                        netns=f"{self.tag}h{index}", veth=f"{self.tag}v{index}",
                        root=self.workdir / f"host{index}", labels=dict(labels or {}))
        host.root.mkdir(parents=True)
        self.hosts.append(host)  # before its plumbing: a step that fails is still undone
        self._plug(host)
        host.process = self._start_ray(host, num_cpus, resources or {}, labels or {})
        if wait:
            self._await_join(host)
        return host

    def wait_for_nodes(self, timeout_s: float = JOIN_TIMEOUT_S) -> None:
        for host in self.hosts:
            if not host.node_id and host.process is not None:
                self._await_join(host, timeout_s)

    def remove_node(self, node: Any, allow_graceful: bool = True) -> None:
        """Stop a host's Ray node (SIGTERM to ``ray start``, which stops its processes), then
        kill what is left in its namespace and unplug it. The head is stopped as Ray's
        Cluster stops it."""
        if not isinstance(node, HostNode):
            self._head.remove_node(node, allow_graceful=allow_graceful)
            return
        if allow_graceful and node.process is not None and node.process.poll() is None:
            node.process.send_signal(signal.SIGTERM)
            try:
                node.process.wait(timeout=STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                pass
        self.kill_host(node)
        self._unplug(node)
        self.hosts.remove(node)

    def shutdown(self) -> None:
        for host in list(self.hosts):
            self.remove_node(host, allow_graceful=False)
        try:
            self._head.shutdown()
        finally:
            self._unmake()

    def _at_exit(self) -> None:
        """A process that ends without ``shutdown`` (a failed script) leaves nothing behind."""
        if self.hosts or self.workdir.exists():
            self._unmake()

    # what a network has and one machine does not
    def kill_host(self, node: HostNode) -> None:
        """SIGKILL every process of the host at once, as a host that loses power."""
        for pid in _netns_pids(node.netns):
            _kill(pid)
        if node.process is not None:
            try:
                node.process.wait(timeout=STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                log.warning("host %s: ray start outlived SIGKILL", node.name)

    def link(self, node: HostNode, up: bool) -> None:
        """Take the host's cable down (nothing crosses) or bring it back up."""
        _run(["ip", "link", "set", node.veth, "up" if up else "down"])

    # plumbing
    def _make_bridge(self) -> None:
        """The bridge, and this machine's own cable into it: a veth, as every host has (UCX
        offers no bridge device to its peers, so the address is on the cable's end here)."""
        _run(["ip", "link", "add", self.bridge, "type", "bridge"])
        _run(["ip", "link", "set", self.bridge, "up"])
        _run(["ip", "link", "add", self.cable, "type", "veth", "peer", "name", f"{self.cable}p"])
        _run(["ip", "link", "set", f"{self.cable}p", "master", self.bridge, "up"])
        _run(["ip", "addr", "add", f"{self.ip(1)}/24", "dev", self.cable])
        _run(["ip", "link", "set", self.cable, "up"])

    def _plug(self, host: HostNode) -> None:
        _run(["ip", "netns", "add", host.netns])
        _run(["ip", "link", "add", host.veth, "type", "veth", "peer", "name", "eth0",
              "netns", host.netns])
        _run(["ip", "link", "set", host.veth, "master", self.bridge, "up"])
        _run(["ip", "-n", host.netns, "addr", "add", f"{host.address}/24", "dev", "eth0"])
        _run(["ip", "-n", host.netns, "link", "set", "eth0", "up"])
        _run(["ip", "-n", host.netns, "link", "set", "lo", "up"])

    def _unplug(self, host: HostNode) -> None:
        _run(["ip", "link", "del", host.veth], check=False)
        _run(["ip", "netns", "del", host.netns], check=False)

    def _unmake(self) -> None:
        for host in list(self.hosts):
            self.kill_host(host)
            self._unplug(host)
        self.hosts.clear()
        _run(["ip", "link", "del", self.cable], check=False)
        _run(["ip", "link", "del", self.bridge], check=False)
        shutil.rmtree(self.workdir, ignore_errors=True)

    def _start_ray(self, host: HostNode, num_cpus: int, resources: dict[str, float],
                   labels: dict[str, str]) -> subprocess.Popen[bytes]:
        # Its own names: no resolver is reachable from a host, and a lookup of its hostname
        # would otherwise wait out the machine's resolver's timeouts.
        (host.root / "hosts").write_text(f"127.0.0.1 localhost\n{host.address} {host.name}\n")
        (host.root / "resolv.conf").write_text("")
        mounts = [f"mount -t tmpfs -o size={SHM_BYTES} cmx-shm /dev/shm",
                  f"mount --bind {shlex.quote(str(host.root / 'hosts'))} /etc/hosts",
                  f"mount --bind {shlex.quote(str(host.root / 'resolv.conf'))} /etc/resolv.conf"]
        for i, path in enumerate(self.private_dirs):
            own = host.root / f"dir{i}"
            own.mkdir()
            mounts.append(f"mkdir -p {shlex.quote(path)}")
            mounts.append(f"mount --bind {shlex.quote(str(own))} {shlex.quote(path)}")
        start = [ray_executable(), "start", "--block", "--address", self.address,
                 "--node-ip-address", host.address, "--num-cpus", str(num_cpus),
                 "--object-store-memory", str(OBJECT_STORE_BYTES), "--disable-usage-stats",
                 "--resources", json.dumps(resources)]
        if labels:
            start += ["--labels", ",".join(f"{k}={v}" for k, v in labels.items())]
        script = " && ".join([*mounts, f"hostname {shlex.quote(host.name)}",
                              "exec " + shlex.join(start)])
        env = {**os.environ, **self.env}
        env.pop("RAY_ADDRESS", None)
        env.setdefault("RAY_raylet_start_wait_time_s", str(int(JOIN_TIMEOUT_S)))
        if self._token:
            env["RAY_AUTH_MODE"] = "token"
        with open(host.log_path, "wb") as out:
            return subprocess.Popen(
                ["ip", "netns", "exec", host.netns, *UNSHARE, "sh", "-c", script],
                stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)

    def _await_join(self, host: HostNode, timeout_s: float = JOIN_TIMEOUT_S) -> None:
        from ray._raylet import GcsClient  # type: ignore[attr-defined]  # no stubs

        gcs = GcsClient(address=self.address)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if host.process is not None and host.process.poll() is not None:
                raise HostsError(f"host {host.name}: ray start exited "
                                 f"({host.process.returncode}): {_tail(host.log_path)}")
            for node_id, info in gcs.get_all_node_info(timeout=10).items():
                if info.node_manager_address == host.address and info.state == 0:
                    host.node_id = node_id.hex()
                    return
            time.sleep(0.5)
        raise HostsError(f"host {host.name} did not join in {timeout_s:.0f} s: "
                         f"{_tail(host.log_path)}")


def hosts_or_local(head_node_args: dict[str, Any] | None = None,
                   private_dirs: tuple[str, ...] = ("/var/tmp/cmx",)) -> tuple[Any, str | None]:
    """(a cluster, None) on hosts where namespaces can be made, else (ray.cluster_utils'
    one-machine Cluster, why not)."""
    reason = unavailable() or ("this process is in the machine's own network namespace"
                               if _in_machines_network() else None)
    if reason is None:
        return Hosts(head_node_args, private_dirs), None
    from ray.cluster_utils import Cluster

    log.warning("hosts harness unavailable (%s): every node runs on this one machine", reason)
    return Cluster(initialize_head=True, head_node_args=head_node_args or {}), reason


@contextmanager
def own_network() -> Iterator[list[str]]:
    """A network namespace for the driver's host, with only its loopback: yields the command
    prefix that runs a process there (``[*prefix, python, ...]``). The harness's bridge and
    cables are then made inside it, never in this machine's own namespace, where every
    process's UCX would count them as its own devices (and fail once they are gone)."""
    sweep()
    name = f"{PREFIX}{os.getpid():06x}h1-{random.randrange(1 << 16):04x}"
    _run(["ip", "netns", "add", name])
    try:
        _run(["ip", "-n", name, "link", "set", "lo", "up"])
        yield ["ip", "netns", "exec", name]
    finally:
        for pid in _netns_pids(name):
            _kill(pid)
        _run(["ip", "netns", "del", name], check=False)


@contextmanager
def driver_network() -> Iterator[list[str]]:
    """``own_network()`` where hosts can be made; elsewhere no prefix (then ``hosts_or_local``
    runs every node on this one machine)."""
    if unavailable() is not None:
        yield []
        return
    with own_network() as prefix:
        yield prefix


def _in_machines_network() -> bool:
    """Whether this process runs in no named network namespace (the machine's own)."""
    done = _run(["ip", "netns", "identify", str(os.getpid())], check=False)
    return not done.stdout.strip()


def sweep() -> None:
    """Remove what a harness of a process no longer alive left behind."""
    names = set(_run(["ip", "netns", "list"], check=False).stdout.split())
    links = re.findall(r"^\d+: ([^:@]+)", _run(["ip", "-o", "link"], check=False).stdout,
                       flags=re.M)
    for name in names | set(links):
        found = re.fullmatch(rf"{PREFIX}([0-9a-f]{{6}})(?:h|v|br|r|probe).*", name)
        if found is None or is_running(int(found.group(1), 16)):
            continue
        if name in names:
            for pid in _netns_pids(name):
                _kill(pid)
            _run(["ip", "netns", "del", name], check=False)
        else:
            _run(["ip", "link", "del", name], check=False)
    for workdir in Path(tempfile.gettempdir()).glob(f"{WORKDIR_PREFIX}*"):
        found = re.fullmatch(rf"{WORKDIR_PREFIX}([0-9a-f]{{6}})-.*", workdir.name)
        if found is not None and not is_running(int(found.group(1), 16)):
            shutil.rmtree(workdir, ignore_errors=True)


def _free_subnet() -> str:
    """A 10.x.y /24 no interface of this machine is on."""
    used = _run(["ip", "-4", "-o", "addr"], check=False).stdout
    rng = random.Random(os.getpid())
    for _ in range(200):
        subnet = f"10.{rng.randrange(200, 255)}.{rng.randrange(0, 256)}"
        if f" {subnet}." not in used:
            return subnet
    raise HostsError("no free 10.x.y.0/24 subnet for the bridge")


def _netns_pids(netns: str) -> list[int]:
    done = _run(["ip", "netns", "pids", netns], check=False)
    return [int(p) for p in done.stdout.split()]


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _run(cmd: list[str], check: bool = True,
         timeout_s: float = 300.0) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
    if check and done.returncode != 0:
        raise HostsError(f"{shlex.join(cmd)}: {done.stderr.strip()}")
    return done


def _tail(path: Path, nbytes: int = 1500) -> str:
    try:
        return path.read_bytes()[-nbytes:].decode(errors="replace")
    except OSError:
        return "(no log)"

