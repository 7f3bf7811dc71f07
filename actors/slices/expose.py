"""The owner's side of a partial load over NIXL: the selected byte ranges of a verified copy,
held in place for a reader on another node to pull.

An owner (a peer agent or a pool node) verifies its copy first, as for any partial load
(``cmx.selection``), then *exposes* the selection instead of sending it:

- a copy in a memory arena (HBM, DRAM, a pool node's staging) stays pinned for the reader,
  and the exposed ranges are the runs of the selection inside its slot;
- a copy only on NVMe is read as the chunks that cover the runs (``ExtentSlices``), checked,
  and its selected bytes gathered into a slot of the owner's ``SliceOutbox``, a registered
  buffer: one range.

With each ``ExposedSlice`` goes the checksum of the selected bytes, taken from the verified
copy; the reader checks the bytes that landed against it. The reader pulls all ranges of all
blocks in one NIXL transfer (``read_descriptors``) and then ends the pins and outbox leases
(``release_selection``); what a reader never releases is taken back when its lease expires.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from cmx.actors.tiers.leases import Clock, LeaseKind, Leases
from cmx.actors.transport.base import Region, Transport
from cmx.buffers import aligned_empty
from cmx.checksum import ChecksumStream
from cmx.keys import BlockHash
from cmx.selection import Runs, runs_bytes
from cmx.tiers import Tier

__all__ = ["ExposedSlice", "Exposure", "SliceOutbox", "exposed_ranges", "outbox_slots",
           "read_descriptors", "selection_checksum"]

OUTBOX_BYTES = 64 << 20  # an owner's registered staging for selections read from NVMe
OUTBOX_MAX_SLOTS = 16


@dataclass(frozen=True)
class ExposedSlice:
    """One block's selected bytes, held at the owner for a reader's NIXL read."""

    key: BlockHash
    region: str  # a region the owner registered with its transport (in its ``PeerInfo``)
    ranges: Runs  # (offset from the region's base, length): the selection's bytes, in order
    checksum: int  # XXH3-64 of the selected bytes, taken from the verified copy
    source_tier: Tier
    lease: int  # of the pin (memory) or the outbox slot (NVMe): ``release_selection`` ends it

    @property
    def nbytes(self) -> int:
        return runs_bytes(self.ranges)


@dataclass(frozen=True)
class Exposure:
    """An owner's answer: per key, its exposed selection or None (no copy here, or only a
    corrupt one, now quarantined); ``later`` are the positions of keys it holds but had no
    outbox room for now (ask again after releasing these)."""

    slices: tuple[ExposedSlice | None, ...]
    later: tuple[int, ...] = ()


def exposed_ranges(slot_offset: int, runs: Runs) -> Runs:
    """The runs of a block whose payload starts ``slot_offset`` bytes into a region."""
    return tuple((slot_offset + off, length) for off, length in runs)


def selection_checksum(payload: np.ndarray, runs: Runs) -> int:
    """XXH3-64 of the concatenated ``runs`` of ``payload``, without gathering them."""
    stream = ChecksumStream()
    for off, length in runs:
        stream.feed(payload[off : off + length])
    return int(stream.value())


def read_descriptors(exposed: Sequence[ExposedSlice], bases: Mapping[str, int],
                     local_base: int) -> tuple[np.ndarray, np.ndarray]:
    """NIXL descriptors (rows: address, length, device 0) of one READ: the ranges of every
    exposed block at the owner (``bases``: address of each region there), and where each
    lands here, block after block from ``local_base``. Ranges adjacent on both sides travel
    as one descriptor."""
    remote: list[list[int]] = []
    local: list[list[int]] = []
    at = local_base
    for e in exposed:
        base = bases[e.region]
        for off, length in e.ranges:
            src = base + off
            if remote and sum(remote[-1][:2]) == src and sum(local[-1][:2]) == at:
                remote[-1][1] += length
                local[-1][1] += length
            else:
                remote.append([src, length, 0])
                local.append([at, length, 0])
            at += length
    return (np.array(remote, dtype=np.uint64).reshape(-1, 3),
            np.array(local, dtype=np.uint64).reshape(-1, 3))


def outbox_slots(block_bytes: int) -> int:
    """How many blocks an outbox holds: up to OUTBOX_BYTES, at least two."""
    return max(2, min(OUTBOX_MAX_SLOTS, OUTBOX_BYTES // block_bytes))


class SliceOutbox:
    """Registered slots where an owner gathers selections it read from NVMe, leased to the
    reader that pulls them (a reader that never releases its slot loses it at expiry)."""

    def __init__(self, name: str, slot_bytes: int, slots: int, lease_s: float,
                 clock: Clock = time.monotonic) -> None:
        self.buffer = aligned_empty(slot_bytes * slots)
        self._books(Region(name, self.buffer.ctypes.data, slot_bytes, slots), lease_s, clock)

    def _books(self, region: Region, lease_s: float, clock: Clock) -> None:
        """The slots' leases and free list (an outbox whose memory is elsewhere has only
        these)."""
        self.region = region
        self.leases = Leases(lease_s, clock)
        self._free = list(range(region.num_slots))
        self._lock = threading.Lock()

    @classmethod
    def registered(cls, transport: Transport, name: str, block_bytes: int,
                   lease_s: float) -> SliceOutbox:
        """An outbox of up to OUTBOX_BYTES, registered with ``transport``: it is in the
        ``PeerInfo`` the owner publishes from now on."""
        box = cls(name, block_bytes, outbox_slots(block_bytes), lease_s)
        transport.register(box.region, box.buffer)
        return box

    def take(self, owner: str, key: BlockHash) -> tuple[int, int] | None:
        """A free slot for ``owner`` and its lease, or None when every slot is leased."""
        self.leases.expire()
        with self._lock:
            if len(self._free) <= self._kept_from(owner):
                return None
            slot = self._free.pop()
        return slot, self.leases.grant(owner, LeaseKind.PIN, key, self._put_back(slot))

    def _kept_from(self, owner: str) -> int:
        """How many free slots ``owner`` may not take (none here)."""
        return 0

    def view(self, slot: int) -> np.ndarray:
        n = self.region.slot_bytes
        return self.buffer[slot * n : (slot + 1) * n]

    def offset(self, slot: int) -> int:
        return slot * self.region.slot_bytes

    def end(self, leases: Sequence[int]) -> None:
        self.leases.end(leases)

    def free_slots(self) -> int:
        with self._lock:
            return len(self._free)

    def check_integrity(self) -> None:
        held = self.leases.stats().pinned
        free = self.free_slots()
        if held + free != self.region.num_slots:
            raise AssertionError(f"outbox leased {held} + free {free} != slots "
                                 f"{self.region.num_slots}")

    def _put_back(self, slot: int) -> Callable[[int], None]:
        def undo(_lease: int) -> None:
            with self._lock:
                self._free.append(slot)
        return undo
