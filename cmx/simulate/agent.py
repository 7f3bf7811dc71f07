"""The offload agent of one simulated node: the service's scheduler, in simulated time.

Its queues are the service's discipline itself, ``cmx.policies.queueing.WorkQueues``, with the
service's defaults from ``ServiceConfig()``: ``agent_workers`` lanes, ``agent_queue_bound`` jobs
per class, a ``staging_bytes`` budget, and the submit timeout of ``Scheduler.submit``. Loads a
request waits on go first, then prefetches, then demotions and other background writes
(stores, NVMe and pool writes); first come, first served within a class
(``tests/unit/simulate/test_agent_trace.py`` drives this agent and the service's scheduler with
one trace and finds the same starts and refusals).

- A full class: the job waits for a place, as the service's ``submit`` blocks; a job still
  waiting ``timeout_s`` simulated seconds after it was submitted is refused (its ``refused``
  hooks run, and the agent counts it), as a ``BusyError`` ends the service's wait. No caller
  of the service's scheduler catches ``BusyError`` to drop work instead: every one waits.
  Where several jobs wait on one class, places go in submission order (the service's threads
  queue in ``WorkQueues`` the same way).
- Staging: a job taken off its queue holds a lane, then asks for its ``staging_bytes``; one
  that does not fit waits for them on its lane, as the service's worker does inside
  ``Scheduler.staging``, and is refused ``timeout_s`` later. The simulated movements ask for
  none (``staging_bytes`` 0): the service's moves copy straight into granted slots and take no
  staging bytes (its one ``staging`` call, a peer transfer's, holds 0).
- No promotion: a prefetch stays a prefetch when its request is scheduled, as in the service,
  where the request's load is a separate call at load priority: made when the prefetch
  policy's deadline passes with the prefetch still queued, which it overtakes
  (``engine.Simulator._late``; the overtaken job is ``cancelled`` and moves nothing).

The engine drives it: ``submit``, then ``next_job`` until None (start each job returned),
``finish`` when a job's time is up, and an ``expire`` at every time ``alarms`` hands out.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field

from cmx.config import ServiceConfig
from cmx.policies.queueing import SUBMIT_TIMEOUT_S, Hold, State, WorkQueues
from cmx.protocol import Priority
from cmx.simulate.cores import Cores

__all__ = ["Agent", "Job", "Priority"]

_SERVICE = ServiceConfig()


@dataclass(eq=False)
class Job:
    """Work for one lane. ``run(now)`` reserves the links and returns when they are done;
    beside them, from the same moment, ``cpu_s`` seconds of one thread's work run on the
    ``cpu`` cores as ``process``'s (None: the agent's own threads): the orchestrator's work
    per I/O, which a real submission overlaps with the transfer. The lane is held until both
    are done (``moved_s``: when the links were); then, the lane free for the next job,
    ``consumer_cpu_s`` runs as ``consumer_process``'s (the copy out and checksums of what was
    moved, by the thread that uses it); ``run`` may set both. ``done(now)`` and then each of
    ``waiters`` is called at the end; each of ``refused`` instead, if the agent refuses the
    job."""

    priority: Priority
    run: Callable[[float], float]
    done: Callable[[float], None]
    cpu: Cores | None = None
    cpu_s: float = 0.0
    process: Hashable | None = None
    consumer_cpu_s: float = 0.0
    consumer_process: Hashable | None = None
    moved_s: float = -1.0  # when its links were done
    parts: int = 0  # of the lane's work still running: its links, its CPU work
    staging_bytes: int = 0
    started: bool = False
    finished: bool = False
    cancelled: bool = False  # its work was done another way: ``run`` moves nothing
    on_cancel: list[Callable[[float], None]] = field(default_factory=list)
    waiters: list[Callable[[float], None]] = field(default_factory=list)
    refused: list[Callable[[float], None]] = field(default_factory=list)
    hold: Hold[Job] | None = None

    def cancel(self, now: float) -> None:
        """Its work is done another way: it moves nothing when its turn comes, and what it
        holds (pins) goes now, through ``on_cancel``."""
        if self.cancelled or self.started:
            raise RuntimeError("only a job not yet started is cancelled, once")
        self.cancelled = True
        for hook in self.on_cancel:
            hook(now)


class Agent:
    def __init__(self, lanes: int = _SERVICE.agent_workers,
                 bound: int = _SERVICE.agent_queue_bound,
                 staging_bytes: int = _SERVICE.staging_bytes,
                 timeout_s: float = SUBMIT_TIMEOUT_S) -> None:
        self.lanes = lanes
        self.bound = bound
        self.timeout_s = timeout_s
        self.queues: WorkQueues[Job] = WorkQueues(bound, staging_bytes)
        self.running = 0  # lanes held: jobs moving bytes or waiting for staging bytes
        self.queued = 0  # jobs in the queues, not those waiting for a place
        self.max_queued = 0
        self.refused = dict.fromkeys(Priority, 0)  # refused a place or staging bytes in time
        self.area = 0.0  # integral of queued over time, for the time-weighted mean
        self._last = 0.0
        self._ready: deque[Job] = deque()  # on a lane, just granted their staging bytes
        self._alarms: list[float] = []  # deadlines of waits begun since ``alarms`` was called

    def advance(self, now: float) -> None:
        self.area += self.queued * (now - self._last)
        self._last = now

    def submit(self, job: Job, now: float) -> None:
        """Queue ``job``, or have it wait for a place in its class until ``timeout_s``."""
        self.advance(now)
        sub = self.queues.submit(job.priority, job, now + self.timeout_s)
        if sub.state is State.WAITING:
            self._alarms.append(sub.deadline)
        self._count()

    def next_job(self, now: float) -> Job | None:
        """The next job to start moving bytes now, or None."""
        self.advance(now)
        while not self._ready and self.running < self.lanes:
            sub = self.queues.take()
            if sub is None:
                break
            job = sub.item
            self.running += 1
            job.hold = self.queues.stage(job.staging_bytes, now + self.timeout_s, job)
            if job.hold.state is State.GRANTED:
                self._ready.append(job)
            else:
                self._alarms.append(job.hold.deadline)
        self._count()
        if not self._ready:
            return None
        job = self._ready.popleft()
        job.started = True
        return job

    def finish(self, job: Job) -> None:
        """``job``'s time is up: its lane and its staging bytes are free."""
        self.running -= 1
        hold, job.hold = job.hold, None  # no job <-> hold cycle left for the collector
        assert hold is not None, "finish of a job that never started"
        self._ready.extend(h.item for h in self.queues.unstage(hold) if h.item is not None)

    def expire(self, now: float) -> None:
        """Refuse every wait past its deadline; a job refused its staging bytes frees its lane."""
        self.advance(now)
        refused = self.queues.expire(now)
        jobs = []
        for ticket in refused:
            if isinstance(ticket, Hold):
                self.running -= 1
            assert ticket.item is not None
            jobs.append(ticket.item)
            self.refused[ticket.item.priority] += 1
        self._count()
        for job in jobs:
            for hook in job.refused:
                hook(now)

    def alarms(self) -> list[float]:
        """The deadlines of the waits begun since the last call: call ``expire`` at each."""
        out, self._alarms = self._alarms, []
        return out

    def _count(self) -> None:
        self.queued = self.queues.queued_total()
        self.max_queued = max(self.max_queued, self.queued)

    def check_integrity(self) -> None:
        self.queues.check_integrity()
        if not 0 <= self.running <= self.lanes:
            raise AssertionError(f"{self.running} running on {self.lanes} lanes")
        holding = self.running - len(self._ready)
        if holding < self.queues.holds_waiting():
            raise AssertionError(f"{self.queues.holds_waiting()} jobs wait for staging bytes, "
                                 f"{holding} lanes hold jobs")
