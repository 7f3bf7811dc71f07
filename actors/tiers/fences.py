"""Fences: memory slots held out of use after a reservation ended without its holder.

A reservation that expired, or whose owner was given up, may still have a writer copying
into its slot: shared memory cannot take the mapping away from it. So the slot is not given
back at once: it is fenced for one more lease period, and a late copy lands where no other
block lies. A writer later still is caught by the checksum it took of its source bytes.
"""

from __future__ import annotations

import threading

from cmx.actors.tiers.leases import Clock
from cmx.storage.blocks import Reservation
from cmx.storage.dram import DramStore

__all__ = ["SlotFences"]


class SlotFences:
    def __init__(self, store: DramStore, ttl_s: float, clock: Clock) -> None:
        self._store = store
        self._ttl_s = ttl_s
        self._clock = clock
        self._until: dict[int, float] = {}  # fenced slot -> when it may be granted again
        self._lock = threading.Lock()

    def fence(self, res: Reservation) -> None:
        """End ``res`` in the store, its slot held out of use for a lease period."""
        slot = self._store.fence(res)
        with self._lock:
            self._until[slot] = self._clock() + self._ttl_s

    def lift(self) -> int:
        """Give back the slots whose fence ran out; how many."""
        now = self._clock()
        with self._lock:
            due = [slot for slot, until in self._until.items() if until <= now]
            for slot in due:
                del self._until[slot]
        for slot in due:
            self._store.unfence(slot)
        return len(due)

    def __len__(self) -> int:
        with self._lock:
            return len(self._until)

    def check_integrity(self) -> None:
        fenced = self._store.stats().fenced
        if len(self) != fenced:
            raise AssertionError(f"{len(self)} fences, {fenced} fenced slots in the store")
