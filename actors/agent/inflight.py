"""Which blocks this agent is filling into HBM now, so that a load that finds a block's slot
taken by another fill (a prefetch ahead of it, or another request's load) waits for that fill
and pins its result instead of coming back short.

Protocol: a load ``start``s the keys it was granted HBM slots for, and ``end``s them once its
fill is over, committed or not, before it waits for anyone else's (so no two loads wait for
each other). A load whose keys HBM neither held nor granted asks ``waits`` for the fills of
those keys and waits for them, bounded, then pins what they committed.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

from cmx.keys import BlockHash

__all__ = ["InFlight"]


class InFlight:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._fills: dict[BlockHash, tuple[threading.Event, int]] = {}  # key -> (over, count)

    def start(self, keys: Sequence[BlockHash]) -> None:
        with self._lock:
            for key in keys:
                event, count = self._fills.get(key, (threading.Event(), 0))
                self._fills[key] = (event, count + 1)

    def end(self, keys: Sequence[BlockHash]) -> None:
        with self._lock:
            for key in keys:
                held = self._fills.get(key)
                if held is None:
                    continue
                event, count = held
                if count > 1:
                    self._fills[key] = (event, count - 1)
                else:
                    del self._fills[key]
                    event.set()

    def waits(self, keys: Sequence[BlockHash]) -> list[threading.Event]:
        """The fills under way of those of ``keys`` that are being filled now."""
        with self._lock:
            return [self._fills[k][0] for k in keys if k in self._fills]

    def __len__(self) -> int:
        with self._lock:
            return len(self._fills)
