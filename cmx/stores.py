"""A store on this node: the engine's KV copied once, straight into DRAM slots granted to it.

Protocol, per window of half the DRAM tier (so a store larger than DRAM streams through it):

1. ``agent.grant_store(keys, parents, owner)``: DRAM slots reserved for the store's owner
   (leases: a writer that dies gives them back when they expire), what they evict already
   demoted. None for a block already stored or with no room.
2. The writer copies each block from the engine's layout into its slot's payload order, in
   the arena of the grant's epoch (``arena_name``): one strided copy, no object store. A DRAM
   tier that restarted since has unlinked that arena (the copy fails), or, if it was mapped
   here before, the copy lands in memory no tier uses and its commit is refused.
3. ``agent.commit_store(keys, parents, done)``: committed and visible to lookups, then written
   through to NVMe and the pool as placement and admission say. The last window's commit
   goes on behind ``StoreHandle``; an earlier one is waited for, as the next window's grants
   may evict its blocks.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from cmx.checksum import checksum
from cmx.keys import BlockHash
from cmx.layout import KVLayout
from cmx.protocol import actor_name, arena_name
from cmx.tiers import Tier

__all__ = ["StoreHandle", "StoreTimes", "store_into_dram"]


@dataclass(frozen=True)
class StoreTimes:
    """Where a store's time went on the writer's side, in seconds."""

    grant_and_copy_s: float  # asking for DRAM slots, copying the KV into them, checksums
    commit_wait_s: float  # waiting for an earlier window's commit (and its write-through)


class StoreHandle:
    """An asynchronous store; ``wait()`` returns once the blocks are committed and visible."""

    def __init__(self, ref: Any, num_blocks: int, timeout_s: float, committed: int = 0,
                 link: Any = None, times: StoreTimes = StoreTimes(0.0, 0.0)) -> None:
        self._ref = ref  # the last commit, still under way (None: nothing left to wait for)
        self.num_blocks = num_blocks
        self._timeout_s = timeout_s
        self._committed = committed  # by the windows before it
        self._link = link  # what started the commit (None: a Ray ObjectRef)
        self.times = times  # the writer's side, up to the last commit's start

    def wait(self, timeout_s: float | None = None) -> int:
        """Blocks committed by this store (already-present blocks are not stored again)."""
        if self._ref is None:
            return self._committed
        if self._link is not None:
            return self._committed + int(self._link.result(self._ref,
                                                           timeout_s or self._timeout_s))
        import ray

        return self._committed + int(ray.get(self._ref, timeout=timeout_s or self._timeout_s))

    def done(self) -> bool:
        if self._ref is None:
            return True
        if self._link is not None:
            return bool(self._link.ready(self._ref))
        import ray

        ready, _ = ray.wait([self._ref], timeout=0)
        return bool(ready)


def store_into_dram(
    cm: Any, layout: KVLayout, keys: Sequence[BlockHash], parents: Sequence[BlockHash | None],
    kv: Any, namespace: str, owner: str, replication: int | None,
) -> StoreHandle:
    """Store ``keys`` whose KV [L, 2, H, len(keys)*T, D] is ``kv``; returns once the bytes
    are in DRAM, before they are committed.

    Each window's commit (and its write-through to NVMe) is waited for before the next
    window's grants: those may evict its blocks, and a block evicted between its commit and
    its write-through reached NVMe only if its demotion admitted it (copying window k while
    window k-1 committed lost 128 of 1,024 write-through blocks so)."""
    window = max(1, cm.config.dram_bytes // cm.config.block_bytes // 2)
    T = layout.block_tokens
    committed = 0
    ref = None
    copying = waiting = 0.0
    for start in range(0, len(keys), window):
        stop = min(start + window, len(keys))
        window_keys, window_parents = list(keys[start:stop]), list(parents[start:stop])
        t0 = time.perf_counter()
        done = _copy_window(cm, layout, window_keys, window_parents,
                            kv[:, :, :, start * T : stop * T], owner)
        t1 = time.perf_counter()
        copying += t1 - t0
        ref = cm.link.submit(_agent(cm), "commit_store", window_keys, window_parents, done,
                             namespace, replication)
        if stop < len(keys):
            committed += int(cm.link.result(ref, cm.config.load_timeout_s))
            ref = None
            waiting += time.perf_counter() - t1
    return StoreHandle(ref, len(keys), cm.config.load_timeout_s, committed, cm.link,
                       StoreTimes(copying, waiting))


def _agent(cm: Any) -> str:
    return actor_name("agent", cm.node_id)


def _copy_window(
    cm: Any, layout: KVLayout, keys: list[BlockHash], parents: list[BlockHash | None],
    kv: Any, owner: str,
) -> list[tuple[Any, int, int]]:
    """Copy the blocks of ``kv`` into the DRAM slots granted for them: (grant, size,
    checksum) of each written. What was granted is given back if a copy fails."""
    grants = cm.link.call(_agent(cm), "grant_store", keys, parents, owner,
                          timeout_s=cm.config.load_timeout_s)
    T = layout.block_tokens
    done: list[tuple[Any, int, int]] = []
    try:
        for i, grant in enumerate(grants):
            if grant is None:
                continue
            arena = cm.plane.arena(arena_name(Tier.DRAM, cm.node_id, grant.epoch))
            slot = arena.slot_view(grant.slot)[: layout.block_bytes]
            layout.from_payload(slot).copy_(kv[:, :, :, i * T : (i + 1) * T])
            done.append((grant, layout.block_bytes, checksum(slot)))
    except BaseException:
        cm.link.tell(actor_name(Tier.DRAM.value, cm.node_id), "abort",
                     [g.lease for g in grants if g is not None])
        raise
    return done
