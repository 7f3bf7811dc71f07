"""Bounce buffers: memory of the agent's own, registered with NIXL once, that bytes between
the agent and its host pass through (``dpu.nixl_access.NixlAccess``)."""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np

from cmx.actors.transport.base import TransferError

__all__ = ["BouncePool"]


class BouncePool:
    """Bounce buffers in the agent's own memory, registered with NIXL once: a move holds one
    for its duration (``take``); ``every`` holds them all, so that no move runs meanwhile."""

    def __init__(self, nixl: Any, size: int, count: int, timeout_s: float) -> None:
        from cmx.buffers import aligned_empty

        if size <= 0 or count <= 0:
            raise ValueError(f"{count} bounce buffers of {size} bytes")
        self.size = size
        self.count = count
        self._timeout_s = timeout_s
        self._memory = aligned_empty(size * count)
        self._memory[:] = 0  # faulted in once, not on the first transfers
        nixl.register_memory([(self._memory.ctypes.data, size * count, 0, "")], "DRAM")
        self._free: queue.SimpleQueue[int] = queue.SimpleQueue()
        for i in range(count):
            self._free.put(i)
        self._lock = threading.Lock()
        self._in_use = 0
        self.peak = 0  # the most buffers in use at once

    @contextmanager
    def take(self) -> Iterator[np.ndarray]:
        i = self._get()
        with self._lock:
            self._in_use += 1
            self.peak = max(self.peak, self._in_use)
        try:
            yield self._memory[i * self.size:(i + 1) * self.size]
        finally:
            with self._lock:
                self._in_use -= 1
            self._free.put(i)

    @contextmanager
    def every(self) -> Iterator[None]:
        held: list[int] = []
        try:
            for _ in range(self.count):
                held.append(self._get())
            yield
        finally:
            for i in held:
                self._free.put(i)

    def _get(self) -> int:
        try:
            return self._free.get(timeout=self._timeout_s)
        except queue.Empty:
            raise TransferError(
                f"no bounce buffer came free within {self._timeout_s:g} s") from None
