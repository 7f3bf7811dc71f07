"""The copies of many keys as columns, with no object per key: the directory's answer to a
lookup (``FindCopies``), what this node's tiers hold of a prefix, and a lookup's blocks. A
million-token prefix is 62,500 keys; a ``Copy`` each would cost more than hashing them.

Key ``i``'s copies are the rows ``starts[i]:starts[i] + counts[i]``, in the order their source
listed them (the directory's: the order the copies were made; this node's tiers: DRAM's, then
HBM's). Each row names its place (a tier on a node: an index into ``places``), its size and its
checksum. ``copies(i)`` gives key ``i``'s as the ``Copy`` objects of ``cmx.protocol``, made when
asked, so a table says exactly what the lists of copies it stands for say.

``best(node)`` is ``cmx.protocol.best_copy``'s rule over the rows (its ``preference``): a copy
on ``node`` before any other, then the fastest tier, the first listed among equals.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property

import numpy as np

from cmx.protocol import Copy, preference
from cmx.tiers import Tier

__all__ = ["CopyTable", "Place"]

Place = tuple[Tier, str]  # a tier on a node


@dataclass(frozen=True, eq=False)
class CopyTable:
    places: tuple[Place, ...]  # the (tier, node) each row's ``place`` indexes
    counts: np.ndarray  # int64 [keys]: each key's copies; 0: none known
    place: np.ndarray  # int64 [rows]: where each copy is
    size: np.ndarray  # int64 [rows]: its size in bytes
    checksum: np.ndarray  # uint64 [rows]: its checksum

    @classmethod
    def empty(cls, keys: int = 0) -> CopyTable:
        """``keys`` keys with no copy known."""
        none = np.zeros(0, np.int64)
        return cls((), np.zeros(keys, np.int64), none, none, np.zeros(0, np.uint64))

    @classmethod
    def of(cls, lists: Sequence[Sequence[Copy]]) -> CopyTable:
        """The table of per-key lists of copies (a tier's or a shard's classic answer)."""
        index: dict[Place, int] = {}
        rows = [(index.setdefault((c.tier, c.node), len(index)), c.size, c.checksum)
                for copies in lists for c in copies]
        place, size, checksum = zip(*rows) if rows else ((), (), ())
        return cls(tuple(index), np.array([len(c) for c in lists], np.int64),
                   np.array(place, np.int64), np.array(size, np.int64),
                   np.array(checksum, np.uint64))

    def __len__(self) -> int:
        return len(self.counts)

    @cached_property
    def starts(self) -> np.ndarray:
        """Each key's first row."""
        return np.cumsum(self.counts) - self.counts

    def copies(self, i: int) -> list[Copy]:
        """Key ``i``'s copies, in their order."""
        lo = int(self.starts[i])
        hi = lo + int(self.counts[i])
        return [Copy(self.places[p][0], self.places[p][1], s, c) for p, s, c in zip(
            self.place[lo:hi].tolist(), self.size[lo:hi].tolist(),
            self.checksum[lo:hi].tolist())]

    def lists(self) -> list[list[Copy]]:
        return [self.copies(i) for i in range(len(self))]

    def prefix(self) -> int:
        """How many leading keys have a copy."""
        missing = np.flatnonzero(self.counts == 0)
        return int(missing[0]) if missing.size else len(self)

    def head(self, keys: int) -> CopyTable:
        """The first ``keys`` keys."""
        rows = int(self.counts[:keys].sum())
        return CopyTable(self.places, self.counts[:keys], self.place[:rows], self.size[:rows],
                         self.checksum[:rows])

    def take(self, keys: np.ndarray) -> CopyTable:
        """The keys at the indices ``keys``, in that order."""
        counts = self.counts[keys]
        rows = _rows(self.starts[keys], counts)
        return CopyTable(self.places, counts, self.place[rows], self.size[rows],
                         self.checksum[rows])

    def where(self, keep: np.ndarray) -> CopyTable:
        """The rows where ``keep`` (a bool per row) holds: each key keeps its others."""
        key_of_row = np.repeat(np.arange(len(self)), self.counts)
        counts = np.bincount(key_of_row[keep], minlength=len(self)).astype(np.int64)
        return CopyTable(self.places, counts, self.place[keep], self.size[keep],
                         self.checksum[keep])

    @staticmethod
    def stack(tables: Sequence[CopyTable]) -> CopyTable:
        """The keys of ``tables``, one table after the other; places told apart by value."""
        if len(tables) == 1:
            return tables[0]
        index: dict[Place, int] = {}
        places = [np.array([index.setdefault(p, len(index)) for p in t.places] or [0],
                           np.int64)[t.place] for t in tables]
        return CopyTable(
            tuple(index), np.concatenate([t.counts for t in tables] or [np.zeros(0, np.int64)]),
            np.concatenate(places or [np.zeros(0, np.int64)]),
            np.concatenate([t.size for t in tables] or [np.zeros(0, np.int64)]),
            np.concatenate([t.checksum for t in tables] or [np.zeros(0, np.uint64)]))

    @staticmethod
    def merge(parts: Sequence[tuple[np.ndarray, CopyTable]], keys: int) -> CopyTable:
        """One table of ``keys`` keys from parts that each answer some of them: ``(at,
        table)``, key ``at[j]`` having ``table``'s key ``j``. A key no part answers has no
        copy (a shard that did not answer: a miss)."""
        at = np.concatenate([a for a, _ in parts] + [np.zeros(0, np.int64)])
        answered = np.zeros(keys, bool)
        answered[at] = True
        unanswered = np.flatnonzero(~answered)
        stacked = CopyTable.stack([t for _, t in parts] + [CopyTable.empty(len(unanswered))])
        order = np.empty(keys, np.int64)
        order[np.concatenate([at, unanswered])] = np.arange(keys)
        return stacked.take(order)

    def best(self, node: str) -> np.ndarray:
        """Per key, the row of the copy a reader on ``node`` should use (``best_copy``'s
        rule); -1 for a key with none."""
        if len(self.place) == len(self) and (self.counts == 1).all():
            return np.arange(len(self), dtype=np.int64)  # one copy a key: it is the best
        out = np.full(len(self), -1, np.int64)
        has = np.flatnonzero(self.counts)
        if not has.size:
            return out
        order = [preference(t, n, node) for t, n in self.places]
        ranked = sorted(set(order))  # each place's preference as its place in this order
        score = np.array([ranked.index(p) for p in order], np.int64)[self.place]
        starts = self.starts[has]
        within = np.arange(len(self.place)) - np.repeat(self.starts, self.counts)
        widest = int(self.counts.max())
        first = np.minimum.reduceat(score * widest + within, starts) % widest
        out[has] = starts + first
        return out


def _rows(starts: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """The rows ``starts[i]:starts[i] + counts[i]`` of every ``i``, end to end."""
    total = int(counts.sum())
    begin = np.cumsum(counts) - counts
    return np.repeat(starts - begin, counts) + np.arange(total, dtype=np.int64)
