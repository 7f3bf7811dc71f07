"""What the soak does to the application and how it watches it: kills at seeded random intervals
(a tier actor, the agent, a directory shard, a Serve replica of the LLM deployment, in a
shuffled order each round), and the memory of the Ray cluster's processes.

A service actor is killed as the integration soak does (``ray.kill`` of the named actor, Ray
restarts it); a replica is killed for good (``no_restart=True``) and Serve's controller starts
another in its place.
"""

from __future__ import annotations

import os
import random
import threading
from collections.abc import Callable
from pathlib import Path

from cmx.bench.suites.soak.soak_figures import KillRecord, Snapshot

__all__ = ["KINDS", "Killer", "ProcessMemory", "left_behind"]

KINDS = ("tier", "agent", "directory shard", "replica")
SHM = Path("/dev/shm")
REPLICA_PREFIX = "SERVE_REPLICA::"


def _victims(kind: str, app: str) -> list[tuple[str, str]]:
    """(name, namespace) of each live actor of ``kind``."""
    import ray

    from cmx.links import RAY_NAMESPACE

    named = ray.util.list_named_actors(all_namespaces=True)
    if kind == "replica":
        return [(a["name"], a["namespace"]) for a in named
                if a["name"].startswith(f"{REPLICA_PREFIX}{app}#LLMServer#")]
    prefixes = {"tier": ("cmx:hbm:", "cmx:dram:", "cmx:nvme:"), "agent": ("cmx:agent:",),
                "directory shard": ("cmx:dir:",)}[kind]
    return [(a["name"], a["namespace"]) for a in named
            if a["namespace"] == RAY_NAMESPACE and a["name"].startswith(prefixes)]


def kill_one(kind: str, app: str, rng: random.Random) -> tuple[str, bool]:
    """Kill one actor of ``kind`` (chosen by ``rng``); (its name, whether it was killed)."""
    import ray

    found = sorted(_victims(kind, app))
    if not found:
        return "(none alive)", False
    name, namespace = rng.choice(found)
    try:
        ray.kill(ray.get_actor(name, namespace=namespace), no_restart=kind == "replica")
    except ValueError:  # between lives: gone since it was listed
        return name, False
    return name, True


class Killer:
    """A thread that kills one actor every ``mean_gap_s`` (0.5-1.5x, seeded) until ``stop``; a
    replica only while every replica is up, so that one always serves.

    Needs this process joined to the application's Ray cluster.
    """

    def __init__(self, app: str, mean_gap_s: float, seed: int, clock: Callable[[], float],
                 replicas_up: Callable[[], int], replicas: int,
                 log: Callable[[str], None]) -> None:
        self.app = app
        self.replicas_up = replicas_up  # replicas the application routes to now
        self.replicas = replicas  # of the deployment: a replica is killed only when all are up
        self.mean_gap_s = mean_gap_s
        self.rng = random.Random(seed)
        self.clock = clock
        self.log = log
        self.kills: list[KillRecord] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="soak-killer", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        order: list[str] = []
        while not self._stop.wait(self.rng.uniform(0.5, 1.5) * self.mean_gap_s):
            if not order:
                order = list(KINDS)
                self.rng.shuffle(order)
            kind = order.pop()
            try:
                up = self.replicas_up() if kind == "replica" else self.replicas
                if up < self.replicas:  # the last one left: a test of patience, not of faults
                    name, killed = f"(left alone: {up} of {self.replicas} replicas up)", False
                else:
                    name, killed = kill_one(kind, self.app, self.rng)
            except Exception as exc:  # noqa: BLE001 - a failed kill is a record, not the end
                name, killed = f"({type(exc).__name__}: {exc})", False
            self.kills.append(KillRecord(self.clock(), kind, name, killed))
            self.log(f"kill at {self.clock():.0f} s: {kind} {name} "
                     f"{'killed' if killed else 'not killed'}")


def _rss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) << 10
    return 0


def _shm_mapped(pid: int) -> set[str]:
    try:
        text = Path(f"/proc/{pid}/maps").read_text()
    except OSError:
        return set()
    return {line.split(maxsplit=5)[5].removesuffix(" (deleted)") for line in text.splitlines()
            if " /dev/shm/" in line}


ENGINE_SEGMENTS = ("psm_", "sem.mp-")  # vLLM's engines' shared memory and semaphores


def left_behind(name: str, node: str, before: set[str], mapped: set[str]) -> bool:
    """Whether the /dev/shm file ``name`` is one the application left: made since ``before``
    was listed, mapped by no process now, and named as one of ``node``'s arenas or an engine's
    segment (another cluster's arenas on this machine carry their own node's id)."""
    ours = name.startswith(ENGINE_SEGMENTS) or (name.startswith("cmx-")
                                                and f"-{node[:12]}-" in name)
    return ours and name not in before and f"{SHM}/{name}" not in mapped


class ProcessMemory:
    """The memory of every process under the Ray head ``root`` (the head's ``ray start``: its
    GCS, raylet and workers, the replicas' engines), and of every process once seen there that
    still lives (one a kill left behind, re-parented), and the application's /dev/shm: the files
    its processes map or have mapped (while they exist), and those ``left_behind``."""

    def __init__(self, root: int, node: str) -> None:
        self.root = root
        self.node = node  # the Ray node the application runs on: its arenas carry its id
        self.seen: set[tuple[int, int]] = set()  # (pid, start time): a reused pid is another
        self.shm_before = {p.name for p in SHM.iterdir()} if SHM.is_dir() else set()
        self.shm_ours: set[str] = set()  # every file a process of ours has mapped

    def _ours(self) -> list[int]:
        from cmx.bench.harness.proc_cpu import process_table

        table = process_table()
        children: dict[int, list[int]] = {}
        for pid, p in table.items():
            children.setdefault(p.ppid, []).append(pid)
        tree, todo = set(), [self.root]
        while todo:
            pid = todo.pop()
            if pid in table and pid not in tree:
                tree.add(pid)
                todo += children.get(pid, [])
        self.seen |= {(pid, table[pid].start) for pid in tree}
        return [pid for pid, p in table.items() if (pid, p.start) in self.seen]

    def snapshot(self, at_s: float) -> Snapshot:
        ours = self._ours()
        rss = 0
        for pid in ours:
            try:
                rss += _rss(pid)
            except OSError:
                pass  # exited since it was listed
        mapped_by_us: set[str] = set()
        mapped_by_any: set[str] = set()
        for entry in Path("/proc").iterdir():
            if entry.name.isdigit():
                paths = _shm_mapped(int(entry.name))
                mapped_by_any |= paths
                if int(entry.name) in ours:
                    mapped_by_us |= paths
        self.shm_ours |= mapped_by_us
        shm = 0
        for path in SHM.iterdir() if SHM.is_dir() else ():
            left = left_behind(path.name, self.node, self.shm_before, mapped_by_any)
            if str(path) in self.shm_ours or left:  # mapped by us once, and not unlinked since
                try:
                    shm += path.stat().st_blocks * 512
                except OSError:
                    pass
        st = os.statvfs(SHM) if SHM.is_dir() else None
        used = 0 if st is None else (st.f_blocks - st.f_bfree) * st.f_frsize
        return Snapshot(at_s, rss, len(ours), shm, used)
