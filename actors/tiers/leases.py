"""Leases: who holds each pin and reservation of a tier, and until when.

A tier hands out a lease with every pin and every reservation: an id unique across the tier's
restarts, an owner (``client:<id>``, ``agent:<name>``, ``peer:<name>``, ``pool:<node>``) and an
expiry. The holder ends it (unpin, commit, abort) by id. What its holder never ends, because
it timed out, failed part-way or died, the tier takes back when the lease expires (``expire``,
run on every call that takes a slot and on every heartbeat) or when its owner's leases are
given back at once (``release_owner``). A released owner is remembered for a lease time: a
pin asked for it after (a late call of a caller that stopped waiting, which a threaded actor
may run after the release sent behind it) is refused (``grant_pin``). An operator's pin
(owner ``ADMIN``, ``pin_for``) expires after the TTL it was taken with (at most
``ADMIN_PIN_MAX_S``), not the tier's lease time, and is ended by key. Time is injected: tests
drive a fake clock.
"""

from __future__ import annotations

import enum
import secrets
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar

from cmx.keys import BlockHash
from cmx.stats import LeaseStats

__all__ = ["ADMIN", "ADMIN_PIN_DEFAULT_S", "ADMIN_PIN_MAX_S", "Held", "LeaseKind", "LeaseStats",
           "Leased", "LeasedPins", "Leases", "check_ttl"]

Clock = Callable[[], float]
ADMIN = "admin"  # the owner of pins an operator takes by hand (``LeasedPins.pin_for``)
ADMIN_PIN_DEFAULT_S = 3600.0  # how long an operator's pin holds when its request names no TTL
ADMIN_PIN_MAX_S = 86400.0  # the longest it may: a pin nobody ends gives its slot back in a day


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
        self._gone: dict[str, float] = {}  # owners given back (``release_owner``) -> until

    def grant(
        self, owner: str, kind: LeaseKind, key: BlockHash, undo: Callable[[int], None]
    ) -> int:
        with self._lock:
            return self._grant(owner, kind, key, undo)

    def grant_pin(self, owner: str, key: BlockHash, undo: Callable[[int], None]) -> int | None:
        """``grant`` a pin, unless ``owner`` was released within the last lease time: then
        None, and the caller gives back what it took. The check and the grant are one step,
        as ``release_owner``'s are, so a pin and its release may run in either order."""
        granted = self.grant_pins(owner, [key], lambda _key: undo)
        return None if granted is None else granted[0]

    def grant_pins(self, owner: str, keys: Sequence[BlockHash],
                   undo: Callable[[BlockHash], Callable[[int], None]]) -> list[int] | None:
        """``grant_pin`` of each key at once (``undo(key)`` gives its pin back), or None for
        all of them: the caller gives back what it took."""
        with self._lock:
            if self._gone.get(owner, float("-inf")) > self._clock():
                self._released += len(keys)
                return None
            return [self._grant(owner, LeaseKind.PIN, key, undo(key)) for key in keys]

    def _grant(self, owner: str, kind: LeaseKind, key: BlockHash,
               undo: Callable[[int], None]) -> int:
        self._next_id += 1
        expires = self._clock() + self.ttl_s
        self._held[self._next_id] = Held(owner, kind, key, expires, undo)
        self._next_expiry = min(self._next_expiry, expires)
        return self._next_id

    def hold(self, leases: Iterable[int], ttl_s: float) -> int:
        """Make each lease expire ``ttl_s`` seconds from now (an operator's pin, which lives as
        long as it was asked to); how many were held."""
        check_ttl(ttl_s)
        with self._lock:
            expires = self._clock() + ttl_s
            ids = [i for i in leases if i in self._held]
            for i in ids:
                h = self._held[i]
                self._held[i] = Held(h.owner, h.kind, h.key, expires, h.undo)
            if ids:
                self._next_expiry = min(self._next_expiry, expires)
            return len(ids)

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
            lease = next((i for i, h in self._held.items()
                          if _owned_by(h.owner, owner) and h.key == key), None)
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
        """Give back everything ``owner`` holds (it gave up, or is known to be gone), and
        refuse its pins for a lease time (``grant_pin``): an owner names one caller's call."""
        with self._lock:
            now = self._clock()
            while self._gone:  # oldest first: each is remembered ttl_s
                first = next(iter(self._gone))
                if self._gone[first] > now:
                    break
                del self._gone[first]
            self._gone.pop(owner, None)
            self._gone[owner] = now + self.ttl_s
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


def check_ttl(ttl_s: float) -> None:
    """An operator's pin lasts more than 0 and at most ``ADMIN_PIN_MAX_S`` seconds."""
    if isinstance(ttl_s, bool) or not isinstance(ttl_s, int | float) \
            or not 0 < ttl_s <= ADMIN_PIN_MAX_S:
        raise ValueError(f"a pin's TTL must be a number of seconds in (0, {ADMIN_PIN_MAX_S:g}], "
                         f"got {ttl_s!r}")


class Leased(Protocol):
    """A tier's pin of one block: it names the lease that ends it."""

    @property
    def lease(self) -> int: ...


P = TypeVar("P", bound=Leased)


class LeasedPins(Generic[P]):
    """The calls that end a tier's pins and reservations, the same in every tier: a tier holds
    one over its ``leases``, given how it pins (``pin``, each pin naming its lease) and how one
    pin of a key is undone (``unpin_key``), and answers the calls of the same names with it."""

    def __init__(self, leases: Leases, pin: Callable[[Sequence[BlockHash], str], list[P | None]],
                 unpin_key: Callable[[BlockHash], None]) -> None:
        self.leases = leases
        self._pin = pin
        self._unpin_key = unpin_key

    def pin_for(self, keys: Sequence[BlockHash], ttl_s: float, owner: str = ADMIN
                ) -> list[P | None]:
        """An operator's pin of each key (None where it is not here), held ``ttl_s`` seconds
        unless it is unpinned by key first (``unpin``). ``owner`` is ``ADMIN`` or
        ``ADMIN:<id>``: a caller whose call failed or answered late gives back what it may
        have pinned (``release_owner``). A bad TTL is a ValueError and pins nothing."""
        check_ttl(ttl_s)
        if owner != ADMIN and not owner.startswith(f"{ADMIN}:"):
            raise ValueError(f"an operator's pin is owned by {ADMIN!r} or {ADMIN}:<id>, "
                             f"not {owner!r}")
        pins = self._pin(keys, owner)
        self.leases.hold([p.lease for p in pins if p is not None], ttl_s)
        return pins

    def unpin(self, leases: Iterable[int | BlockHash]) -> None:
        """End pins by lease, or an admin pin by key (``Leases.end_pins``)."""
        self.leases.end_pins(leases)

    def release_owner(self, owner: str) -> int:
        """Give back every pin and reservation ``owner`` holds; how many."""
        return self.leases.release_owner(owner)

    def expire(self) -> int:
        return self.leases.expire()

    def unpin_later(self, key: BlockHash) -> Callable[[int], None]:
        """The undo of a pin lease of ``key``: unpin it when the lease ends."""
        def undo(_lease: int) -> None:
            self._unpin_key(key)
        return undo


def _owned_by(holder: str, owner: str) -> bool:
    """Whether a lease held by ``holder`` counts as ``owner``'s: an operator's pins are each
    owned by ``ADMIN:<id>`` and all ended by key as ``ADMIN``'s."""
    return holder == owner or (owner == ADMIN and holder.startswith(f"{ADMIN}:"))

