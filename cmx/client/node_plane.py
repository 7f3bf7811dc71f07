"""This node's memory tiers (HBM and DRAM) as a reader calls them: one typed interface over
their books, with the operation a local hit needs fused into one round trip.

Protocol, in call order:

1. ``pin_prefix(keys, owner)``: the tiers pin the keys for ``owner`` (each pin a lease,
   taken back when it expires; one call's pins are one run of lease ids in the tier's books,
   ``Leases.grant_pins``), DRAM first, HBM for what DRAM lacks; the longest prefix of
   held keys is returned, and every other pin is let go one way. A prefix in DRAM is one
   round trip, with no directory: a tier pins only committed blocks. A tier that fails or
   answers late is told to give back all ``owner`` holds there (``release_owner``, one way):
   ``owner`` names one load, and a late call may have pinned before its answer was lost, or
   may run after the release; the tier refuses ``owner``'s pins from then on.
2. ``payload(pin)``: the block's bytes, read where they lie, in the shared-memory arena of the
   pin's epoch (``arena_name``), mapped here once per tier incarnation (a prefix pinned whole
   in one tier: ``SlotRows``, its runs gathered from the slots by index). A tier that restarted
   unlinked that name: a read of its pin fails (OSError) where this process had not mapped it
   yet, and otherwise reads the earlier incarnation's pages, which nobody writes any more;
   never another block. The reader checks each block's checksum before using it.
3. ``unpin(pins)`` and ``quarantine(pins)``: one way, off the load's path. A corrupt copy goes
   when its last pin does.

A lookup asks ``held(keys)``: what this node's memory holds committed of ``keys``, so that
only the rest is asked of the directory, and a copy here the directory still lists after the
tier let it go is not reported. Each tier answers from its held table, mapped here
(``cmx.storage.held_table``: its books in shared memory, read in place, no round trip); a
tier whose table cannot be read (gone with a restart, closed, changing under every read) is
asked itself, both at once in one round trip. It promises no more than the directory does:
a block may go before it is pinned, and a load pins it or looks it up again.

Blocks this node holds on NVMe, on other nodes or in the pool are the agent's to move.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, TypeVar, cast, overload

import numpy as np

from cmx.client.copy_out import SlotRows
from cmx.copy_table import CopyTable
from cmx.doors import (
    ArenaInfoOf,
    Held,
    Pin,
    PinColumns,
    QuarantinePinned,
    ReleaseOwner,
    Request,
    Unpin,
)
from cmx.keys import BlockHash
from cmx.protocol import Copy, Pinned, PinnedColumns, actor_name, arena_name, held_table_name
from cmx.storage.arena import SHM_DIR, SharedArena, check_slots
from cmx.storage.held_table import HeldTable
from cmx.tiers import Tier

__all__ = ["HeldHere", "LocalPin", "NodePlane", "PinnedPrefix"]

R = TypeVar("R")

log = logging.getLogger(__name__)

KEEP_ARENAS = 8  # arenas mapped at once: the current incarnations and a few earlier ones
NO_TABLE_S = 10.0  # after a tier's held table could not be mapped, ask the tier this long


@dataclass(frozen=True)
class LocalPin:
    """A block pinned in one of this node's memory tiers for a reader."""

    tier: Tier
    pin: Pinned


class PinnedPrefix(Sequence[LocalPin]):
    """A whole prefix pinned in one tier, kept as the tier's answer (``PinnedColumns``): a
    ``LocalPin`` is made only for a block asked for by index (a quarantine's)."""

    def __init__(self, tier: Tier, keys: Sequence[bytes], columns: PinnedColumns) -> None:
        self.tier = tier
        self.keys = cast(list[BlockHash], list(keys))  # BlockHash is bytes, by name
        self.columns = columns

    def __len__(self) -> int:
        return len(self.keys)

    @overload
    def __getitem__(self, i: int) -> LocalPin: ...

    @overload
    def __getitem__(self, i: slice) -> list[LocalPin]: ...

    def __getitem__(self, i: int | slice) -> LocalPin | list[LocalPin]:
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        return LocalPin(self.tier, self.columns.pinned(self.keys, range(len(self))[i]))


@dataclass(frozen=True, eq=False)
class HeldHere:
    """What this node's memory tiers hold of some keys, by their own books."""

    node: str
    table: CopyTable  # per key, its committed copies here, DRAM's before HBM's (none: no rows)
    answered: frozenset[Tier]  # the tiers that answered; of the others nothing is known

    @property
    def copies(self) -> tuple[tuple[Copy, ...], ...]:
        """Per key, its committed copies here (empty: none), made when asked."""
        return tuple(tuple(c) for c in self.table.lists())

    @property
    def prefix(self) -> int:
        """How many leading keys this node's memory holds."""
        return self.table.prefix()

    def confirmed(self, found: CopyTable, first: int) -> CopyTable:
        """``found``, the directory's copies of the keys from key ``first`` on, less those in
        this node's answering tiers that their books do not hold: evicted, quarantined or
        replaced here before the directory heard."""
        bit = {t: 1 << i for i, t in enumerate(sorted(self.answered))}
        checked = np.array([bit[t] if n == self.node and t in bit else 0
                            for t, n in found.places] or [0], np.int64)[found.place]
        if not checked.any():
            return found
        mine = self.table
        held = np.array([bit.get(t, 0) for t, _ in mine.places] or [0], np.int64)[mine.place]
        # a key's tiers here as bits: a tier holds a key once, so the sum is the union
        bits = np.bincount(np.repeat(np.arange(len(mine)), mine.counts), weights=held,
                           minlength=len(mine)).astype(np.int64)
        key = np.repeat(np.arange(first, first + len(found)), found.counts)
        return found.where((checked == 0) | ((bits[key] & checked) != 0))


class NodePlane:
    def __init__(self, link: Any, node: str, timeout_s: float) -> None:
        self.link = link
        self.node = node
        self.timeout_s = timeout_s
        self._arenas: dict[str, SharedArena] = {}  # arena name -> mapping, oldest first
        self._tables: dict[Tier, HeldTable] = {}  # each tier's held table, mapped
        self._no_table: dict[Tier, float] = {}  # tier -> until when it is asked instead
        self._lock = threading.Lock()

    def pin_prefix(self, keys: Sequence[bytes], owner: str) -> Sequence[LocalPin]:
        """The longest prefix of ``keys`` held in this node's memory, each pinned for ``owner``.

        DRAM is asked first, for every key: a reader on the host copies into host memory, so
        a DRAM copy is the nearest, and a prefix DRAM holds whole costs that one call, its
        answer columns (``PinnedPrefix``: no object per block). HBM is asked only for the
        keys from the first DRAM does not hold. A tier that does not answer holds nothing."""
        if not keys:
            return []
        columns = self._ask_pins(Tier.DRAM, PinColumns(keys=list(keys), owner=owner), owner)
        if columns is not None and bool(columns.held.all()):  # the common case, one pass
            return PinnedPrefix(Tier.DRAM, keys, columns)
        dram = columns.as_list(keys) if columns is not None else [None] * len(keys)
        gap = next((i for i, p in enumerate(dram) if p is None), len(keys))
        hbm: list[Pinned | None] = [None] * len(keys)
        rest = [i for i in range(gap, len(keys)) if dram[i] is None]
        for i, pin in zip(rest, self._pin(Tier.HBM, [keys[i] for i in rest], owner)):
            hbm[i] = pin
        prefix: list[LocalPin] = []
        spare: list[LocalPin] = []
        for i, (d, h) in enumerate(zip(dram, hbm)):
            held = [LocalPin(t, p) for t, p in ((Tier.DRAM, d), (Tier.HBM, h)) if p is not None]
            (prefix if held and len(prefix) == i else spare).extend(held)
        self.unpin(spare)
        return prefix

    def held(self, keys: Sequence[bytes]) -> HeldHere:
        """This node's committed copies (DRAM, HBM) of each of ``keys``, by the tiers' own
        books: read from their held tables here, and the tiers whose table cannot be read
        asked at once; of a tier that fails or does not answer in time nothing is known."""
        tiers = (Tier.DRAM, Tier.HBM)
        if not keys:
            return HeldHere(self.node, CopyTable.empty(), frozenset(tiers))
        together = b"".join(keys)
        found: dict[Tier, Columns] = {}
        for tier in tiers:
            table = self._table(tier)
            answer = table.find_columns(together) if table is not None else None
            if answer is not None:
                found[tier] = answer
        ask = [t for t in tiers if t not in found]
        answers = self.link.call_many(
            [(actor_name(t.value, self.node), Held(keys=list(keys))) for t in ask],
            timeout_s=self.timeout_s, return_exceptions=True) if ask else []
        for tier, answer in zip(ask, answers):
            if isinstance(answer, BaseException) or len(answer) != len(keys):
                log.debug("%s did not answer a lookup: %s", tier.value, answer)
            else:
                found[tier] = _columns(answer)
        answered = [t for t in tiers if t in found]
        return HeldHere(self.node, _held(self.node, answered, found, len(keys)),
                        frozenset(found))

    def _table(self, tier: Tier) -> HeldTable | None:
        """``tier``'s held table of its current incarnation, mapped here; None where it cannot
        be (then the tier is asked for a while). A table whose name is gone (the tier
        restarted and unlinked it) is mapped again by the new incarnation's name."""
        with self._lock:
            table = self._tables.get(tier)
            if table is not None and os.path.exists(os.path.join(SHM_DIR, table.name)):
                return table
            if table is not None:
                del self._tables[tier]
                table.arena.close()
            if time.monotonic() < self._no_table.get(tier, 0.0):
                return None
        try:
            info = self.link.call(actor_name(tier.value, self.node), ArenaInfoOf(),
                                  timeout_s=self.timeout_s)
            table = HeldTable.attach(held_table_name(tier, self.node, info.epoch))
        except Exception as exc:  # noqa: BLE001 - not mapped: the tier answers instead
            log.debug("%s's held table is not readable here: %s", tier.value, exc)
            with self._lock:
                self._no_table[tier] = time.monotonic() + NO_TABLE_S
            return None
        with self._lock:
            mapped = self._tables.setdefault(tier, table)
        if mapped is not table:
            table.arena.close()
        return mapped

    def _pin(self, tier: Tier, keys: Sequence[bytes], owner: str) -> list[Pinned | None]:
        answer = self._ask_pins(tier, Pin(keys=list(keys), owner=owner), owner)
        return answer if answer is not None else [None] * len(keys)

    def _ask_pins(self, tier: Tier, request: Request[R], owner: str) -> R | None:
        """``tier``'s answer to a pin request of ``owner``'s; None where it failed or did not
        answer in time."""
        try:
            answer: R = self.link.call(actor_name(tier.value, self.node), request,
                                       timeout_s=self.timeout_s)
        except Exception as exc:  # noqa: BLE001 - a tier that fails holds nothing for this load
            # A call that timed out may have run, or may run yet (a threaded tier keeps no call
            # order): what it pinned is given back now and what it pins later is refused
            # (``Leases.grant_pins``), not held until the leases expire. The owner is this
            # load's alone.
            log.debug("%s did not pin: %s", tier.value, exc)
            self.link.tell(actor_name(tier.value, self.node), ReleaseOwner(owner=owner))
            return None
        return answer

    def payload(self, pin: LocalPin) -> np.ndarray:
        """The pinned block's bytes, in place: valid until the pin ends."""
        return self.payloads([pin])[0]

    def payloads(self, pins: Sequence[LocalPin]) -> list[np.ndarray]:
        """Each pinned block's bytes, in place (``payload``), each arena mapped once."""
        if isinstance(pins, PinnedPrefix):
            return self._prefix_payloads(pins)
        arenas: dict[tuple[Tier, str], SharedArena] = {}
        views = []
        for pin in pins:
            arena = arenas.get((pin.tier, pin.pin.epoch))
            if arena is None:
                name = arena_name(pin.tier, self.node, pin.pin.epoch)
                arena = arenas[(pin.tier, pin.pin.epoch)] = self.arena(name)
            views.append(arena.slot_view(pin.pin.slot)[: pin.pin.size])
        return views

    def pinned_payloads(self, pins: Sequence[LocalPin]
                        ) -> Sequence[tuple[BlockHash, np.ndarray, int]]:
        """(key, bytes in place, checksum) of each pin, as ``copy_payloads`` takes them: a
        prefix pinned whole in one tier, its blocks of one size, as ``SlotRows``."""
        if isinstance(pins, PinnedPrefix):
            c = pins.columns
            if len(c.size) and int(c.size.min()) == int(c.size.max()):
                arena = self.arena(arena_name(pins.tier, self.node, c.epoch))
                return SlotRows(pins.keys, arena.buffer, arena.slot_bytes, c.slot,
                                min(int(c.size[0]), arena.slot_bytes), c.checksum)
            return list(zip(pins.keys, self._prefix_payloads(pins), c.checksum.tolist()))
        return [(p.pin.key, view, p.pin.checksum) for p, view in zip(pins, self.payloads(pins))]

    def _prefix_payloads(self, pins: PinnedPrefix) -> list[np.ndarray]:
        arena = self.arena(arena_name(pins.tier, self.node, pins.columns.epoch))
        c = pins.columns
        check_slots(c.slot, arena.num_slots)
        buffer, width = arena.buffer, arena.slot_bytes
        return [buffer[o : o + n] for o, n in
                zip((c.slot * width).tolist(), np.minimum(c.size, width).tolist())]

    def unpin(self, pins: Sequence[LocalPin]) -> None:
        if isinstance(pins, PinnedPrefix):
            self.link.tell(actor_name(pins.tier.value, self.node),
                           Unpin(leases=pins.columns.lease.tolist()))
            return
        for tier, leases in _by_tier(pins, lambda p: p.pin.lease).items():
            self.link.tell(actor_name(tier.value, self.node), Unpin(leases=leases))

    def quarantine(self, pins: Sequence[LocalPin]) -> None:
        """Drop the copies these pins named, found corrupt (each goes when its last pin
        does); a copy stored since, or in a tier that restarted, stays."""
        for tier, named in _by_tier(pins, lambda p: p.pin).items():
            self.link.tell(actor_name(tier.value, self.node), QuarantinePinned(pins=named))

    def arena(self, name: str) -> SharedArena:
        """The arena ``name`` mapped here; the oldest mapping goes past ``KEEP_ARENAS`` (a read
        still using it keeps its view: unmapping waits for the last)."""
        with self._lock:
            arena = self._arenas.get(name)
            if arena is None:
                arena = self._arenas[name] = SharedArena.attach(name)
                while len(self._arenas) > KEEP_ARENAS:
                    self._arenas.pop(next(iter(self._arenas))).close()
            return arena

    def close(self) -> None:
        with self._lock:
            for arena in self._arenas.values():
                arena.close()
            self._arenas.clear()
            for table in self._tables.values():
                table.arena.close()
            self._tables.clear()


Columns = tuple[np.ndarray, np.ndarray, np.ndarray]  # held, size, checksum per key


def _columns(answer: Sequence[tuple[int, int] | None]) -> Columns:
    """A tier's ``held`` answer as ``HeldTable.find_columns`` gives it."""
    return (np.array([a is not None for a in answer], bool),
            np.array([a[0] if a else 0 for a in answer], np.int64),
            np.array([a[1] if a else 0 for a in answer], np.uint64))


def _held(node: str, tiers: Sequence[Tier], found: dict[Tier, Columns], keys: int) -> CopyTable:
    """The copies ``found`` in ``tiers`` of ``node`` as one table, each key's in tier order."""
    tiers = [t for t in tiers if found[t][0].any()]  # a tier that holds none adds no row
    if not tiers:
        return CopyTable.empty(keys)
    if len(tiers) == 1:
        held, size, checksum = found[tiers[0]]
        return CopyTable(((tiers[0], node),), held.astype(np.int64),
                         np.zeros(int(held.sum()), np.int64), size[held], checksum[held])
    held = np.stack([found[t][0] for t in tiers], axis=1)  # key by tier; read row by row
    column = np.broadcast_to(np.arange(len(tiers), dtype=np.int64), held.shape)
    return CopyTable(tuple((t, node) for t in tiers), held.sum(axis=1).astype(np.int64),
                     column[held], np.stack([found[t][1] for t in tiers], axis=1)[held],
                     np.stack([found[t][2] for t in tiers], axis=1)[held])


def _by_tier(pins: Sequence[LocalPin], what: Any) -> dict[Tier, list[Any]]:
    out: dict[Tier, list[Any]] = {}
    for p in pins:
        out.setdefault(p.tier, []).append(what(p))
    return out
