"""The offload agent's queue discipline: one rule for the service's scheduler
(``actors/agent/scheduler.py``, threads) and the simulator's agent (``cmx/simulate/agent.py``,
simulated time).

Work comes in the classes of ``cmx.protocol.Priority``: loads a request waits on, then
prefetches, then demotions and other background writes. Protocol, in call order:

1. ``submit(priority, item, deadline)``: the item takes a place at the back of its class, or,
   its class holding ``bound`` items, waits for one (a ``Submission`` in state ``WAITING``).
   Submitters waiting on one class get its places in the order they came.
2. ``take()``: the head of the first class that holds anything, loads first; the place it frees
   goes at once to that class's first waiter, which joins the back of the class.
3. ``stage(nbytes, deadline, item)``: a running job's hold on the staging budget (at most the
   whole budget); a hold that fits is granted at once, one that does not waits. ``unstage``
   gives the bytes back and grants the waiting holds that now fit, in the order they asked.
4. ``expire(now)``: every wait, for a place or for staging bytes, whose deadline is at or before
   ``now`` is refused; ``withdraw(ticket)`` refuses one wait now (a scheduler closing).

Time is the caller's: the service passes ``time.monotonic()``, the simulator its clock. Nothing
here blocks, locks or runs work: the scheduler calls it under its condition and wakes its
threads when a ticket's state changes.
"""

from __future__ import annotations

import enum
from collections import deque
from dataclasses import dataclass
from typing import Generic, TypeVar

from cmx.protocol import Priority

__all__ = ["SUBMIT_TIMEOUT_S", "Hold", "State", "Submission", "WorkQueues"]

# How long the service's submitters and staging holds wait before they are refused
# (``Scheduler.submit`` and ``Scheduler.staging``; no caller passes another bound).
SUBMIT_TIMEOUT_S = 30.0

T = TypeVar("T")


class State(enum.Enum):
    WAITING = "waiting"  # for a place in its class, or for staging bytes
    QUEUED = "queued"  # holds a place in its class
    TAKEN = "taken"  # left its class to run
    GRANTED = "granted"  # holds its staging bytes
    RELEASED = "released"  # gave its staging bytes back
    REFUSED = "refused"  # its wait passed its deadline, or was withdrawn


@dataclass(eq=False)
class Submission(Generic[T]):
    priority: Priority
    item: T
    deadline: float  # refused if still waiting for a place then
    state: State = State.QUEUED


@dataclass(eq=False)
class Hold(Generic[T]):
    nbytes: int  # already capped at the whole budget
    deadline: float  # refused if still waiting for bytes then
    item: T | None = None
    state: State = State.GRANTED


class WorkQueues(Generic[T]):
    def __init__(self, bound: int, staging_bytes: int) -> None:
        if bound < 1 or staging_bytes < 0:
            raise ValueError(f"bound must be >= 1 and staging_bytes >= 0: {bound}, "
                             f"{staging_bytes}")
        self.bound = bound
        self.staging_bytes = staging_bytes
        self.staged = 0  # bytes of the granted holds
        self.taken = 0  # submissions that left their class to run, since the start
        self.refused = dict.fromkeys(Priority, 0)  # submissions refused, per class
        self.refused_holds = 0
        self._classes: dict[Priority, deque[Submission[T]]] = {p: deque() for p in Priority}
        self._waiting: dict[Priority, deque[Submission[T]]] = {p: deque() for p in Priority}
        self._holds: deque[Hold[T]] = deque()  # waiting for bytes, in the order they asked

    # -- places ---------------------------------------------------------------------------------

    def submit(self, priority: Priority, item: T, deadline: float) -> Submission[T]:
        sub = Submission(priority, item, deadline)
        if len(self._classes[priority]) < self.bound:
            self._classes[priority].append(sub)
        else:
            sub.state = State.WAITING
            self._waiting[priority].append(sub)
        return sub

    def take(self) -> Submission[T] | None:
        for priority, queue in self._classes.items():
            if queue:
                sub = queue.popleft()
                sub.state = State.TAKEN
                self.taken += 1
                waiting = self._waiting[priority]
                if waiting:
                    first = waiting.popleft()
                    first.state = State.QUEUED
                    queue.append(first)
                return sub
        return None

    def queued(self, priority: Priority) -> int:
        return len(self._classes[priority])

    def queued_total(self) -> int:
        """Items queued in every class together."""
        return sum(map(len, self._classes.values()))

    def waiting(self, priority: Priority) -> int:
        """Submitters waiting for a place in ``priority``'s class."""
        return len(self._waiting[priority])

    # -- staging bytes --------------------------------------------------------------------------

    def stage(self, nbytes: int, deadline: float, item: T | None = None) -> Hold[T]:
        hold = Hold(min(nbytes, self.staging_bytes), deadline, item)
        if self.staged + hold.nbytes <= self.staging_bytes:
            self.staged += hold.nbytes
        else:
            hold.state = State.WAITING
            self._holds.append(hold)
        return hold

    def unstage(self, hold: Hold[T]) -> list[Hold[T]]:
        """Give ``hold``'s bytes back; the waiting holds this grants, in the order they asked."""
        if hold.state is not State.GRANTED:
            raise ValueError(f"unstage of a hold in state {hold.state.value}")
        hold.state = State.RELEASED
        self.staged -= hold.nbytes
        granted = []
        for waiter in list(self._holds):
            if self.staged + waiter.nbytes <= self.staging_bytes:
                self._holds.remove(waiter)
                waiter.state = State.GRANTED
                self.staged += waiter.nbytes
                granted.append(waiter)
        return granted

    def holds_waiting(self) -> int:
        return len(self._holds)

    # -- refusals -------------------------------------------------------------------------------

    def expire(self, now: float) -> list[Submission[T] | Hold[T]]:
        """Refuse every wait whose deadline is at or before ``now``; those refused, submissions
        first (by class, then in the order they came), then holds."""
        out: list[Submission[T] | Hold[T]] = []
        for waiting in self._waiting.values():
            out += [s for s in waiting if s.deadline <= now]
        out += [h for h in self._holds if h.deadline <= now]
        for ticket in out:
            self.withdraw(ticket)
        return out

    def withdraw(self, ticket: Submission[T] | Hold[T]) -> bool:
        """Refuse ``ticket``'s wait now; False if it no longer waits."""
        if ticket.state is not State.WAITING:
            return False
        ticket.state = State.REFUSED
        if isinstance(ticket, Submission):
            self._waiting[ticket.priority].remove(ticket)
            self.refused[ticket.priority] += 1
        else:
            self._holds.remove(ticket)
            self.refused_holds += 1
        return True

    def check_integrity(self) -> None:
        for p in Priority:
            queued, waiting = len(self._classes[p]), len(self._waiting[p])
            if queued > self.bound:
                raise AssertionError(f"{p.name}: {queued} queued over a bound of {self.bound}")
            if waiting and queued < self.bound:
                raise AssertionError(f"{p.name}: {waiting} waiting beside {queued} queued of "
                                     f"{self.bound} places")
        if not 0 <= self.staged <= self.staging_bytes:
            raise AssertionError(f"staged {self.staged} outside 0..{self.staging_bytes}")
        if any(self.staged + h.nbytes <= self.staging_bytes for h in self._holds):
            raise AssertionError(f"a hold waits that fits beside {self.staged} staged bytes")
