"""The directory: the context address space. Block key -> where its copies are.

Keys are spread over shards by their first bytes (keys are uniform hashes). Each shard follows
its sources (one tier on one node, with an epoch that changes when the tier restarts) through
their events:

1. A source sends ``apply(source, epoch, seq, events)``: ``seq`` is the sequence number of the
   last event in the batch, counted per (source, shard), starting at 1, with no gaps. An empty
   batch is a heartbeat.
2. The shard applies the batch only if it continues what it has seen; otherwise (a gap, a new
   epoch, a source it does not know, as after the shard itself restarted) it answers
   ``NEED_RESYNC`` and the source sends ``resync(source, epoch, seq, entries)``: everything it
   holds for this shard, replacing what the shard knew of it.
3. ``lookup(keys)`` answers, for each key, the copies the shard knows (empty for a miss);
   ``find_copies(keys)`` answers the same as one ``CopyTable`` (``cmx.copy_table``), for keys
   sent end to end in one buffer: a long prefix's lookup makes no object per key.

A shard knows too little for a while after it started (empty), until every live source has
heartbeated once (two ``heartbeat_s``), and after it asked a source to resync, until that one
has (within ``resync_s``): meanwhile a listing of a namespace may miss copies, so
``namespace_blocks`` raises ``UnavailableError`` rather than answer short (a drop would report
a success it did not have). Lookups answer what is known: a missing copy is a miss.

A shard that answers nothing is a miss for the caller, never a wrong block: copies carry the
checksum, and every mover verifies it.
"""

from __future__ import annotations

import enum
import itertools
import struct
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from cmx.copy_table import CopyTable
from cmx.errors import UnavailableError
from cmx.keys import BlockHash, split_keys
from cmx.protocol import Copy, shard_of
from cmx.stats import DirectoryStats
from cmx.tiers import Tier

__all__ = ["ApplyResult", "Copy", "DirectoryShard", "Entry", "Source", "shard_of"]


@dataclass(frozen=True, order=True)
class Source:
    node: str  # Ray node id (hex)
    tier: Tier

    def __str__(self) -> str:
        return f"{self.tier.value}@{self.node[:8]}"


@dataclass(frozen=True)
class Entry:
    """One event's payload: a block stored (size, checksum) or removed (size 0)."""

    key: BlockHash
    stored: bool
    size: int = 0
    checksum: int = 0
    namespace: str = ""  # namespace id, where the source knows it




class ApplyResult(str, enum.Enum):
    OK = "ok"
    NEED_RESYNC = "need_resync"


class DirectoryShard:
    """One shard's state. Plain class; ``actors.service`` wraps it in a Ray actor."""

    def __init__(self, shard_id: int = 0, heartbeat_s: float = 0.0, resync_s: float = 0.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.shard_id = shard_id
        self.resync_s = resync_s  # how long a source asked to resync may take to
        self._clock = clock
        self._contacted_at = clock() + 2 * heartbeat_s  # every live source has been in touch
        self._asked: dict[Source, float] = {}  # sources told to resync -> until when awaited
        # source index -> source; a source dropped (its node left) frees its index for the next
        # one, which is safe because dropping removed the index from every record.
        self._sources: list[Source | None] = []
        self._source_index: dict[Source, int] = {}
        self._free_sources: list[int] = []
        self._cursor: dict[Source, tuple[str, int]] = {}  # source -> (epoch, last seq)
        self._namespaces: list[str] = [""]  # namespace index -> id; 0 is "unknown"
        self._ns_index: dict[str, int] = {"": 0}
        # key -> packed record (see _pack): one small bytes object per block, sources interned
        # and namespaces as uint32 indices, so a block costs ~200 bytes of index.
        self._blocks: dict[bytes, bytes] = {}
        self.resyncs = 0
        self.lookups = 0

    # -- following sources ---------------------------------------------------------------------

    def apply(self, source: Source, epoch: str, seq: int, entries: Sequence[Entry]) -> ApplyResult:
        known = self._cursor.get(source)
        first = seq - len(entries) + 1
        if known is None or known[0] != epoch or known[1] + 1 != first:
            if known is not None and known[0] == epoch and seq <= known[1]:
                return ApplyResult.OK  # a duplicate of what was applied
            self._asked[source] = self._clock() + self.resync_s
            return ApplyResult.NEED_RESYNC
        idx = self._index(source)
        for entry in entries:
            if entry.stored:
                self._add(idx, entry)
            else:
                self._remove(idx, entry.key)
        self._cursor[source] = (epoch, seq)
        return ApplyResult.OK

    def resync(self, source: Source, epoch: str, seq: int, entries: Iterable[Entry]) -> None:
        """Replace everything known of ``source`` by ``entries`` (all stored)."""
        self.drop_source(source)
        idx = self._index(source)
        for entry in entries:
            self._add(idx, entry)
        self._cursor[source] = (epoch, seq)
        self._asked.pop(source, None)
        self.resyncs += 1

    def drop_source(self, source: Source) -> int:
        """Forget every copy held by ``source`` (its node left); returns how many."""
        self._cursor.pop(source, None)
        self._asked.pop(source, None)
        idx = self._source_index.get(source)
        if idx is None:
            return 0
        dropped = 0
        for key in [k for k, v in self._blocks.items() if idx in _unpack(v)[2]]:
            self._remove(idx, key)
            dropped += 1
        del self._source_index[source]
        self._sources[idx] = None
        self._free_sources.append(idx)
        return dropped

    # -- queries -------------------------------------------------------------------------------

    def lookup(self, keys: Sequence[bytes]) -> list[list[Copy]]:
        self.lookups += 1
        out: list[list[Copy]] = []
        for key in keys:
            found = self._blocks.get(key)
            if found is None:
                out.append([])
                continue
            size, csum, srcs, _ = _unpack(found)
            out.append([self._copy(i, size, csum) for i in srcs])
        return out

    def find_copies(self, keys: bytes) -> CopyTable:
        """``lookup`` of the keys in ``keys`` (end to end, ``cmx.keys.split_keys``), as one table:
        the same copies in the same order, read from the records in bulk."""
        self.lookups += 1
        asked = split_keys(keys)
        records = list(map(self._blocks.get, asked, itertools.repeat(b"", len(asked))))
        words = np.frombuffer(b"".join(records), dtype="<u4")
        lengths = np.fromiter(map(len, records), np.int64, len(records)) // _SOURCE_BYTES
        head = _HEAD.size // _SOURCE_BYTES
        at = (np.cumsum(lengths) - lengths)[lengths > 0]  # each found record's first word
        counts = np.maximum(lengths - head, 0)
        found = counts[lengths > 0]
        first = np.repeat(at + head - (np.cumsum(found) - found), found)
        source = words[first + np.arange(len(first))]
        # checksum u64 (two words), size u32, namespace u32, then the sources: see _pack
        checksum = words[at].astype(np.uint64) | (words[at + 1].astype(np.uint64) << 32)
        used, place = np.unique(source, return_inverse=True)
        return CopyTable(tuple(self._place(int(i)) for i in used), counts,
                         place.astype(np.int64), np.repeat(words[at + 2].astype(np.int64), found),
                         np.repeat(checksum, found))

    def _place(self, idx: int) -> tuple[Tier, str]:
        source = self._sources[idx]
        assert source is not None, "a record lists a dropped source"  # check_integrity's rule
        return source.tier, source.node

    def _copy(self, idx: int, size: int, csum: int) -> Copy:
        tier, node = self._place(idx)
        return Copy(tier, node, size, csum)

    def namespace_blocks(self, namespace: str) -> list[tuple[bytes, list[Copy]]]:
        """Every block tagged with ``namespace``, and its copies; ``UnavailableError``
        while this shard may not know every source's (see the module docstring)."""
        now = self._clock()
        waiting = sorted(str(s) for s, until in self._asked.items() if until > now)
        if now < self._contacted_at or waiting:
            raise UnavailableError(
                f"directory shard {self.shard_id} is still learning its sources' copies "
                f"({'started' if not waiting else 'resyncing ' + ', '.join(waiting)}); "
                f"a namespace listed now could be short")
        idx = self._ns_index.get(namespace)
        if not idx:
            return []
        keys = [k for k, v in self._blocks.items() if _unpack(v)[3] == idx]
        return list(zip(keys, self.lookup(keys)))

    def pool_replicas(self, want: int) -> dict[str, int]:
        """Blocks with a copy in the pool, and how many have fewer than ``want`` pool copies."""
        pooled = under = 0
        pool_sources = {i for i, s in enumerate(self._sources)
                        if s is not None and s.tier is Tier.POOL}
        if pool_sources:
            for record in self._blocks.values():
                srcs = _unpack(record)[2]
                n = sum(1 for i in srcs if i in pool_sources)
                if n:
                    pooled += 1
                    under += n < want
        return {"blocks": pooled, "under_replicated": under}

    def sources(self) -> dict[str, tuple[str, int]]:
        return {str(s): c for s, c in self._cursor.items()}

    def __len__(self) -> int:
        return len(self._blocks)

    def stats(self) -> DirectoryStats:
        return DirectoryStats(
            shard=self.shard_id, blocks=len(self._blocks),
            copies=sum(len(_unpack(v)[2]) for v in self._blocks.values()),
            sources=len(self._cursor), source_slots=len(self._sources),
            resyncs=self.resyncs, lookups=self.lookups,
        )

    def check_integrity(self) -> None:
        live = {i for i, s in enumerate(self._sources) if s is not None}
        free = set(self._free_sources)
        if live & free or len(live) + len(free) != len(self._sources):
            raise AssertionError(f"source slots: {len(live)} live + {len(free)} free != "
                                 f"{len(self._sources)}, or a slot is both")
        if {self._source_index[s] for s in self._source_index} != live:
            raise AssertionError("the source index does not match the live source slots")
        for key, record in self._blocks.items():
            size, _, srcs, _ = _unpack(record)
            if not srcs:
                raise AssertionError(f"{key.hex()[:12]} is listed with no copies")
            if len(set(srcs)) != len(srcs):
                raise AssertionError(f"{key.hex()[:12]} lists a source twice: {srcs}")
            if not set(srcs) <= live:
                raise AssertionError(f"{key.hex()[:12]} lists dropped sources "
                                     f"{sorted(set(srcs) - live)}")
            if size <= 0:
                raise AssertionError(f"{key.hex()[:12]} has size {size}")

    # -- helpers -------------------------------------------------------------------------------

    def _index(self, source: Source) -> int:
        idx = self._source_index.get(source)
        if idx is not None:
            return idx
        if self._free_sources:
            idx = self._free_sources.pop()
            self._sources[idx] = source
        else:
            if len(self._sources) > _MAX_INDEX:
                raise OverflowError(f"directory shard {self.shard_id} follows "
                                    f"{len(self._sources)} sources, its most")
            idx = len(self._sources)
            self._sources.append(source)
        self._source_index[source] = idx
        return idx

    def _add(self, idx: int, entry: Entry) -> None:
        ns = self._ns_index.get(entry.namespace)
        if ns is None:
            if len(self._namespaces) > _MAX_INDEX:
                raise OverflowError(f"directory shard {self.shard_id} knows "
                                    f"{len(self._namespaces)} namespaces, its most")
            ns = self._ns_index[entry.namespace] = len(self._namespaces)
            self._namespaces.append(entry.namespace)
        record = self._blocks.get(entry.key)
        if record is None:
            self._blocks[entry.key] = _pack(entry.size, entry.checksum, (idx,), ns)
            return
        size, csum, srcs, old_ns = _unpack(record)
        if idx not in srcs or (ns and not old_ns):
            srcs = srcs if idx in srcs else (*srcs, idx)
            self._blocks[entry.key] = _pack(size, csum, srcs, old_ns or ns)

    def _remove(self, idx: int, key: bytes) -> None:
        record = self._blocks.get(key)
        if record is None:
            return
        size, csum, srcs, ns = _unpack(record)
        if idx not in srcs:
            return
        rest = tuple(i for i in srcs if i != idx)
        if rest:
            self._blocks[key] = _pack(size, csum, rest, ns)
        else:
            del self._blocks[key]


# A block's record: checksum u64, size u32, namespace index u32, then one u32 per source (a
# shard follows every tier of every node that ever joined and has not left, and every namespace
# it was told of, one per tenant salt: u16 ran out for both).
_HEAD = struct.Struct("<QII")
_SOURCE = "I"
_SOURCE_BYTES = struct.calcsize(_SOURCE)
_MAX_INDEX = (1 << (8 * _SOURCE_BYTES)) - 1


def _pack(size: int, csum: int, srcs: tuple[int, ...], ns: int) -> bytes:
    return _HEAD.pack(csum, size, ns) + struct.pack(f"<{len(srcs)}{_SOURCE}", *srcs)


def _unpack(record: bytes) -> tuple[int, int, tuple[int, ...], int]:
    csum, size, ns = _HEAD.unpack_from(record)
    n = (len(record) - _HEAD.size) // _SOURCE_BYTES
    return size, csum, struct.unpack_from(f"<{n}{_SOURCE}", record, _HEAD.size), ns
