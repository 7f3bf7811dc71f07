"""``LeasedPins``, the calls that end a tier's leases, held by each tier: given the tier's
leases, how it pins and how it undoes one pin of a key. A scenario over a fake clock and a
stand-in tier that counts its pins per key."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

import pytest

from cmx.actors.tiers.leased import LeasedPins
from cmx.actors.tiers.leases import ADMIN, LeaseKind, Leases
from cmx.keys import BlockHash

K1, K2 = BlockHash(b"\x01" * 32), BlockHash(b"\x02" * 32)


@dataclass(frozen=True)
class Pin:
    key: BlockHash
    lease: int


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class CountingTier:
    """Pins what it holds (``K1``), each pin a lease that unpins when it ends."""

    def __init__(self, clock: Clock) -> None:
        self.pins: Counter[BlockHash] = Counter()
        self.leases = Leases(10.0, clock)
        self.leased = LeasedPins[Pin](self.leases, self.pin, self.unpin_key)

    def pin(self, keys: Sequence[BlockHash], owner: str) -> list[Pin | None]:
        out: list[Pin | None] = []
        for key in keys:
            if key != K1:
                out.append(None)
                continue
            self.pins[key] += 1
            out.append(Pin(key, self.leases.grant(owner, LeaseKind.PIN, key,
                                                  self.leased.unpin_later(key))))
        return out

    def unpin_key(self, key: BlockHash) -> None:
        self.pins[key] -= 1


def test_an_operators_pin_lasts_its_ttl_and_ends_by_key() -> None:
    clock = Clock()
    tier = CountingTier(clock)
    pins = tier.leased.pin_for([K1, K2], ttl_s=100.0)
    assert [p is not None for p in pins] == [True, False] and tier.pins[K1] == 1
    clock.now = 50.0  # past the tier's lease time, within the pin's TTL
    assert tier.leased.expire() == 0 and tier.pins[K1] == 1
    tier.leased.unpin([K1])  # an operator's pin ends by key
    assert tier.pins[K1] == 0 and len(tier.leases) == 0


def test_a_pin_nobody_ends_is_taken_back_at_expiry_or_with_its_owner() -> None:
    clock = Clock()
    tier = CountingTier(clock)
    tier.leased.pin_for([K1], ttl_s=5.0, owner=f"{ADMIN}:one")
    tier.pin([K1], "client:two")
    assert tier.leased.release_owner("client:two") == 1 and tier.pins[K1] == 1
    clock.now = 6.0
    assert tier.leased.expire() == 1 and tier.pins[K1] == 0


@pytest.mark.parametrize(("ttl_s", "owner"), [(0.0, ADMIN), (1e9, ADMIN), (5.0, "client:x")])
def test_a_bad_ttl_or_owner_pins_nothing(ttl_s: float, owner: str) -> None:
    tier = CountingTier(Clock())
    with pytest.raises(ValueError):
        tier.leased.pin_for([K1], ttl_s, owner)
    assert tier.pins[K1] == 0 and len(tier.leases) == 0
