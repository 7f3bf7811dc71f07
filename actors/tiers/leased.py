"""The calls that end a tier's pins, the same in every tier (``LeasedPins``), and the base that
answers them (``LeasedTier``): a tier says how it pins and how one pin of a key is undone, its
``Leases`` keep who holds what."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Generic, Protocol, TypeVar

from cmx.actors.tiers.leases import ADMIN, Leases, check_ttl
from cmx.keys import BlockHash

__all__ = ["Leased", "LeasedPins", "LeasedTier"]


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


class LeasedTier(Generic[P]):
    """A tier's calls that end its pins, answered by its ``leased``: the base of each tier,
    so that each names them once."""

    leased: LeasedPins[P]

    def pin_for(self, keys: Sequence[BlockHash], ttl_s: float, owner: str = ADMIN
                ) -> list[P | None]:
        return self.leased.pin_for(keys, ttl_s, owner)

    def unpin(self, leases: Iterable[int | BlockHash]) -> None:
        self.leased.unpin(leases)

    def release_owner(self, owner: str) -> int:
        return self.leased.release_owner(owner)

    def expire(self) -> int:
        return self.leased.expire()
