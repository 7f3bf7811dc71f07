"""Admission to the slow tiers: is a block worth an NVMe (or pool) write?

The NVMe write path is the slow side of the hierarchy, so only blocks seen more than once earn
a place there (Dynamo KVBM offloads a block once it has been seen twice; SGLang HiCache's
``write_through_selective`` does the same with hit counts).

Protocol, in call order: the tier calls ``record(key)`` every time it sees a block (a store or
a lookup), then ``admit(key)`` when it decides whether to write the block below. ``admit``
never changes the counts. Policies hold bounded memory whatever the number of keys.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, ClassVar

import numpy as np
import xxhash

__all__ = [
    "ADMISSION_POLICIES",
    "AdmissionPolicy",
    "AlwaysAdmit",
    "FrequencyAdmission",
    "make_admission",
]


class AdmissionPolicy(ABC):
    name: ClassVar[str]

    @abstractmethod
    def record(self, key: bytes) -> None:
        """Count one sighting of ``key``: a store or a lookup."""

    @abstractmethod
    def admit(self, key: bytes) -> bool:
        """Whether ``key`` deserves a slow-tier write now. Pure: counts nothing."""

    def check_integrity(self) -> None:  # noqa: B027 - optional: stateless policies keep no books
        """Raise AssertionError with the numbers if the books disagree."""


class AlwaysAdmit(AdmissionPolicy):
    """Every block is admitted (write-through of everything)."""

    name = "always"

    def record(self, key: bytes) -> None:
        pass

    def admit(self, key: bytes) -> bool:
        return True


class FrequencyAdmission(AdmissionPolicy):
    """Admit a key seen at least ``min_count`` times, counted in a count-min sketch.

    ``depth`` rows of ``capacity`` saturating 8-bit counters (``depth * capacity`` bytes). A
    sketch can over-count a key that collides with others in every row, never under-count;
    conservative update (raise only the rows at the minimum) keeps over-counting rare. Every
    ``10 * capacity`` records all counters are halved, so old popularity fades.
    """

    name = "frequency"

    def __init__(self, min_count: int = 2, capacity: int = 1 << 16, depth: int = 4) -> None:
        for label, value in (("min_count", min_count), ("capacity", capacity), ("depth", depth)):
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"{label} must be a positive int, got {value!r}")
        if min_count > 255:
            raise ValueError(f"min_count must be at most 255 (8-bit counters), got {min_count}")
        if depth > 8:
            raise ValueError(f"depth must be at most 8, got {depth}")
        self.min_count = min_count
        self.capacity = capacity
        self.depth = depth
        self._table = np.zeros((depth, capacity), dtype=np.uint8)
        self._flat = self._table.reshape(-1).data  # cell ``row * capacity + column``
        self._records = 0  # since the last halving
        self._reset_every = 10 * capacity
        self.halvings = 0

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        del state["_flat"]  # a view of ``_table``, made again on arrival
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._flat = self._table.reshape(-1).data

    def _cells(self, key: bytes) -> list[int]:
        # Two 64-bit hashes make ``depth`` (Kirsch-Mitzenmacher). h2 is odd, so with a
        # power-of-two capacity no two rows of one key share a column. Plain ints: one key's
        # few cells cost less in Python than in numpy's indexing.
        digest = xxhash.xxh3_128_intdigest(key if type(key) is bytes else bytes(key))
        h1, h2, cap = digest & (2**64 - 1), (digest >> 64) | 1, self.capacity
        return [row * cap + (h1 + row * h2) % cap for row in range(self.depth)]

    def count(self, key: bytes) -> int:
        """Estimated sightings of ``key`` (never fewer than the true count since a halving)."""
        flat = self._flat
        return min([flat[i] for i in self._cells(key)])

    def record(self, key: bytes) -> None:
        flat, cells = self._flat, self._cells(key)
        values = [flat[i] for i in cells]
        low = min(values)
        if low < 255:
            for i, v in zip(cells, values, strict=True):
                if v == low:  # conservative update: only the rows at the minimum
                    flat[i] = low + 1
        self._records += 1
        if self._records >= self._reset_every:
            self._table >>= 1  # in place: ``_flat`` still views it
            self._records = 0
            self.halvings += 1

    def admit(self, key: bytes) -> bool:
        return self.count(key) >= self.min_count

    def check_integrity(self) -> None:
        if self._table.shape != (self.depth, self.capacity):
            raise AssertionError(f"sketch is {self._table.shape}, "
                                 f"expected ({self.depth}, {self.capacity})")
        if not 0 <= self._records < self._reset_every:
            raise AssertionError(f"{self._records} records since halving, "
                                 f"halving every {self._reset_every}")


# name -> class; a new policy is a new class and one line here.
ADMISSION_POLICIES: dict[str, type[AdmissionPolicy]] = {
    AlwaysAdmit.name: AlwaysAdmit,
    FrequencyAdmission.name: FrequencyAdmission,
}


def make_admission(name: str | AdmissionPolicy = "frequency", **kwargs: Any) -> AdmissionPolicy:
    """A fresh policy by registry name with its keyword arguments (or ``name`` if a policy)."""
    if isinstance(name, AdmissionPolicy):
        return name
    try:
        cls = ADMISSION_POLICIES[name]
    except KeyError:
        raise ValueError(
            f"unknown admission policy {name!r}; known: {sorted(ADMISSION_POLICIES)}"
        ) from None
    return cls(**kwargs)
