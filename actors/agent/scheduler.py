"""The offload agent's work queues: prioritized, bounded, with a fixed staging budget.

Loads a request waits on run before prefetches, which run before demotions and write-backs.
Each class has a bounded queue: ``submit`` blocks while its class is full and raises
BusyError after ``timeout_s`` (backpressure reaches the caller instead of memory growing).
Staging memory is a byte budget: work that needs a temporary buffer takes ``staging(n)`` and
waits, bounded, until that many bytes are free.
"""

from __future__ import annotations

import heapq
import itertools
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from contextlib import contextmanager
from typing import Any

from cmx.errors import CmxError
from cmx.protocol import Priority
from cmx.stats import QueueStats

__all__ = ["BusyError", "Priority", "Scheduler"]


class BusyError(CmxError):
    """The agent's queue for this class of work stayed full past the caller's bound."""


class Scheduler:
    def __init__(
        self, workers: int = 4, queue_bound: int = 256, staging_bytes: int = 256 << 20
    ) -> None:
        self.queue_bound = queue_bound
        self.staging_bytes = staging_bytes
        self._heap: list[tuple[int, int, Future[Any], Callable[[], Any]]] = []
        self._counter = itertools.count()
        self._queued = dict.fromkeys(Priority, 0)
        self._done = dict.fromkeys(Priority, 0)
        self._cv = threading.Condition()
        self._staged = 0
        self._staging_cv = threading.Condition()
        self._closed = False
        self._threads = [
            threading.Thread(target=self._work, name=f"cmx-agent-{i}", daemon=True)
            for i in range(workers)
        ]
        for t in self._threads:
            t.start()

    def submit(self, priority: Priority, fn: Callable[[], Any], timeout_s: float = 30.0) -> Future:
        deadline = time.monotonic() + timeout_s
        fut: Future[Any] = Future()
        with self._cv:
            while self._queued[priority] >= self.queue_bound:
                left = deadline - time.monotonic()
                if left <= 0 or self._closed:
                    raise BusyError(f"{priority.name} queue full ({self.queue_bound} waiting)")
                self._cv.wait(left)
            self._queued[priority] += 1
            heapq.heappush(self._heap, (int(priority), next(self._counter), fut, fn))
            self._cv.notify_all()
        return fut

    @contextmanager
    def staging(self, nbytes: int, timeout_s: float = 30.0) -> Iterator[None]:
        """Hold ``nbytes`` of the staging budget for the duration of the block."""
        nbytes = min(nbytes, self.staging_bytes)
        deadline = time.monotonic() + timeout_s
        with self._staging_cv:
            while self._staged + nbytes > self.staging_bytes:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise BusyError(f"staging budget of {self.staging_bytes} bytes in use")
                self._staging_cv.wait(left)
            self._staged += nbytes
        try:
            yield
        finally:
            with self._staging_cv:
                self._staged -= nbytes
                self._staging_cv.notify_all()

    def depths(self) -> dict[str, int]:
        with self._cv:
            return {p.name.lower(): self._queued[p] for p in Priority}

    def stats(self) -> QueueStats:
        with self._cv:
            return QueueStats(
                queued={p.name.lower(): self._queued[p] for p in Priority},
                done={p.name.lower(): self._done[p] for p in Priority},
                staging_bytes_in_use=self._staged, staging_bytes=self.staging_bytes,
            )

    def close(self) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify_all()

    def _work(self) -> None:
        while True:
            with self._cv:
                while not self._heap and not self._closed:
                    self._cv.wait()
                if self._closed and not self._heap:
                    return
                priority, _, fut, fn = heapq.heappop(self._heap)
                self._queued[Priority(priority)] -= 1
                self._cv.notify_all()
            if not fut.set_running_or_notify_cancel():
                continue
            try:
                fut.set_result(fn())
            except BaseException as exc:  # noqa: BLE001 - handed to the waiter
                fut.set_exception(exc)
            with self._cv:
                self._done[Priority(priority)] += 1
