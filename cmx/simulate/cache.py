"""One tier of one simulated node: capacity in bytes, resident blocks, pins, eviction.

The eviction order is the service's own policy object (``cmx.policies.make_eviction``), fed
the same protocol the stores feed it: ``insert`` with the parent key, ``touch`` on a hit,
``victims`` when space is needed (pinned blocks skipped), ``remove`` when a block leaves.
A simulated block is an *extent*: ``unit`` tokens of one prefix, many of the service's blocks
at once, so a 1M-token context is tens of keys, not thousands.
"""

from __future__ import annotations

from cmx.policies.eviction import EvictionPolicy, make_eviction

__all__ = ["TierCache"]


class TierCache:
    __slots__ = ("name", "capacity", "used", "sizes", "pins", "policy", "bytes_in", "bytes_out",
                 "hits", "evictions", "_evictable")

    def __init__(self, name: str, capacity_bytes: int, eviction: str = "lru") -> None:
        if capacity_bytes < 0:
            raise ValueError(f"{name}: capacity must be >= 0, got {capacity_bytes}")
        self.name = name
        self.capacity = capacity_bytes
        self.used = 0
        self.sizes: dict[bytes, int] = {}
        self.pins: dict[bytes, int] = {}
        self.policy: EvictionPolicy = make_eviction(eviction)
        self.bytes_in = 0  # committed into this tier
        self.bytes_out = 0  # left it: evicted or removed
        self.hits = 0
        self.evictions = 0
        pins = self.pins
        self._evictable = lambda key: key not in pins  # what the policy may offer

    def __contains__(self, key: bytes) -> bool:
        return key in self.sizes

    def touch(self, key: bytes) -> None:
        self.hits += 1
        self.policy.touch(key)

    def pin(self, key: bytes) -> None:
        self.pins[key] = self.pins.get(key, 0) + 1

    def unpin(self, key: bytes) -> None:
        left = self.pins[key] - 1
        if left:
            self.pins[key] = left
        else:
            del self.pins[key]

    def insert(self, key: bytes, parent: bytes | None, size: int) -> list[bytes] | None:
        """Commit ``key``; returns the keys evicted to make room, or None (and changes nothing)
        if it cannot fit because what is resident is pinned."""
        sizes, policy = self.sizes, self.policy
        if key in sizes:
            policy.touch(key)
            return []
        if size > self.capacity:
            return None
        need = self.used + size - self.capacity
        victims: list[bytes] = []
        if need > 0:
            freed = 0
            for victim in policy.victims(self._evictable):
                victims.append(victim)
                freed += sizes[victim]
                if freed >= need:
                    break
            if freed < need:
                return None
            for victim in victims:
                self.used -= sizes.pop(victim)
                policy.remove(victim)
            self.bytes_out += freed
            self.evictions += len(victims)
        sizes[key] = size
        self.used += size
        self.bytes_in += size
        policy.insert(key, parent)
        return victims

    def remove(self, key: bytes) -> None:
        size = self.sizes.pop(key, None)
        if size is None:
            return
        self.used -= size
        self.bytes_out += size
        self.policy.remove(key)

    def check_integrity(self) -> None:
        total = sum(self.sizes.values())
        if total != self.used:
            raise AssertionError(f"{self.name}: used {self.used} != sum of blocks {total}")
        if self.used > self.capacity:
            raise AssertionError(f"{self.name}: used {self.used} > capacity {self.capacity}")
        if self.bytes_in - self.bytes_out != self.used:
            raise AssertionError(f"{self.name}: in {self.bytes_in} - out {self.bytes_out} "
                                 f"!= used {self.used}")
        if len(self.policy) != len(self.sizes):
            raise AssertionError(f"{self.name}: policy holds {len(self.policy)} keys, "
                                 f"tier {len(self.sizes)}")
        if any(k not in self.sizes for k in self.pins):
            raise AssertionError(f"{self.name}: a pinned key is not resident")
        self.policy.check_integrity()
