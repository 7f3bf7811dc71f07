"""A node's host CPU: cores shared by every thread of work on the node, as the kernel shares them.

Work arrives as one thread's CPU-seconds (an engine's host work for a prefill, the copy out and
checksums of a load, the per-I/O work of a transfer) and runs at once, with every other piece
of work on the node: ``k`` pieces at work on ``count`` cores each run at ``min(1, count / k)``
of a core (processor sharing). A piece never runs faster than one core: a thread is serial.
So a node whose cores are busy moving bytes slows its engines' host work, and the GPUs wait.

The cores hand out one completion event at a time, through the engine's ``schedule``; an
arrival or a departure changes every rate, so the event it replaces is recognised as stale by
its version and ignored.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

__all__ = ["Cores"]

Schedule = Callable[[float, Callable[[Any], None], Any], None]
_EPS_S = 1e-12  # work left below this is done: what float rounding leaves of a finished piece


class Cores:
    __slots__ = ("name", "count", "busy_s", "_work", "_done", "_t", "_version", "_schedule")

    def __init__(self, name: str, count: int) -> None:
        if count < 1:
            raise ValueError(f"{name}: cores must be >= 1, got {count}")
        self.name = name
        self.count = count
        self.busy_s = 0.0  # core-seconds given: utilization = busy_s / (count * duration)
        self._work: dict[int, float] = {}  # piece -> its seconds of one core still to run
        self._done: dict[int, Callable[[float], None]] = {}
        self._t = 0.0  # when ``_work`` was last brought up to date
        self._version = 0  # of the one completion event that is not stale
        self._schedule: Schedule | None = None

    def bind(self, schedule: Schedule) -> None:
        """The engine's ``at(t, handler, arg)``: how the cores ask to be woken."""
        self._schedule = schedule

    @property
    def running(self) -> int:
        return len(self._work)

    def add(self, now: float, seconds: float, done: Callable[[float], None]) -> None:
        """Run ``seconds`` of one thread's work from ``now``; ``done(t)`` when it ends."""
        if seconds <= 0:
            done(now)
            return
        if self._schedule is None:
            raise RuntimeError(f"{self.name}: not bound to an engine")
        self._advance(now)
        piece = self._version  # unique: every add moves the version on
        self._work[piece] = seconds
        self._done[piece] = done
        self._wake(now)

    def _rate(self) -> float:
        return min(1.0, self.count / len(self._work)) if self._work else 0.0

    def _advance(self, now: float) -> None:
        dt = now - self._t
        if dt > 0 and self._work:
            ran = dt * self._rate()
            for piece in self._work:
                self._work[piece] -= ran
            self.busy_s += ran * len(self._work)
        self._t = max(self._t, now)

    def _wake(self, now: float) -> None:
        self._version += 1
        if self._work:
            assert self._schedule is not None
            first = min(self._work.values())
            at = now + max(0.0, first) / self._rate()
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
        self._wake(now)
        for done in callbacks:
            done(now)
