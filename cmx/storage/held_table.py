"""HeldTable: a memory tier's committed keys in shared memory, so a lookup on the same host is
answered without a round trip to the tier.

The tier is the only writer: it puts a key when the block commits and removes it when the
block goes (evicted, deleted, quarantined), under the lock its books change under, so the
table says what the tier's ``held`` would. Readers map the table by name and look keys up in
place; they never write.

Layout, in one slot of a ``SharedArena`` (its header names the owner, so a table whose tier
died is reaped with its arena)::

    [head: version, capacity, closed, longest probe, count][keys: capacity x 32 B]
    [state: capacity x u64, 0 empty, else size + 1][checksums: capacity x u64]

An open-addressed hash table with linear probing, at most half full; a removal shifts the
entries after it back (no tombstones), so a probe stops at the first empty entry. Each write
is framed by the version (odd while it runs, a seqlock): a reader takes the version, probes,
copies what it found and takes the version again; if a write ran in between it reads again,
and after ``READ_TRIES`` it gives up (None) and the caller asks the tier. A table the tier
closed, or filled past what it was sized for, answers None too.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from cmx.buffers import align_up
from cmx.keys import KEY_BYTES
from cmx.storage.arena import SharedArena

__all__ = ["READ_TRIES", "HeldTable"]

READ_TRIES = 16
_FEW = 512  # keys still probing past their home, probed to the end of their runs at once
_VERSION, _CAPACITY, _CLOSED, _PROBE, _COUNT = range(5)
_HEAD_WORDS = 8
_KEY_WORDS = KEY_BYTES // 8


def _capacity(num_keys: int) -> int:
    """Entries for ``num_keys``: a power of two at least twice as many (probes stay short)."""
    return max(64, 1 << (2 * max(num_keys, 1) - 1).bit_length())


class HeldTable:
    """What a tier holds committed: per key, (size, checksum). Use ``create`` (the tier) or
    ``attach`` (a reader)."""

    def __init__(self, arena: SharedArena) -> None:
        self.arena = arena
        words = arena.slot_view(0).view("<u8")
        self._head = words[:_HEAD_WORDS]
        cap = int(self._head[_CAPACITY])
        self.capacity = cap
        end = _HEAD_WORDS + cap * _KEY_WORDS
        self._keys = words[_HEAD_WORDS:end].reshape(cap, _KEY_WORDS)
        self._state = words[end : end + cap]
        self._sums = words[end + cap : end + 2 * cap]
        self._limit = cap // 2

    @classmethod
    def create(cls, name: str, num_keys: int) -> HeldTable:
        """A new, empty table sized for ``num_keys`` committed keys, owned by the caller."""
        cap = _capacity(num_keys)
        nbytes = align_up(8 * (_HEAD_WORDS + cap * (_KEY_WORDS + 2)))
        arena = SharedArena.create(nbytes, nbytes, name=name, populate=False)
        arena.slot_view(0).view("<u8")[_CAPACITY] = cap
        return cls(arena)

    @classmethod
    def attach(cls, name: str) -> HeldTable:
        """Map the table ``name`` a tier made (OSError if it is gone)."""
        return cls(SharedArena.attach(name))

    @property
    def name(self) -> str:
        return self.arena.name

    def __len__(self) -> int:
        return int(self._head[_COUNT])

    # -- the writer (one, under the tier's lock) -------------------------------------------------

    def put(self, key: bytes, size: int, checksum: int) -> None:
        """Hold ``key`` with its size and checksum (replacing what it had)."""
        if self._head[_CLOSED]:
            return
        q = _words(key)
        i, found = self._slot_of(q)
        if not found and int(self._head[_COUNT]) >= self._limit:
            self.close()  # more keys than the tier has slots: readers ask the tier from now
            return
        self._head[_VERSION] += 1
        try:
            if not found:
                self._keys[i] = q
                self._head[_COUNT] += 1
                distance = (i - self._home(q)) & (self.capacity - 1)
                self._head[_PROBE] = max(int(self._head[_PROBE]), distance + 1)
            self._state[i] = size + 1
            self._sums[i] = checksum
        finally:
            self._head[_VERSION] += 1

    def remove(self, key: bytes) -> None:
        """Hold ``key`` no more (nothing if it is not held)."""
        if self._head[_CLOSED]:
            return
        i, found = self._slot_of(_words(key))
        if not found:
            return
        mask = self.capacity - 1
        self._head[_VERSION] += 1
        try:
            self._state[i] = 0
            j = i
            while True:  # shift back each later entry of the run whose home is not in (i, j]
                j = (j + 1) & mask
                if not self._state[j]:
                    break
                home = self._home(self._keys[j])
                if (j - home) & mask >= (j - i) & mask:
                    self._keys[i], self._state[i], self._sums[i] = (
                        self._keys[j], self._state[j], self._sums[j])
                    self._state[j] = 0
                    i = j
            self._head[_COUNT] -= 1
        finally:
            self._head[_VERSION] += 1

    def close(self) -> None:
        """Readers get None from now on (they ask the tier)."""
        self._head[_VERSION] += 1
        self._head[_CLOSED] = 1
        self._head[_VERSION] += 1

    def unlink(self) -> None:
        """Close for readers, unmap and remove the name (the owner, once)."""
        if not self.arena.closed:
            self.close()
            self.arena.unlink()

    # -- readers ---------------------------------------------------------------------------------

    def find(self, keys: Sequence[bytes]) -> list[tuple[int, int] | None] | None:
        """Per key, (size, checksum) if held, else None; None for the whole answer when the
        table is closed or kept changing under every try (ask the tier)."""
        found = self.find_columns(b"".join(keys))
        if found is None:
            return None
        held, sizes, sums = found
        return [(int(s), int(c)) if h else None
                for h, s, c in zip(held.tolist(), sizes.tolist(), sums.tolist())]

    def find_columns(self, keys: bytes) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
        """``find`` of the keys in ``keys`` (end to end, ``cmx.keys.split_keys``) as columns:
        held (bool), size (int64) and checksum (uint64) per key, 0 where not held; None as
        ``find``."""
        q = np.frombuffer(keys, dtype="<u8").reshape(-1, _KEY_WORDS)
        if not len(q):
            return np.zeros(0, bool), np.zeros(0, np.int64), np.zeros(0, np.uint64)
        for _ in range(READ_TRIES):
            version = int(self._head[_VERSION])
            if self._head[_CLOSED]:
                return None
            if version & 1:
                continue
            longest = min(int(self._head[_PROBE]), self.capacity) if self._head[_COUNT] else 0
            at = self._probe(q, longest)
            hit = at >= 0
            entry = np.maximum(at, 0)
            sizes = np.where(hit, self._state.take(entry), 0)
            sums = np.where(hit, self._sums.take(entry), 0)
            if int(self._head[_VERSION]) != version:
                continue
            held = sizes != 0
            return held, np.where(held, sizes.astype(np.int64) - 1, 0), sums.astype(np.uint64)
        return None

    def _probe(self, q: np.ndarray, longest: int) -> np.ndarray:
        """Each key's entry, or -1: all keys probed together, one step of every run a pass;
        once ``_FEW`` or fewer go on, the rest of their runs in one (a pass costs numpy's
        overhead whatever its keys)."""
        mask = self.capacity - 1
        at = np.full(len(q), -1, dtype=np.int64)
        live = np.arange(len(q))
        pos = (q[:, 0] & np.uint64(mask)).astype(np.int64)
        for step in range(longest):
            mine = q if not step else q[live]
            if step and live.size <= _FEW:
                window = (pos[:, None] + np.arange(longest - step)) & mask
                # an entry counts up to the run's end: the first empty entry
                hit = (np.cumsum(self._state.take(window) == 0, axis=1) == 0) & \
                    _same(self._keys.take(window, axis=0), mine[:, None, :])
                found = hit.any(axis=1)
                at[live[found]] = window[found, hit[found].argmax(axis=1)]
                break
            full = self._state.take(pos) != 0
            hit = full & _same(self._keys.take(pos, axis=0), mine)
            at[live[hit] if step else hit] = pos[hit]
            going = full & ~hit
            live, pos = live[going], (pos[going] + 1) & mask
            if not live.size:
                break
        return at

    def _slot_of(self, q: np.ndarray) -> tuple[int, bool]:
        """Where ``q`` is (True), or the empty entry its probe ends at (False)."""
        mask = self.capacity - 1
        i = self._home(q)
        while self._state[i]:
            if (self._keys[i] == q).all():
                return i, True
            i = (i + 1) & mask
        return i, False

    def _home(self, q: np.ndarray) -> int:
        return int(q[0]) & (self.capacity - 1)


def _same(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Whether keys ``a`` and ``b`` (their last axis the words) are the same, word by word
    (numpy's ``all`` over an axis this short costs twice as much)."""
    same = a[..., 0] == b[..., 0]
    for w in range(1, _KEY_WORDS):
        same &= a[..., w] == b[..., w]
    return same


def _words(key: bytes) -> np.ndarray:
    return np.frombuffer(key, dtype="<u8", count=_KEY_WORDS)
