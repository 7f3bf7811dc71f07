"""Leases: who holds each pin and reservation of a tier, and until when.

A tier hands out a lease with every pin and every reservation: an id unique across the tier's
restarts, an owner (``client:<id>``, ``agent:<name>``, ``peer:<name>``, ``pool:<node>``) and an
expiry. The holder ends it (unpin, commit, abort) by id. What its holder never ends, because
it timed out, failed part-way or died, the tier takes back when the lease expires (``expire``,
run on every call that takes a slot and on every heartbeat) or when its owner's leases are
given back at once (``release_owner``). Time is injected: tests drive a fake clock.
"""

from __future__ import annotations

import enum
import secrets
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from cmx.keys import BlockHash
from cmx.stats import LeaseStats

__all__ = ["ADMIN", "Held", "LeaseKind", "LeaseStats", "LeasedPins", "Leases"]

Clock = Callable[[], float]
ADMIN = "admin"  # the owner of pins an operator takes by hand: they expire like any other


class LeaseKind(str, enum.Enum):
    PIN = "pin"
    RESERVE = "reserve"


@dataclass(frozen=True)
class Held:
    owner: str
    kind: LeaseKind
    key: BlockHash
    expires: float
    undo: Callable[[int], None]  # given the lease id: gives the pin or the reservation back


class Leases:
    def __init__(self, ttl_s: float, clock: Clock = time.monotonic) -> None:
        if ttl_s <= 0:
            raise ValueError(f"lease time must be positive, got {ttl_s}")
        self.ttl_s = ttl_s
        self._clock = clock
        self._lock = threading.Lock()
        self._held: dict[int, Held] = {}
        # Ids start at a random point, so a restarted tier never honours an old lease.
        self._next_id = secrets.randbits(62)
        self._next_expiry = float("inf")
        self._expired = self._released = 0

    def grant(
        self, owner: str, kind: LeaseKind, key: BlockHash, undo: Callable[[int], None]
    ) -> int:
        with self._lock:
            self._next_id += 1
            expires = self._clock() + self.ttl_s
            self._held[self._next_id] = Held(owner, kind, key, expires, undo)
            self._next_expiry = min(self._next_expiry, expires)
            return self._next_id

    def take(self, lease: int) -> Held | None:
        """End a lease its holder finished with (it commits or unpins itself); None if the
        lease is unknown: expired, given back, or from an earlier incarnation of the tier."""
        with self._lock:
            return self._held.pop(lease, None)

    def end(self, leases: Iterable[int]) -> int:
        """End leases and give back what they hold; how many were held."""
        held = []
        with self._lock:
            for lease in leases:
                h = self._held.pop(lease, None)
                if h is not None:
                    held.append((lease, h))
        for lease, h in held:
            h.undo(lease)
        return len(held)

    def end_one(self, owner: str, key: BlockHash) -> bool:
        """End the oldest lease ``owner`` holds on ``key`` (for holders that keep no ids)."""
        with self._lock:
            lease = next((i for i, h in self._held.items() if h.owner == owner and h.key == key),
                         None)
        return lease is not None and self.end([lease]) == 1

    def end_pins(self, leases: Iterable[int | bytes]) -> None:
        """End pins by lease id; a key ends the oldest pin of ``ADMIN`` on it (the admin API
        pins and unpins by key)."""
        items = list(leases)
        self.end([x for x in items if isinstance(x, int)])
        for key in items:
            if isinstance(key, bytes):
                self.end_one(ADMIN, BlockHash(key))

    def forget_key(self, key: BlockHash) -> int:
        """Drop every lease on ``key`` without giving anything back: the block itself is gone
        (quarantined), and a later block of the same key must not lose its pins to them."""
        with self._lock:
            ids = [i for i, h in self._held.items() if h.key == key]
            for i in ids:
                del self._held[i]
            return len(ids)

    def release_owner(self, owner: str) -> int:
        """Give back everything ``owner`` holds (it gave up, or is known to be gone)."""
        with self._lock:
            ids = [i for i, h in self._held.items() if h.owner == owner]
        n = self.end(ids)
        with self._lock:
            self._released += n
        return n

    def expire(self) -> int:
        """Give back every lease past its expiry; how many."""
        now = self._clock()
        with self._lock:
            if now < self._next_expiry:
                return 0
            ids = [i for i, h in self._held.items() if h.expires <= now]
            rest = [h.expires for i, h in self._held.items() if h.expires > now]
            self._next_expiry = min(rest, default=float("inf"))
        n = self.end(ids)
        with self._lock:
            self._expired += n
        return n

    def stats(self) -> LeaseStats:
        with self._lock:
            pins = sum(h.kind is LeaseKind.PIN for h in self._held.values())
            return LeaseStats(pins, len(self._held) - pins, self._expired, self._released)

    def __len__(self) -> int:
        with self._lock:
            return len(self._held)


class LeasedPins:
    """A tier whose pins and reservations are ``leases``: the calls that end them, the same
    in every tier. A tier says how one pin of a key is undone (``_unpin_key``)."""

    leases: Leases

    def unpin(self, leases: Iterable[int | BlockHash]) -> None:
        """End pins by lease, or an admin pin by key (``Leases.end_pins``)."""
        self.leases.end_pins(leases)

    def release_owner(self, owner: str) -> int:
        """Give back every pin and reservation ``owner`` holds; how many."""
        return self.leases.release_owner(owner)

    def expire(self) -> int:
        return self.leases.expire()

    def _unpin_later(self, key: BlockHash) -> Callable[[int], None]:
        """The undo of a pin lease of ``key``: unpin it when the lease ends."""
        def undo(_lease: int) -> None:
            self._unpin_key(key)
        return undo

    def _unpin_key(self, key: BlockHash) -> None:
        raise NotImplementedError
