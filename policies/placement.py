"""Placement: which tiers a block is written to, when it is stored and when a tier evicts it.

A placement is a small pure decision object; the tier actors call it and do the writing.
``chain`` lists the tiers a stored block can live in, fastest first: the first is where stores
land (DRAM by default), each later one is where the one before demotes to.

- ``write_through``: a stored block goes to the first tier and, if admitted, to every lower
  tier at once. Loads from below never wait for a demotion; the slow tier sees more writes.
- ``write_back``: a stored block goes to the first tier only; it moves down one tier when
  evicted, if admitted by then. Fewer slow writes; a node that dies loses what was only above.

Both demote an admitted block on eviction if no lower copy exists (a write-through block that
was not yet admitted when stored, for one), so a block that became hot later is not lost.
"""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar

from cmx.tiers import Tier

__all__ = [
    "PLACEMENTS",
    "Placement",
    "PlacementPolicy",
    "WriteBack",
    "WriteThrough",
    "make_placement",
]

DEFAULT_CHAIN = (Tier.DRAM, Tier.NVME)


class Placement(str, enum.Enum):
    WRITE_THROUGH = "write_through"
    WRITE_BACK = "write_back"


@dataclass(frozen=True)
class PlacementPolicy(ABC):
    mode: ClassVar[Placement]

    chain: tuple[Tier, ...] = DEFAULT_CHAIN  # tiers a block can live in, fastest first

    def __post_init__(self) -> None:
        chain = tuple(Tier(t) for t in self.chain)
        if not chain:
            raise ValueError("placement chain is empty")
        if any(a.rank >= b.rank for a, b in zip(chain, chain[1:], strict=False)):
            raise ValueError(f"placement chain {[t.value for t in chain]} is not fastest-first")
        object.__setattr__(self, "chain", chain)

    @abstractmethod
    def on_store(self, admitted: bool) -> tuple[Tier, ...]:
        """Tiers to write a newly stored block to, fastest first; always the first tier."""

    def on_evict(self, tier: Tier, admitted: bool, *, has_lower_copy: bool) -> Tier | None:
        """Where a block ``tier`` evicts should go, or None to drop it.

        ``has_lower_copy``: a tier below already holds the block (no write needed).
        """
        below = self.below(tier)
        if below is None or not admitted or has_lower_copy:
            return None
        return below

    def below(self, tier: Tier) -> Tier | None:
        """The tier after ``tier`` in the chain, None for the last."""
        tier = Tier(tier)
        if tier not in self.chain:
            raise ValueError(f"tier {tier.value} is not in chain {[t.value for t in self.chain]}")
        i = self.chain.index(tier)
        return self.chain[i + 1] if i + 1 < len(self.chain) else None


@dataclass(frozen=True)
class WriteThrough(PlacementPolicy):
    mode = Placement.WRITE_THROUGH

    def on_store(self, admitted: bool) -> tuple[Tier, ...]:
        return self.chain if admitted else self.chain[:1]


@dataclass(frozen=True)
class WriteBack(PlacementPolicy):
    mode = Placement.WRITE_BACK

    def on_store(self, admitted: bool) -> tuple[Tier, ...]:
        return self.chain[:1]


# mode -> class; a new placement is a new class, a new Placement member and one line here.
PLACEMENTS: dict[Placement, type[PlacementPolicy]] = {
    Placement.WRITE_THROUGH: WriteThrough,
    Placement.WRITE_BACK: WriteBack,
}


def make_placement(name: str | Placement | PlacementPolicy = Placement.WRITE_THROUGH,
                   chain: tuple[Tier | str, ...] = DEFAULT_CHAIN) -> PlacementPolicy:
    """A placement by name (``"write_through"`` or ``"write_back"``) over ``chain``."""
    if isinstance(name, PlacementPolicy):
        return name
    try:
        cls = PLACEMENTS[Placement(name)]
    except ValueError:
        raise ValueError(
            f"unknown placement {name!r}; known: {sorted(p.value for p in PLACEMENTS)}"
        ) from None
    return cls(tuple(Tier(t) for t in chain))
