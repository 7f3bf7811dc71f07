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
process's id, so a harness that died without cleaning up is swept by the next one. The
namespace plumbing under it (the probe, the driver's namespace, the sweep) is ``host_net``.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import shlex
import shutil
import signal
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cmx.bench.harness.host_net import (
    PREFIX,
    UNSHARE,
    WORKDIR_PREFIX,
    HostsError,
    driver_network,
    free_subnet,
    in_machines_network,
    kill,
    netns_pids,
    own_network,
    run,
    sweep,
    tail,
    unavailable,
)
from cmx.operate.local_ray import ray_executable
from cmx.operate.ray_cluster import needs_token

__all__ = ["HostNode", "Hosts", "HostsError", "driver_network", "hosts_or_local",
           "own_network", "unavailable"]

log = logging.getLogger(__name__)

JOIN_TIMEOUT_S = 180.0  # a host's raylet registers with the head within this, on a busy machine
STOP_TIMEOUT_S = 30.0
SHM_BYTES = 4 << 30  # a host's /dev/shm: tmpfs, so only what is used takes memory
OBJECT_STORE_BYTES = 150 << 20  # as ray.cluster_utils.Cluster gives each node
# Health checks a host's raylet may miss in a row before the head counts it dead: a live one
# whose cable was down for two timed-out loads, on a busy two-core machine, missed Ray's 5. A
# killed host is still found dead within about a minute.
HEALTH_CHECK_FAILURES = 20


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
        if in_machines_network():
            raise HostsError("the hosts harness runs in a network namespace of its own "
                             "(own_network): its devices would otherwise be every process's")
        sweep()
        self.tag = f"{PREFIX}{os.getpid():06x}"
        self.private_dirs = tuple(str(Path(d)) for d in private_dirs)
        self.env = dict(env or {})
        self.workdir = Path(tempfile.mkdtemp(prefix=f"{WORKDIR_PREFIX}{os.getpid():06x}-"))
        self.bridge = f"{self.tag}br"
        self.cable = f"{self.tag}r"  # this machine's veth into the bridge
        self.subnet = free_subnet()
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
        for pid in netns_pids(node.netns):
            kill(pid)
        if node.process is not None:
            try:
                node.process.wait(timeout=STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                log.warning("host %s: ray start outlived SIGKILL", node.name)

    def link(self, node: HostNode, up: bool) -> None:
        """Take the host's cable down (nothing crosses) or bring it back up."""
        run(["ip", "link", "set", node.veth, "up" if up else "down"])

    # plumbing
    def _make_bridge(self) -> None:
        """The bridge, and this machine's own cable into it: a veth, as every host has (UCX
        offers no bridge device to its peers, so the address is on the cable's end here)."""
        run(["ip", "link", "add", self.bridge, "type", "bridge"])
        run(["ip", "link", "set", self.bridge, "up"])
        run(["ip", "link", "add", self.cable, "type", "veth", "peer", "name", f"{self.cable}p"])
        run(["ip", "link", "set", f"{self.cable}p", "master", self.bridge, "up"])
        run(["ip", "addr", "add", f"{self.ip(1)}/24", "dev", self.cable])
        run(["ip", "link", "set", self.cable, "up"])

    def _plug(self, host: HostNode) -> None:
        run(["ip", "netns", "add", host.netns])
        run(["ip", "link", "add", host.veth, "type", "veth", "peer", "name", "eth0",
              "netns", host.netns])
        run(["ip", "link", "set", host.veth, "master", self.bridge, "up"])
        run(["ip", "-n", host.netns, "addr", "add", f"{host.address}/24", "dev", "eth0"])
        run(["ip", "-n", host.netns, "link", "set", "eth0", "up"])
        run(["ip", "-n", host.netns, "link", "set", "lo", "up"])

    def _unplug(self, host: HostNode) -> None:
        run(["ip", "link", "del", host.veth], check=False)
        run(["ip", "netns", "del", host.netns], check=False)

    def _unmake(self) -> None:
        for host in list(self.hosts):
            self.kill_host(host)
            self._unplug(host)
        self.hosts.clear()
        run(["ip", "link", "del", self.cable], check=False)
        run(["ip", "link", "del", self.bridge], check=False)
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
                                 f"({host.process.returncode}): {tail(host.log_path)}")
            for node_id, info in gcs.get_all_node_info(timeout=10).items():
                if info.node_manager_address == host.address and info.state == 0:
                    host.node_id = node_id.hex()
                    return
            time.sleep(0.5)
        raise HostsError(f"host {host.name} did not join in {timeout_s:.0f} s: "
                         f"{tail(host.log_path)}")


def hosts_or_local(head_node_args: dict[str, Any] | None = None,
                   private_dirs: tuple[str, ...] = ("/var/tmp/cmx",)) -> tuple[Any, str | None]:
    """(a cluster, None) on hosts where namespaces can be made, else (ray.cluster_utils'
    one-machine Cluster, why not)."""
    reason = unavailable() or ("this process is in the machine's own network namespace"
                               if in_machines_network() else None)
    if reason is None:
        return Hosts(head_node_args, private_dirs), None
    from ray.cluster_utils import Cluster

    log.warning("hosts harness unavailable (%s): every node runs on this one machine", reason)
    return Cluster(initialize_head=True, head_node_args=head_node_args or {}), reason
