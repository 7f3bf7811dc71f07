"""A local Ray head for ``cmx up``: ``ray start --head --block`` as a background process.

With ``--block``, that one process owns every process of the head (GCS, raylet, dashboard,
workers): a SIGTERM to it stops them all, and them only. ``ray stop`` would instead end every
Ray process on the machine, other users' clusters included, so ``cmx down`` never calls it.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

from cmx.errors import CmxError

__all__ = ["HeadError", "HeadOptions", "is_local", "is_our_head", "is_running", "port_open",
           "split_address", "start_head", "stop_head"]

READY_MARKER = "block forever"  # what `ray start --block` prints once the head is up
RAYLET_TIMEOUT = "timed out during startup"  # Ray's message when a raylet missed registering
START_ATTEMPTS = 3  # starts of a local cluster tried before its error is raised

log = logging.getLogger(__name__)


class HeadError(CmxError):
    """The local Ray head did not start (its log says why)."""


@dataclass(frozen=True)
class HeadOptions:
    port: int = 6379  # the GCS port: the cluster's address is host:port
    num_cpus: int | None = None  # None: Ray counts the machine's cores
    dashboard: bool = True  # Ray's dashboard (it shows the service's ray metrics too)
    dashboard_port: int = 8265
    client_port: int = 10001  # Ray client server
    extra_args: tuple[str, ...] = ()  # passed to `ray start` as they are

    def with_free_ports(self) -> HeadOptions:
        """The same, with a free port instead of each fixed one that is taken (another Ray
        on this machine has the defaults)."""
        return replace(self, dashboard_port=_free_if_taken(self.dashboard_port),
                       client_port=_free_if_taken(self.client_port))

    def command(self) -> list[str]:
        cmd = [ray_executable(), "start", "--head", "--block", "--port", str(self.port),
               "--disable-usage-stats", "--dashboard-host", "127.0.0.1",
               "--dashboard-port", str(self.dashboard_port),
               "--ray-client-server-port", str(self.client_port),
               f"--include-dashboard={'true' if self.dashboard else 'false'}"]
        if self.num_cpus is not None:
            cmd += ["--num-cpus", str(self.num_cpus)]
        return cmd + list(self.extra_args)


def _free_if_taken(port: int) -> int:
    if not port_open("127.0.0.1", port):
        return port
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def ray_executable() -> str:
    """The ``ray`` script of this interpreter's environment, so the head runs this install."""
    beside = Path(sys.executable).parent / "ray"
    if beside.exists():
        return str(beside)
    found = shutil.which("ray")
    if found is None:
        raise HeadError("the `ray` command is not installed beside this Python")
    return found


def split_address(address: str) -> tuple[str, int]:
    """(host, port) of host:port or ray://host:port; ValueError otherwise."""
    host, _, port = address.split("://", 1)[-1].rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"{address!r} is not host:port")
    return host.strip("[]"), int(port)


def is_local(host: str) -> bool:
    """Whether ``host`` names this machine (Ray records a local head under the address of the
    interface it reaches others by, not 127.0.0.1)."""
    if host in ("127.0.0.1", "localhost", "::1", "0.0.0.0", socket.gethostname()):
        return True
    try:
        ip = socket.gethostbyname(host)
        with socket.socket() as s:
            s.bind((ip, 0))  # only an address of one of this machine's interfaces binds
        return True
    except OSError:
        return False


def port_open(host: str, port: int, timeout_s: float = 0.5) -> bool:
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            return True
    except OSError:
        return False


def start_head(
    opts: HeadOptions, log_path: str, timeout_s: float = 180.0,
    tick: Callable[[], None] = lambda: None, attempts: int = START_ATTEMPTS,
) -> int:
    """Start the head in the background and wait until it is up; returns its pid.

    Ray gives a new raylet 30 s to register with its GCS, which a loaded machine can miss; such
    a start is tried again (with a warning), up to ``attempts`` times in all."""
    for attempt in range(1, attempts + 1):
        try:
            return _start_head_once(opts, log_path, timeout_s, tick)
        except HeadError as exc:
            if RAYLET_TIMEOUT not in str(exc) or attempt == attempts:
                raise
            log.warning("`ray start` missed the raylet's registration (attempt %d of %d); "
                        "trying again", attempt, attempts)
    raise AssertionError("unreachable")


def _start_head_once(
    opts: HeadOptions, log_path: str, timeout_s: float, tick: Callable[[], None]
) -> int:
    os.makedirs(os.path.dirname(log_path) or ".", exist_ok=True)
    env = dict(os.environ)
    env.setdefault("RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S", "0")  # `cmx down` stops at once
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(opts.command(), stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True, env=env)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise HeadError(f"`ray start` exited with {proc.returncode}:\n{_tail(log_path)}")
        if READY_MARKER in _tail(log_path, 4000):
            return proc.pid
        tick()
        time.sleep(0.25)
    if port_open("127.0.0.1", opts.port):
        return proc.pid  # up, though it did not say so as expected
    stop_head(proc.pid)
    raise HeadError(f"the Ray head did not start in {timeout_s:.0f} s:\n{_tail(log_path)}")


def is_our_head(pid: int) -> bool:
    """Whether ``pid`` is still a `ray start --block` process (pids are reused)."""
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
    return b"start" in cmdline and b"--block" in cmdline and any(b"ray" in a for a in cmdline)


def stop_head(pid: int, timeout_s: float = 60.0) -> bool:
    """SIGTERM the head (it stops its processes), SIGKILL if it lingers.

    True once no `ray start --block` runs under ``pid`` (a reused pid is left alone).
    """
    if not is_our_head(pid):
        return True
    os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not is_running(pid):
            return True
        time.sleep(0.2)
    os.kill(pid, signal.SIGKILL)
    time.sleep(0.5)
    return not is_running(pid)


def is_running(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie does not)."""
    try:
        os.waitpid(pid, os.WNOHANG)  # reap it if it is our child
    except ChildProcessError:
        pass
    try:
        state = Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


def _tail(path: str, nbytes: int = 2000) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(max(0, os.path.getsize(path) - nbytes))
            return f.read().decode(errors="replace")
    except OSError:
        return ""
