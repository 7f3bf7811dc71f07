"""The offload agent's work queues: prioritized, bounded, with a fixed staging budget.

Loads a request waits on run before prefetches, which run before demotions and write-backs.
Each class has a bounded queue: ``submit`` blocks while its class is full and raises
BusyError after ``timeout_s`` (backpressure reaches the caller instead of memory growing).
Staging memory is a byte budget: work that needs a temporary buffer takes ``staging(n)`` and
waits, bounded, until that many bytes are free.

The discipline (which job runs next, who gets a freed place or freed bytes, which wait is
refused) is ``cmx.policies.queueing.WorkQueues``, the simulator's agent's too; this class adds
the threads, the blocking and the errors, and calls it under one condition.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from contextlib import contextmanager
from typing import Any

from cmx.errors import CmxError
from cmx.policies.queueing import SUBMIT_TIMEOUT_S, Hold, State, Submission, WorkQueues
from cmx.protocol import Priority
from cmx.stats import QueueStats

__all__ = ["BusyError", "Priority", "Scheduler"]


class BusyError(CmxError):
    """The agent's queue for this class of work stayed full past the caller's bound."""


_Work = tuple[Future[Any], Callable[[], Any]]


class Scheduler:
    def __init__(
        self, workers: int = 4, queue_bound: int = 256, staging_bytes: int = 256 << 20
    ) -> None:
        self.queue_bound = queue_bound
        self.staging_bytes = staging_bytes
        self._queues: WorkQueues[_Work] = WorkQueues(queue_bound, staging_bytes)
        self._done = dict.fromkeys(Priority, 0)
        self._cv = threading.Condition()
        self._closed = False
        self._threads = [
            threading.Thread(target=self._work, name=f"cmx-agent-{i}", daemon=True)
            for i in range(workers)
        ]
        for t in self._threads:
            t.start()

    def submit(self, priority: Priority, fn: Callable[[], Any],
               timeout_s: float = SUBMIT_TIMEOUT_S) -> Future:
        deadline = time.monotonic() + timeout_s
        fut: Future[Any] = Future()
        with self._cv:
            sub = self._queues.submit(priority, (fut, fn), deadline)
            self._wait(sub, deadline)
            if sub.state is State.REFUSED:
                raise BusyError(f"{priority.name} queue full ({self.queue_bound} waiting)")
            self._cv.notify_all()
        return fut

    @contextmanager
    def staging(self, nbytes: int, timeout_s: float = SUBMIT_TIMEOUT_S) -> Iterator[None]:
        """Hold ``nbytes`` of the staging budget for the duration of the block."""
        deadline = time.monotonic() + timeout_s
        with self._cv:
            hold: Hold[_Work] = self._queues.stage(nbytes, deadline)
            self._wait(hold, deadline)
            if hold.state is State.REFUSED:
                raise BusyError(f"staging budget of {self.staging_bytes} bytes in use")
        try:
            yield
        finally:
            with self._cv:
                self._queues.unstage(hold)
                self._cv.notify_all()

    def _wait(self, ticket: Submission[_Work] | Hold[_Work], deadline: float) -> None:
        """Under the condition: until ``ticket`` no longer waits (granted a place or bytes by
        another thread, or refused at its deadline; a submission also when closing)."""
        try:
            while ticket.state is State.WAITING:
                now = time.monotonic()
                if self._closed and isinstance(ticket, Submission):
                    self._queues.withdraw(ticket)
                elif now >= deadline:
                    self._queues.expire(now)
                    self._cv.notify_all()  # other waits may have passed their deadlines too
                else:
                    self._cv.wait(deadline - now)
        except BaseException:
            self._abandon(ticket)
            raise

    def _abandon(self, ticket: Submission[_Work] | Hold[_Work]) -> None:
        """Under the condition: take back the ticket of a wait left by an error (an interrupt),
        whose caller will neither run the job nor give the bytes back."""
        if self._queues.withdraw(ticket):
            return
        if isinstance(ticket, Submission):
            ticket.item[0].cancel()  # granted a place meanwhile: a worker skips it
        elif ticket.state is State.GRANTED:
            self._queues.unstage(ticket)
            self._cv.notify_all()

    def depths(self) -> dict[str, int]:
        with self._cv:
            return {p.name.lower(): self._queues.queued(p) for p in Priority}

    def waiting(self) -> dict[str, int]:
        """Waits now: submitters per class waiting for a place, and (``staging``) holds
        waiting for bytes."""
        with self._cv:
            out = {p.name.lower(): self._queues.waiting(p) for p in Priority}
            out["staging"] = self._queues.holds_waiting()
            return out

    def stats(self) -> QueueStats:
        with self._cv:
            return QueueStats(
                queued={p.name.lower(): self._queues.queued(p) for p in Priority},
                done={p.name.lower(): self._done[p] for p in Priority},
                staging_bytes_in_use=self._queues.staged, staging_bytes=self.staging_bytes,
            )

    def close(self) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify_all()

    def _work(self) -> None:
        while True:
            with self._cv:
                while (sub := self._queues.take()) is None and not self._closed:
                    self._cv.wait()
                if sub is None:
                    return
                self._cv.notify_all()  # the freed place went to its class's first waiter
            fut, fn = sub.item
            if not fut.set_running_or_notify_cancel():
                continue
            try:
                fut.set_result(fn())
            except BaseException as exc:  # noqa: BLE001 - handed to the waiter
                fut.set_exception(exc)
            with self._cv:
                self._done[sub.priority] += 1
