"""Which blocks this agent is filling into HBM now, so that a load that finds a block's slot
taken by another fill (a prefetch ahead of it, or another request's load) waits for that fill
and pins its result instead of coming back short.

Protocol: a load ``start``s its keys before it asks HBM for them, so no load of the same keys
asks HBM while this one's slots are reserved yet unclaimed. Once HBM answers, it ``end``s
the claims of the keys it was not granted slots for (held, or taken by another fill), and on
a failed ask all of them; it ends the rest once its fill is over, committed or not, before it
waits for anyone else's (so no two loads wait for each other). A load whose keys HBM neither
held nor granted asks ``waits`` for the fills of those keys under way and waits for them,
bounded, then pins what they committed. Each claim ends on its own: a waiter waits for the
fills it found, never for one that started after it asked.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass, field

from cmx.keys import BlockHash

__all__ = ["Claim", "InFlight"]


@dataclass(frozen=True, eq=False)
class Claim:
    """One load's fill of one key; ``over`` is set when it ends."""

    key: BlockHash
    over: threading.Event = field(default_factory=threading.Event)


class InFlight:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._fills: dict[BlockHash, list[Claim]] = {}  # key -> its fills under way

    def start(self, keys: Sequence[BlockHash]) -> list[Claim]:
        """A claim on each of ``keys`` (one per key, in order), for ``end``."""
        claims = [Claim(key) for key in keys]
        with self._lock:
            for claim in claims:
                self._fills.setdefault(claim.key, []).append(claim)
        return claims

    def end(self, claims: Sequence[Claim]) -> None:
        with self._lock:
            for claim in claims:
                fills = self._fills.get(claim.key, [])
                if claim in fills:
                    fills.remove(claim)
                if not fills:
                    self._fills.pop(claim.key, None)
                claim.over.set()

    def waits(self, keys: Sequence[BlockHash]) -> list[threading.Event]:
        """The fills under way of those of ``keys`` that are being filled now."""
        with self._lock:
            return [c.over for k in keys for c in self._fills.get(k, ())]

    def __len__(self) -> int:
        with self._lock:
            return len(self._fills)
