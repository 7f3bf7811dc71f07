"""BlockIndex: which blocks are committed, where they lie, who pins them, what goes first.

It owns the entries (key -> BlockEntry, oldest first), the pin counts, the keys being
written, the eviction policy and the record sequence numbers. It does no I/O and takes no
lock: ``NvmeBooks`` calls it under the books' lock.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace

from cmx.errors import BlockStateError
from cmx.policies import EvictionPolicy
from cmx.storage.nvme.entry import BlockEntry

__all__ = ["BlockIndex"]


class BlockIndex:
    def __init__(self, policy: EvictionPolicy) -> None:
        self.policy = policy
        self.entries: dict[bytes, BlockEntry] = {}  # committed blocks, oldest first
        self.pins: dict[bytes, int] = {}
        self.reserving: set[bytes] = set()  # keys whose write is in flight
        self.next_seq = 1  # the sequence number of the next record

    def load(self, entries: dict[bytes, BlockEntry], next_seq: int) -> None:
        """Take the entries a reopen recovered."""
        self.entries = entries
        self.next_seq = next_seq
        for entry in entries.values():
            self.policy.insert(entry.key, entry.parent)

    # -- questions -----------------------------------------------------------------------------

    def get(self, key: bytes) -> BlockEntry | None:
        return self.entries.get(key)

    def __contains__(self, key: object) -> bool:
        return key in self.entries

    def __len__(self) -> int:
        return len(self.entries)

    def __iter__(self) -> Iterator[bytes]:
        return iter(self.entries)

    def taken(self, key: bytes) -> bool:
        """Stored, or being stored."""
        return key in self.entries or key in self.reserving

    def pinned(self, key: bytes) -> int:
        return self.pins.get(key, 0)

    @property
    def pinned_blocks(self) -> int:
        return sum(1 for k in self.pins if k in self.entries)

    def victims(self) -> Iterator[bytes]:
        """Unpinned committed keys in the policy's eviction order."""
        return self.policy.victims(self._evictable)

    def _evictable(self, key: bytes) -> bool:
        return key in self.entries and not self.pins.get(key)

    # -- changes -------------------------------------------------------------------------------

    def commit(self, entry: BlockEntry) -> BlockEntry:
        """Insert a written block under the next sequence number; the entry as committed."""
        entry = replace(entry, seq=self.next_seq)
        self.next_seq += 1
        self.entries[entry.key] = entry
        self.policy.insert(entry.key, entry.parent)
        return entry

    def move(self, entry: BlockEntry, seg: int, offset: int) -> BlockEntry:
        """The block now lies at (seg, offset), under a new sequence number."""
        moved = entry.moved(seg, offset, self.next_seq)
        self.next_seq += 1
        self.entries[entry.key] = moved
        return moved

    def unmove(self, moved: BlockEntry, source: BlockEntry) -> None:
        """The block lies at ``source`` again: its move to ``moved`` did not become durable."""
        assert self.entries.get(moved.key) is moved
        self.entries[moved.key] = source

    def retag(self, entry: BlockEntry, tag: str) -> BlockEntry:
        """The block, where it lies, recorded anew with ``tag`` under a new sequence number;
        its place in recency order kept."""
        tagged = replace(entry, seq=self.next_seq, tag=tag)
        self.next_seq += 1
        self.entries[entry.key] = tagged
        return tagged

    def remove(self, entry: BlockEntry) -> None:
        del self.entries[entry.key]
        self.policy.remove(entry.key)

    def pin(self, key: bytes) -> bool:
        if key not in self.entries:
            return False
        self.pins[key] = self.pins.get(key, 0) + 1
        return True

    def unpin(self, key: bytes) -> None:
        count = self.pins.get(key, 0)
        if count == 0:
            raise BlockStateError(f"unpin of {key.hex()[:12]}, which is not pinned")
        if count == 1:
            del self.pins[key]
        else:
            self.pins[key] = count - 1

    def check(self) -> None:
        """Raise AssertionError with the numbers if entries, policy and pins disagree."""
        if len(self.policy) != len(self.entries):
            raise AssertionError(f"policy holds {len(self.policy)}, index {len(self.entries)}")
        missing = [k for k in self.entries if k not in self.policy]
        if missing:
            raise AssertionError(f"{len(missing)} indexed keys unknown to the policy")
        if any(n <= 0 for n in self.pins.values()):
            raise AssertionError(f"non-positive pin counts: {sorted(self.pins.values())}")
        self.policy.check_integrity()
