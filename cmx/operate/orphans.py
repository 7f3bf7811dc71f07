"""What stopped processes leave behind: orphaned store directories across the cluster (list
them, collect them: an admin action), and the shared memory of stopped vLLM engines on this
machine (``EngineSegments``).

Each node's NVMe tier sees the ``nvme_dir`` of its machine (cmx.operate.store_dirs); nodes that
share a machine see the same orphans, so answers are merged by machine-local path.

vLLM's processes talk through POSIX shared memory (``/dev/shm/psm_*``, 160 MiB and more per
engine), named semaphores (``sem.mp-*``) and, on its CPU build at a tensor-parallel degree
above 1, its ranks' shared buffers (``*-cpushm_*``, 8 MiB and more each). The process that
made one unlinks it if its exit gets that far, else multiprocessing's resource tracker does
once the process tree ends; but a Ray actor's child processes, the tracker among them, can be
killed with it (a replica stopped, a node torn down), and the segments then stay in RAM until
reboot. A replica records the
segments its engine's processes hold (``record``), and ``reap`` unlinks a recorded segment once
every process of its record is gone and no live process maps it or holds it open. A segment no
record names, another user's or another program's, is never touched. ``watch`` leaves a
sentinel (``cmx.sentinel``) to reap a record once the replica and the record's processes are
gone, however they went: a replica killed, or its whole cluster torn down, reaps nothing itself.
"""

from __future__ import annotations

import functools
import json
import os
import re
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from cmx.links import RAY_NAMESPACE, actor_name
from cmx.operate.store_dirs import Orphan
from cmx.sentinel import after_exit, identity

__all__ = ["CPU_SHM", "SEGMENT_PREFIXES", "EngineSegments", "ReapedSegment",
           "collect_orphans", "is_engine_segment", "list_orphans"]

SHM_DIR = "/dev/shm"
PROC_DIR = "/proc"
# Python's multiprocessing names: SharedMemory segments, and named semaphores (sem_open's file).
SEGMENT_PREFIXES = ("psm_", "sem.mp-")
# vLLM's CPU build: the shared buffers of a tensor-parallel group's ranks, named
# "<instance>-<group>-[<ranks>]-cpushm" and a suffix per rank. The instance is the engine's
# port (or rendezvous file), so an engine started on the same port names them again.
CPU_SHM = re.compile(r"-\[[0-9-]+\]-cpushm(_[0-9]+)*$")


def _tiers(timeout_s: float) -> dict[str, Any]:
    import ray

    controller = ray.get_actor("cmx:controller", namespace=RAY_NAMESPACE)
    nodes: list[str] = ray.get(controller.nodes.remote(), timeout=timeout_s)
    out = {}
    for node in nodes:
        try:
            out[node] = ray.get_actor(actor_name("nvme", node), namespace=RAY_NAMESPACE)
        except ValueError:
            continue
    return out


def _ask(method: str, *args: Any, timeout_s: float) -> dict[str, list[Orphan]]:
    import ray

    refs = {node: getattr(tier, method).remote(*args) for node, tier in _tiers(timeout_s).items()}
    answers: dict[str, list[Orphan]] = {}
    for node, ref in refs.items():
        try:
            answers[node] = list(ray.get(ref, timeout=timeout_s))
        except Exception:  # noqa: BLE001 - a tier that does not answer lists nothing
            continue
    return answers


def list_orphans(timeout_s: float = 30.0) -> dict[str, list[Orphan]]:
    """Per node (by Ray node id): the orphaned store directories its NVMe tier sees.
    Needs a connected Ray driver (cmx.operate.ray_cluster.join)."""
    return _ask("orphans", timeout_s=timeout_s)


def collect_orphans(older_than_s: float = 0.0, timeout_s: float = 120.0
                    ) -> dict[str, list[Orphan]]:
    """Remove orphaned store directories at least ``older_than_s`` old; per node, those removed."""
    return _ask("collect_orphans", older_than_s, timeout_s=timeout_s)


@dataclass(frozen=True)
class ReapedSegment:
    name: str  # under the shared-memory directory
    size: int  # bytes it held


@dataclass(frozen=True)
class _Proc:
    """A process, told apart from a later one of the same pid by its start time."""

    pid: int
    start: int  # clock ticks after boot (field 22 of /proc/<pid>/stat)


class EngineSegments:
    """Records of the shared memory engines' processes hold, one JSON file per engine under
    ``root``: ``{"processes": [[pid, start], ...], "segments": [name, ...]}``.

    ``record`` is called by the replica once its engine is up, then ``watch``; ``reap`` by the
    replica after it shut its engine down, by a replica starting (what earlier ones left), by
    ``cmx serve --stop`` and ``cmx demo`` once their engines are gone, and by the sentinel
    ``watch`` started once the replica and its engine are.
    """

    def __init__(self, root: str, shm_dir: str = SHM_DIR, proc_dir: str = PROC_DIR) -> None:
        self.root, self.shm_dir, self.proc_dir = root, shm_dir, proc_dir

    @classmethod
    def default(cls) -> EngineSegments:
        """The records beside ``cmx up``'s state (``CMX_STATE_DIR``, default ~/.cache/cmx)."""
        from cmx.config import AdminConfig

        state_dir = os.path.dirname(AdminConfig.from_env().state_path)
        return cls(os.path.join(state_dir, "engine-shm"))

    def record(self, pids: Iterable[int]) -> str | None:
        """Record the segments these processes hold now, and the processes that hold one; the
        record's path (None: none held). A process that holds none (the resource tracker, which
        lives as long as the replica) is no part of the record."""
        procs: list[_Proc] = []
        held: set[str] = set()
        for proc in (self._proc(pid) for pid in pids):
            mine = self._held_by(proc.pid) if proc is not None else set()
            if proc is not None and mine:
                procs.append(proc)
                held |= mine
        if not procs:
            return None
        os.makedirs(self.root, mode=0o700, exist_ok=True)
        path = os.path.join(self.root, f"{procs[0].pid}-{procs[0].start}.json")
        self._write(path, procs, sorted(held))
        return path

    def watch(self, path: str) -> bool:
        """Reap the record ``path`` once this process and every process of the record have
        exited, however they went (``cmx.sentinel``); whether a sentinel watches them."""
        procs, _ = self._records().get(path, ([], []))
        pids = [os.getpid(), *(p.pid for p in procs)]
        return after_exit(pids, functools.partial(self.reap, 0.0, path))

    def reap(self, wait_s: float = 0.0, wait_for: str | None = None) -> list[ReapedSegment]:
        """Unlink the recorded segments whose processes are all gone and that no live process
        maps or holds open, waiting up to ``wait_s`` for recorded processes to exit (those of
        the record ``wait_for`` only, where given); what was unlinked. A record keeps what it
        could not reap yet, for a later call."""
        records = self._records()
        awaited = [r for path, r in records.items() if wait_for in (None, path)]
        deadline = time.monotonic() + wait_s
        while any(self._alive(procs) for procs, _ in awaited) and time.monotonic() < deadline:
            time.sleep(0.2)
        settled = {path: segs for path, (procs, segs) in records.items()
                   if not self._alive(procs)}
        if not settled:
            return []
        in_use = self._held_by_anyone()
        reaped: list[ReapedSegment] = []
        for path, segments in settled.items():
            kept = []
            for name in segments:
                seg = os.path.join(self.shm_dir, name)
                if not os.path.exists(seg):
                    continue
                # A name an engine started since may have taken again: asked afresh, just before.
                if name in in_use or (CPU_SHM.search(name) and name in self._held_by_anyone()):
                    kept.append(name)
                    continue
                try:
                    size = os.stat(seg).st_size
                    os.unlink(seg)
                except OSError:
                    continue
                reaped.append(ReapedSegment(name, size))
            try:
                if kept:
                    self._write(path, [], kept)
                else:
                    _remove(path)
            except OSError:
                continue  # the record stays as it was: a later call reaps what is left
        return reaped

    # -- the records -----------------------------------------------------------------------------

    def _records(self) -> dict[str, tuple[list[_Proc], list[str]]]:
        out: dict[str, tuple[list[_Proc], list[str]]] = {}
        try:
            names = sorted(n for n in os.listdir(self.root) if n.endswith(".json"))
        except OSError:
            return out
        for name in names:
            path = os.path.join(self.root, name)
            try:
                with open(path) as f:
                    data = json.load(f)
                procs = [_Proc(int(pid), int(start)) for pid, start in data["processes"]]
                segments = [str(s) for s in data["segments"] if is_engine_segment(str(s))]
            except (OSError, ValueError, KeyError, TypeError):
                continue  # being written, or not a record: left as it is
            out[path] = (procs, segments)
        return out

    @staticmethod
    def _write(path: str, procs: list[_Proc], segments: list[str]) -> None:
        tmp = f"{path}.tmp"
        with open(tmp, "w") as f:
            json.dump({"processes": [[p.pid, p.start] for p in procs],
                       "segments": segments}, f)
        os.replace(tmp, path)

    # -- processes -------------------------------------------------------------------------------

    def _proc(self, pid: int) -> _Proc | None:
        found = identity(pid, self.proc_dir)  # None once exited, a zombie included
        return _Proc(*found) if found is not None else None

    def _alive(self, procs: list[_Proc]) -> bool:
        return any(self._proc(p.pid) == p for p in procs)

    def _held_by(self, pid: int) -> set[str]:
        """The segments under ``shm_dir`` a process maps or holds open."""
        held: set[str] = set()
        base = os.path.join(self.proc_dir, str(pid))
        prefix = os.path.join(self.shm_dir, "")
        try:
            with open(os.path.join(base, "maps")) as f:
                for line in f:
                    fields = line.split(maxsplit=5)
                    if len(fields) == 6 and fields[5].startswith(prefix):
                        held.add(fields[5].rstrip("\n").removesuffix(" (deleted)")[len(prefix):])
        except OSError:
            pass
        try:
            fds = os.listdir(os.path.join(base, "fd"))
        except OSError:
            fds = []
        for fd in fds:
            try:
                target = os.readlink(os.path.join(base, "fd", fd))
            except OSError:
                continue
            if target.startswith(prefix):
                held.add(target[len(prefix):])
        return {name for name in held if is_engine_segment(name)}

    def _held_by_anyone(self) -> set[str]:
        # Processes this user may not inspect are not seen; they cannot open a segment made
        # with Python's mode 0600 either, unless run by root.
        held: set[str] = set()
        for entry in os.listdir(self.proc_dir):
            if entry.isdigit():
                held |= self._held_by(int(entry))
        return held


def is_engine_segment(name: str) -> bool:
    """Whether a name under /dev/shm is of the kinds a vLLM engine makes."""
    return (name.startswith(SEGMENT_PREFIXES) or CPU_SHM.search(name) is not None) \
        and "/" not in name


def _remove(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
