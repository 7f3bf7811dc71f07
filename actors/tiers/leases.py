"""Leases: who holds each pin and reservation of a tier, and until when.

A tier hands out a lease with every pin and every reservation: an id unique across the tier's
restarts, an owner (``client:<id>``, ``agent:<name>``, ``peer:<name>``, ``pool:<node>``) and an
expiry. The holder ends it (unpin, commit, abort) by id. What its holder never ends, because it
timed out, failed part-way or died, the tier takes back when the lease expires (``expire``, run
on every call that takes a slot and on every heartbeat) or when its owner's leases are given
back at once (``release_owner``). Pins granted together (``grant_pins``, a reader's prefix) are
one record, a ``_Run``: consecutive ids, one expiry, given back together, with no object per
block to make or drop; a pin of a run ended alone is taken out of it first. A released owner is
remembered for a lease time: a pin asked for it after (a late call of a caller that stopped
waiting, which a threaded actor may run after the release sent behind it) is refused
(``grant_pin``). An operator's pin (owner ``ADMIN``, ``pin_for``) expires after the TTL it was
taken with (at most ``ADMIN_PIN_MAX_S``), not the tier's lease time, and is ended by key. Time
is injected: tests drive a fake clock.
"""

from __future__ import annotations

import enum
import secrets
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from cmx.keys import BlockHash
from cmx.stats import LeaseStats

__all__ = ["ADMIN", "ADMIN_PIN_DEFAULT_S", "ADMIN_PIN_MAX_S", "Held", "LeaseKind", "LeaseStats",
           "Leases", "UndoKeys", "check_ttl"]

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


Undo = Callable[[int], None]  # given the lease id: gives one pin or reservation back
UndoKeys = Callable[[list[BlockHash]], None]  # gives a pin of each key back


@dataclass
class _Run:
    """Pins granted together for one owner: lease ``first + i`` pins ``keys[i]``; ``live[i]``
    while that pin is held."""

    owner: str
    keys: list[BlockHash]
    first: int
    expires: float
    undo: UndoKeys
    live: np.ndarray
    left: int

    def end(self, offsets: np.ndarray) -> list[BlockHash]:
        """Mark the pins at ``offsets`` (distinct, in range) ended; the keys of those that were
        held, to give back."""
        offsets = offsets[self.live[offsets]]
        self.live[offsets] = False
        self.left -= len(offsets)
        return [self.keys[i] for i in offsets.tolist()]

    def end_all(self) -> list[BlockHash]:
        return self.end(np.flatnonzero(self.live))

    def held(self, offset: int) -> Held:
        """The pin at ``offset`` as a lease of its own."""
        undo = self.undo
        key = self.keys[offset]
        return Held(self.owner, LeaseKind.PIN, key, self.expires, lambda _lease: undo([key]))


class Leases:
    def __init__(self, ttl_s: float, clock: Clock = time.monotonic) -> None:
        if ttl_s <= 0:
            raise ValueError(f"lease time must be positive, got {ttl_s}")
        self.ttl_s = ttl_s
        self._clock = clock
        self._lock = threading.Lock()
        self._held: dict[int, Held] = {}
        self._runs: dict[int, _Run] = {}  # first id -> run, in the order granted (ids rise)
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
                   undo: Callable[[BlockHash], Undo],
                   undo_keys: UndoKeys | None = None) -> list[int] | None:
        """``grant_pin`` of each key at once (``undo(key)`` gives its pin back), or None for
        all of them: the caller gives back what it took. With ``undo_keys`` (the pins of
        several keys given back in one call), a reader's pins are one run (consecutive ids);
        an operator's stay a lease each, as ``hold`` and ``end_one`` take them."""
        with self._lock:
            if self._gone.get(owner, float("-inf")) > self._clock():
                self._released += len(keys)
                return None
            if undo_keys is None or len(keys) < 2 or _owned_by(owner, ADMIN):
                return [self._grant(owner, LeaseKind.PIN, key, undo(key)) for key in keys]
            first = self._next_id + 1
            self._next_id += len(keys)
            expires = self._clock() + self.ttl_s
            self._runs[first] = _Run(owner, list(keys), first, expires, undo_keys,
                                     np.ones(len(keys), bool), len(keys))
            self._next_expiry = min(self._next_expiry, expires)
            return list(range(first, first + len(keys)))

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
            ids = [i for i in leases if i in self._held or self._detach(i)]
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
            held = self._held.pop(lease, None)
            if held is None and self._detach(lease):
                held = self._held.pop(lease)
            return held

    def end(self, leases: Iterable[int]) -> int:
        """End leases and give back what they hold; how many were held."""
        # What no lease id can be (a list, an array) is passed over, as a miss would be.
        items = [x for x in leases if type(x) is int or _hashable(x)]
        held = []
        with self._lock:
            # A reader's run of 62,500 pins ends in a few C passes: the ids held alone found
            # by one set intersection, the rest ended in their runs by one vectorised pass.
            alone = self._held.keys() & set(items) if self._held else set()
            if alone:  # in the order asked, each once
                held = [(lease, h) for lease in items
                        if lease in alone and (h := self._held.pop(lease, None)) is not None]
            rest = [lease for lease in items if lease not in alone
                    and isinstance(lease, int | np.integer) and 0 < lease < _ID_END] \
                if self._runs else []
            ended = self._end_in_runs(rest) if rest else []
        for lease, h in held:
            h.undo(lease)
        return len(held) + _give_back(ended)

    def _end_in_runs(self, ids: Sequence[int | np.integer]) -> list[tuple[_Run, list[BlockHash]]]:
        """Mark the pins of runs named by ``ids`` ended (caller holds the lock); each run with
        the keys to give back."""
        firsts = np.fromiter(self._runs, np.int64, len(self._runs))
        wanted = np.unique(np.asarray(ids, np.int64))
        where = np.searchsorted(firsts, wanted, side="right") - 1
        ended = []
        for at in np.unique(where[where >= 0]).tolist():
            run = self._runs[int(firsts[at])]
            offsets = wanted[where == at] - run.first
            keys = self._end_in(run, offsets[offsets < len(run.keys)])
            if keys:
                ended.append((run, keys))
        return ended

    def _detach(self, lease: int) -> bool:
        """Take a live pin of a run out of it, into a lease of its own (caller holds the lock);
        whether there was one."""
        if not self._runs or not isinstance(lease, int | np.integer):
            return False
        lease = int(lease)
        run = next((r for r in self._runs.values()
                    if 0 <= lease - r.first < len(r.keys)), None)
        if run is None or not run.live[lease - run.first]:
            return False
        offset = lease - run.first
        self._held[lease] = run.held(offset)
        self._end_in(run, np.array([offset]))
        return True

    def _end_in(self, run: _Run, offsets: np.ndarray) -> list[BlockHash]:
        """``run.end(offsets)``, the run dropped from the books once it holds no pin (caller
        holds the lock)."""
        keys = run.end(offsets)
        if not run.left:
            del self._runs[run.first]
        return keys

    def _end_runs(self, runs: list[_Run]) -> list[tuple[_Run, list[BlockHash]]]:
        """Mark every pin of ``runs`` ended (caller holds the lock)."""
        for run in runs:
            del self._runs[run.first]
        return [(run, run.end_all()) for run in runs]

    def end_one(self, owner: str, key: BlockHash) -> bool:
        """End the oldest lease ``owner`` holds on ``key`` (for holders that keep no ids)."""
        with self._lock:
            lease = next((i for i, h in self._held.items()
                          if _owned_by(h.owner, owner) and h.key == key), None)
            if lease is None:
                lease = next((r.first + i for r in self._runs.values()
                              if _owned_by(r.owner, owner)
                              for i, k in enumerate(r.keys) if k == key and r.live[i]), None)
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
            gone = 0
            for run in list(self._runs.values()):
                gone += len(self._end_in(run, np.array(
                    [i for i, k in enumerate(run.keys) if k == key], np.int64)))
            return len(ids) + gone

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
            ended = self._end_runs([r for r in self._runs.values() if r.owner == owner])
        n = self.end(ids) + _give_back(ended)
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
            ended = self._end_runs([r for r in self._runs.values() if r.expires <= now])
            rest = [h.expires for i, h in self._held.items() if h.expires > now]
            rest += [r.expires for r in self._runs.values()]
            self._next_expiry = min(rest, default=float("inf"))
        n = self.end(ids) + _give_back(ended)
        with self._lock:
            self._expired += n
        return n

    def stats(self) -> LeaseStats:
        with self._lock:
            reserved = sum(h.kind is LeaseKind.RESERVE for h in self._held.values())
            return LeaseStats(self._count() - reserved, reserved, self._expired, self._released)

    def __len__(self) -> int:
        with self._lock:
            return self._count()

    def _count(self) -> int:
        return len(self._held) + sum(r.left for r in self._runs.values())


_ID_END = 1 << 63  # lease ids are int64s (they start below 2 ** 62)


def _give_back(ended: list[tuple[_Run, list[BlockHash]]]) -> int:
    """Give back the pins of ``ended`` (outside the lock); how many."""
    for run, keys in ended:
        run.undo(keys)
    return sum(len(keys) for _, keys in ended)


def check_ttl(ttl_s: float) -> None:
    """An operator's pin lasts more than 0 and at most ``ADMIN_PIN_MAX_S`` seconds."""
    if isinstance(ttl_s, bool) or not isinstance(ttl_s, int | float) \
            or not 0 < ttl_s <= ADMIN_PIN_MAX_S:
        raise ValueError(f"a pin's TTL must be a number of seconds in (0, {ADMIN_PIN_MAX_S:g}], "
                         f"got {ttl_s!r}")


def _owned_by(holder: str, owner: str) -> bool:
    """Whether a lease held by ``holder`` counts as ``owner``'s: an operator's pins are each
    owned by ``ADMIN:<id>`` and all ended by key as ``ADMIN``'s."""
    return holder == owner or (owner == ADMIN and holder.startswith(f"{ADMIN}:"))


def _hashable(x: object) -> bool:
    try:
        hash(x)
    except TypeError:
        return False
    return True
