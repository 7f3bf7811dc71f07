"""The offload agent of one simulated node: prioritized, bounded queues in front of its lanes.

As in the service: loads a request waits on go first, then prefetches, then background work
(stores, demotions, pool writes). Each class holds at most ``bound`` queued jobs: a prefetch
or a demotion that finds its class full is dropped (counted), a load is never dropped. A
prefetch whose request is scheduled while it still waits is promoted to a load.
"""

from __future__ import annotations

import enum
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

__all__ = ["Agent", "Job", "Priority"]


class Priority(enum.IntEnum):
    LOAD = 0
    PREFETCH = 1
    BACKGROUND = 2


@dataclass(eq=False)
class Job:
    """Work for one lane. ``run(now)`` reserves the links and returns the end time;
    ``done(now)`` is called at that time."""

    priority: Priority
    run: Callable[[float], float]
    done: Callable[[float], None]
    started: bool = False
    finished: bool = False
    waiters: list[Callable[[float], None]] = field(default_factory=list)


class Agent:
    def __init__(self, lanes: int, bound: int) -> None:
        self.lanes = lanes
        self.bound = bound
        self.queues: tuple[deque[Job], ...] = tuple(deque() for _ in Priority)
        self.running = 0
        self.queued = 0  # live queued jobs (a promoted prefetch counts once)
        self.max_queued = 0
        self.dropped = {p: 0 for p in Priority}
        self.area = 0.0  # integral of queued over time, for the time-weighted mean
        self._last = 0.0

    def advance(self, now: float) -> None:
        self.area += self.queued * (now - self._last)
        self._last = now

    def submit(self, job: Job, now: float) -> bool:
        """Queue ``job``; False if its class is full (never for a load)."""
        q = self.queues[job.priority]
        if job.priority is not Priority.LOAD and len(q) >= self.bound:
            self.dropped[job.priority] += 1
            return False
        self.advance(now)
        q.append(job)
        self.queued += 1
        self.max_queued = max(self.max_queued, self.queued)
        return True

    def promote(self, job: Job) -> None:
        """A queued prefetch becomes a load; its old queue entry is skipped when reached."""
        if not job.started and job.priority is not Priority.LOAD:
            job.priority = Priority.LOAD
            self.queues[Priority.LOAD].append(job)

    def next_job(self, now: float) -> Job | None:
        """The next job to start on a free lane, or None."""
        if self.running >= self.lanes:
            return None
        for p, q in enumerate(self.queues):
            while q:
                job = q.popleft()
                if job.started or job.priority != p:
                    continue  # a promoted prefetch's old entry
                self.advance(now)
                self.queued -= 1
                job.started = True
                self.running += 1
                return job
        return None

    def finish(self) -> None:
        self.running -= 1

    def check_integrity(self) -> None:
        live = {id(j) for q in self.queues for j in q if not j.started}
        if len(live) != self.queued:
            raise AssertionError(f"agent counts {self.queued} queued, queues hold {len(live)}")
        if not 0 <= self.running <= self.lanes:
            raise AssertionError(f"{self.running} running on {self.lanes} lanes")
