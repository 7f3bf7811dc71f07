"""CPU-seconds taken by groups of processes while something runs, read from ``/proc``.

A group is the process trees under some root pids (a server and the workers it forked); every
other descendant of this process (a local Ray cluster and its actors, say) is the group
``rest``, this process included. A thread samples every process's user and system time each
``interval_s``: a process that exits between two samples loses at most that much. The
machine's own busy time (``/proc/stat``) is measured beside, so what no group accounts for
(other work on the machine) shows as the difference.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

__all__ = ["CpuMeter", "CpuUse", "machine_busy_s", "process_table"]

_TICK = os.sysconf("SC_CLK_TCK")
REST = "rest"


@dataclass(frozen=True)
class _Proc:
    ppid: int
    start: int  # ticks after boot: with the pid, names a process even if the pid is reused
    cpu_s: float  # user and system time of the process itself


def process_table(proc: Path = Path("/proc")) -> dict[int, _Proc]:
    """Every live process: parent, start and CPU-seconds so far."""
    table = {}
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            text = (entry / "stat").read_text()
        except OSError:
            continue  # exited while being read
        # The command name may hold spaces and parentheses: fields start after the last ')'.
        fields = text[text.rindex(")") + 2:].split()
        table[int(entry.name)] = _Proc(ppid=int(fields[1]), start=int(fields[19]),
                                       cpu_s=(int(fields[11]) + int(fields[12])) / _TICK)
    return table


def machine_busy_s(proc: Path = Path("/proc")) -> tuple[float, float]:
    """(busy, total) CPU-seconds of every core since boot. Idle, iowait and steal (time the
    hypervisor gave another guest) are not busy; guest time is already counted in user."""
    fields = [int(f) for f in (proc / "stat").read_text().splitlines()[0].split()[1:]]
    fields += [0] * (8 - len(fields))
    total = sum(fields[:8])
    return (total - fields[3] - fields[4] - fields[7]) / _TICK, total / _TICK


@dataclass(frozen=True)
class CpuUse:
    """What a meter measured: CPU-seconds per group over ``wall_s`` of wall time."""

    wall_s: float
    groups: dict[str, float]
    machine_busy_s: float
    cores: int

    @property
    def machine_share(self) -> float:
        """The machine's busy fraction of every core over the interval."""
        return self.machine_busy_s / (self.wall_s * self.cores) if self.wall_s else 0.0

    def __add__(self, other: CpuUse) -> CpuUse:
        names = dict.fromkeys([*self.groups, *other.groups])
        return CpuUse(self.wall_s + other.wall_s,
                      {n: self.groups.get(n, 0.0) + other.groups.get(n, 0.0) for n in names},
                      self.machine_busy_s + other.machine_busy_s, self.cores)


class CpuMeter:
    """Samples the CPU time of named process trees while it is open::

        with CpuMeter({"servers": [pid1, pid2]}) as meter:
            meter.add("clients", client.pid)
            ...
        meter.use.groups["servers"]
    """

    def __init__(self, roots: dict[str, Iterable[int]] | None = None,
                 interval_s: float = 0.5) -> None:
        self._roots: dict[str, set[int]] = {n: set(p) for n, p in (roots or {}).items()}
        self._interval_s = interval_s
        self._lock = threading.Lock()
        self._first: dict[tuple[int, int], float] = {}  # CPU-s when first seen
        self._last: dict[tuple[int, int], tuple[str, float]] = {}  # group, CPU-s last seen
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="cpu-meter", daemon=True)
        self._t0 = self._busy0 = 0.0
        self.use: CpuUse | None = None

    def add(self, group: str, pid: int) -> None:
        """Counts the tree under ``pid`` in ``group`` from now on."""
        with self._lock:
            self._roots.setdefault(group, set()).add(pid)

    def __enter__(self) -> CpuMeter:
        import time

        self._sample(first=True)
        self._t0 = time.monotonic()
        self._busy0 = machine_busy_s()[0]
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        import time

        self._stop.set()
        self._thread.join()
        self._sample()
        wall = time.monotonic() - self._t0
        busy = machine_busy_s()[0] - self._busy0
        groups = dict.fromkeys([*self._roots, REST], 0.0)
        for key, (group, cpu) in self._last.items():
            groups[group] += cpu - self._first.get(key, 0.0)
        self.use = CpuUse(wall, groups, busy, os.cpu_count() or 1)

    def _loop(self) -> None:
        while not self._stop.wait(self._interval_s):
            self._sample()

    def _sample(self, first: bool = False) -> None:
        table = process_table()
        children: dict[int, list[int]] = {}
        for pid, row in table.items():
            children.setdefault(row.ppid, []).append(pid)
        with self._lock:
            roots = {n: set(p) for n, p in self._roots.items()}
        group_of = {pid: REST for pid in _tree([os.getpid()], children)}
        for name, pids in roots.items():
            group_of.update(dict.fromkeys(_tree(pids, children), name))
        if first:  # every process, so that one added to a group later counts from now
            self._first.update({(pid, p.start): p.cpu_s for pid, p in table.items()})
        for pid, group in group_of.items():
            p = table.get(pid)
            if p is not None:
                self._last[(pid, p.start)] = (group, p.cpu_s)


def _tree(roots: Iterable[int], children: dict[int, list[int]]) -> set[int]:
    seen: set[int] = set()
    todo = list(roots)
    while todo:
        pid = todo.pop()
        if pid not in seen:
            seen.add(pid)
            todo.extend(children.get(pid, ()))
    return seen
