"""A pool node's rebalance: each block it holds ends up on its owners, and only there.

Rendezvous hashing (``policies.rendezvous``) names the ``replicas`` owners of each block among
the live pool members. A node's ``rebalance(members, replicas)`` first pushes each block it holds
to the owners that lack it (they pull it and check its checksum on the way in), then trims:
each block it holds but does not own is surplus, and it drops its copy only once every owner
answers that it holds a copy of the same checksum (``confirmed``). An owner that does not
answer confirms nothing, so the last copy of a block is never the one dropped. A surplus copy
pinned by a reader at that moment stays, listed in ``SurplusCopies``, and goes when its pin
ends (the reader's unstage, or the node's next heartbeat); a block offered to the node again
in the meantime is wanted again and stays.

Each rebalance carries the generation of its membership view (the controller's, larger for a
later view). Ray delivers a rebalance late or out of order, so two nodes may trim under
different views, each dropping its copy on the other's word. A node therefore trims only under
the newest generation it has seen, and confirms copies only to a rebalance of that generation;
a rebalance or a confirmation of a newer one forgets the drops listed under older views. The
checks and the drops hold one lock (``SurplusCopies``): a node's answer about a copy and its
drop of that copy are in one order.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from cmx.doors import Checksums
from cmx.errors import BlockStateError
from cmx.keys import BlockHash
from cmx.links import actor_name
from cmx.policies.rendezvous import owners
from cmx.storage.dram import DramStore
from cmx.storage.nvme.extents import ExtentBooks

__all__ = ["Rebalanced", "SurplusCopies", "confirmed", "placement"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Rebalanced:
    """What one pool node's rebalance did."""

    pushed: int  # blocks copied to owners that lacked them
    dropped: int  # copies dropped here, each of their owners holding one of the same checksum
    deferred: int  # surplus copies still held by a pin here: they go when it ends


def placement(
    keys: Iterable[BlockHash], members: Sequence[str], replicas: int, node: str
) -> tuple[dict[str, list[BlockHash]], list[BlockHash]]:
    """For the blocks ``node`` holds: the keys each other owner should hold, and the keys
    ``node`` holds without owning them (none while the pool has no members)."""
    want: dict[str, list[BlockHash]] = {}
    surplus: list[BlockHash] = []
    for key in keys:
        chosen = owners(key, members, replicas)
        for owner in chosen:
            if owner != node:
                want.setdefault(owner, []).append(key)
        if chosen and node not in chosen:
            surplus.append(key)
    return want, surplus


def confirmed(link: Any, sums: dict[BlockHash, int], members: Sequence[str],
              replicas: int, generation: int = 0) -> list[BlockHash]:
    """The keys of ``sums`` every owner of which holds a copy of checksum ``sums[key]``
    (``PoolNodeService.checksums``) in the view of ``generation``; an owner that fails to
    answer, or has seen a newer view, confirms none of its."""
    by_owner: dict[str, list[BlockHash]] = {}
    for key in sums:
        for owner in owners(key, members, replicas):
            by_owner.setdefault(owner, []).append(key)
    good = {key: bool(by_owner) for key in sums}
    for owner, keys in by_owner.items():
        try:
            held = list(link.call(actor_name("pool", owner),
                                  Checksums(keys=keys, generation=generation)))
        except Exception as exc:  # noqa: BLE001 - an owner that cannot say confirms nothing
            log.warning("rebalance: %s did not confirm its copies: %s", owner[:8], exc)
            held = [None] * len(keys)
        for key, csum in zip(keys, held, strict=True):
            good[key] = good[key] and csum is not None and csum == sums[key]
    return [key for key, ok in good.items() if ok]


class SurplusCopies:
    """Copies a pool node holds past their owners, each confirmed on all of them: dropped from
    its NVMe store and its staging cache where unpinned; one pinned stays listed until it is
    dropped (``retry``) or wanted again (``keep``). ``announce`` makes a drop durable and tells
    the directory. Drops are listed under the newest rebalance generation seen (``advance``);
    a newer one forgets them."""

    def __init__(self, store: ExtentBooks, staging: DramStore,
                 announce: Callable[[], None]) -> None:
        self.store = store
        self.staging = staging
        self.announce = announce
        self._lock = threading.Lock()
        self._keys: set[BlockHash] = set()
        self._generation = 0  # the newest rebalance generation seen here

    def advance(self, generation: int) -> bool:
        """Note a rebalance (or a confirmation asked by one) of ``generation``; whether it is
        the newest seen here. A newer one forgets the copies listed to drop: their owners were
        confirmed under a membership that has changed since."""
        with self._lock:
            if generation < self._generation:
                return False
            if generation > self._generation:
                self._generation = generation
                self._keys.clear()
            return True

    def drop(self, keys: Iterable[BlockHash], generation: int = 0) -> int:
        """Drop these copies, confirmed under ``generation``, or list them to drop once
        unpinned; how many left the store. Under an older generation than the newest seen
        here, nothing is dropped."""
        keys = list(keys)
        with self._lock:
            if generation != self._generation:
                return 0
            self._keys.update(keys)
        return self.retry(keys)

    def retry(self, keys: Iterable[BlockHash] | None = None) -> int:
        """Drop the listed copies (of ``keys``, or all) no pin holds now; how many left the
        store. A key stays listed while either copy of it is still here."""
        gone = 0
        with self._lock:
            for key in list(self._keys if keys is None else self._keys.intersection(keys)):
                try:
                    self.staging.delete(key)
                except BlockStateError:
                    pass  # a reader holds the staged copy: it goes with that pin
                gone += self.store.delete_unpinned([key])
                if key not in self.store and key not in self.staging:
                    self._keys.discard(key)
        if gone:
            self.announce()
        return gone

    def keep(self, keys: Iterable[BlockHash]) -> None:
        """These blocks are offered here again: whatever copy of them is here stays."""
        with self._lock:
            self._keys.difference_update(keys)

    def __contains__(self, key: object) -> bool:
        with self._lock:
            return key in self._keys

    def __len__(self) -> int:
        with self._lock:
            return len(self._keys)
