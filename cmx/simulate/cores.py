"""A node's host CPU: cores shared by every thread of work on the node, as the kernel shares them.

Work arrives as one thread's CPU-seconds (an engine's host work for a prefill, the copy out and
checksums of a load, the per-I/O work of a transfer) and runs at once, with every other piece
of work on the node. A piece never runs faster than one core: a thread is serial.

Pieces belong to a *process*: a serving process is one Python interpreter, whose threads take
turns on its interpreter lock, so however many of its pieces are at work they run on at most
``threads`` cores between them (``limit``); pieces of no named process (the offload agent's
lanes) run on as many cores as they are. The node's ``count`` cores are then shared by every
process's demand: ``k`` pieces of a process limited to ``c`` threads ask for ``min(k, c)``
cores, and when the node's processes ask for ``D`` cores in all, each gets ``min(1, count / D)``
of what it asks, split evenly among its pieces (processor sharing, capped per process).
So a serving process busy initiating I/O slows its own engine's host work, whatever cores the
node has left; and a node whose cores are all busy slows every process on it.

The cores hand out one completion event at a time, through the engine's ``schedule``; an
arrival or a departure changes every rate, so the event it replaces is recognised as stale by
its version and ignored.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Any

__all__ = ["Cores"]

Schedule = Callable[[float, Callable[[Any], None], Any], None]
_EPS_S = 1e-12  # work left below this is done: what float rounding leaves of a finished piece


class Cores:
    __slots__ = ("name", "count", "busy_s", "process_busy_s", "_work", "_owner", "_done",
                 "_members", "_threads", "_t", "_version", "_schedule")

    def __init__(self, name: str, count: int) -> None:
        if count < 1:
            raise ValueError(f"{name}: cores must be >= 1, got {count}")
        self.name = name
        self.count = count
        self.busy_s = 0.0  # core-seconds given: utilization = busy_s / (count * duration)
        self.process_busy_s: dict[Hashable, float] = {}  # the same, per named process
        self._work: dict[int, float] = {}  # piece -> its seconds of one core still to run
        self._owner: dict[int, Hashable | None] = {}  # piece -> its process (None: the agent's)
        self._done: dict[int, Callable[[float], None]] = {}
        self._members: dict[Hashable | None, int] = {}  # process -> its pieces at work
        self._threads: dict[Hashable, int] = {}  # process -> the cores it can run on at once
        self._t = 0.0  # when ``_work`` was last brought up to date
        self._version = 0  # of the one completion event that is not stale
        self._schedule: Schedule | None = None

    def bind(self, schedule: Schedule) -> None:
        """The engine's ``at(t, handler, arg)``: how the cores ask to be woken."""
        self._schedule = schedule

    def limit(self, process: Hashable, threads: int) -> None:
        """Pieces of ``process`` run on at most ``threads`` cores at once (its interpreter
        lock: 1)."""
        if threads < 1:
            raise ValueError(f"{self.name}: a process runs on >= 1 threads, got {threads}")
        self._threads[process] = threads
        self.process_busy_s.setdefault(process, 0.0)

    def threads(self, process: Hashable) -> int:
        return self._threads[process]

    @property
    def running(self) -> int:
        return len(self._work)

    def add(self, now: float, seconds: float, done: Callable[[float], None],
            process: Hashable | None = None) -> None:
        """Run ``seconds`` of one thread's work of ``process`` (None: no process's lock) from
        ``now``; ``done(t)`` when it ends. KeyError for a process never ``limit``-ed."""
        if process is not None and process not in self._threads:
            raise KeyError(f"{self.name}: process {process!r} has no limit")
        if seconds <= 0:
            done(now)
            return
        if self._schedule is None:
            raise RuntimeError(f"{self.name}: not bound to an engine")
        self._advance(now)
        piece = self._version  # unique: every add moves the version on
        self._work[piece] = seconds
        self._owner[piece] = process
        self._done[piece] = done
        self._members[process] = self._members.get(process, 0) + 1
        self._wake(now)

    def _rates(self) -> dict[Hashable | None, float]:
        """Each process's rate per piece: its share of a core."""
        asks = {p: min(k, self._threads[p]) if p is not None else k
                for p, k in self._members.items() if k}
        total = sum(asks.values())
        scale = min(1.0, self.count / total) if total else 0.0
        return {p: scale * ask / self._members[p] for p, ask in asks.items()}

    def _advance(self, now: float) -> None:
        dt = now - self._t
        if dt > 0 and self._work:
            rates = self._rates()
            owner = self._owner
            for piece in self._work:
                self._work[piece] -= dt * rates[owner[piece]]
            for process, rate in rates.items():
                ran = dt * rate * self._members[process]
                self.busy_s += ran
                if process is not None:
                    self.process_busy_s[process] += ran
        self._t = max(self._t, now)

    def _wake(self, now: float) -> None:
        self._version += 1
        if self._work:
            assert self._schedule is not None
            rates, owner = self._rates(), self._owner
            first = min(max(0.0, left) / rates[owner[p]] for p, left in self._work.items())
            at = now + first
            self._schedule(at, self._tick, (self._version, at))

    def _tick(self, arg: tuple[int, float]) -> None:
        version, now = arg
        if version != self._version:
            return  # an arrival or a departure since changed every rate
        self._advance(now)
        first = min(self._work, key=self._work.__getitem__)
        ended = [p for p, left in self._work.items() if left <= _EPS_S or p == first]
        callbacks = [self._done.pop(p) for p in ended]
        for p in ended:
            del self._work[p]
            process = self._owner.pop(p)
            self._members[process] -= 1
            if not self._members[process]:
                del self._members[process]
        self._wake(now)
        for done in callbacks:
            done(now)
