"""A store on this node: the engine's KV copied once, straight into DRAM slots granted to it.

Protocol, per window of half the DRAM tier (so a store larger than DRAM streams through it):

1. ``agent.grant_store(keys, parents, owner)``: DRAM slots reserved for the store's owner
   (leases: a writer that dies gives them back when they expire), what they evict already
   demoted. None for a block already stored or with no room.
2. The writer copies each block from the engine's layout into its slot's payload order, in
   the arena of the grant's epoch (``arena_name``): one strided copy, no object store. A DRAM
   tier that restarted since has unlinked that arena (the copy fails), or, if it was mapped
   here before, the copy lands in memory no tier uses and its commit is refused. Each
   block's checksum is taken of the engine's bytes as they are copied (``copy_block``),
   never read back from the slot: a writer whose lease ran out may still copy into that
   slot, and its late bytes must fail the checksum where they are used, not pass it.
3. ``agent.commit_store(keys, parents, done)``: committed and visible to lookups, then written
   through to NVMe and the pool as placement and admission say; a ``StoreCommit`` names the
   blocks refused (a lease that ended, a DRAM tier that restarted, bytes that no longer
   match). The last window's commit goes on behind ``StoreHandle``; an earlier one is waited
   for, as the next window's grants may evict its blocks.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from cmx.checksum import Checksum, ChecksumStream
from cmx.keys import BlockHash
from cmx.layout import KVLayout
from cmx.protocol import StoreCommit, actor_name, arena_name
from cmx.tiers import Tier

__all__ = ["StoreHandle", "StoreTimes", "copy_block", "store_into_dram"]


@dataclass(frozen=True)
class StoreTimes:
    """Where a store's time went on the writer's side, in seconds."""

    grant_and_copy_s: float  # asking for DRAM slots, copying the KV into them, checksums
    commit_wait_s: float  # waiting for an earlier window's commit (and its write-through)


class StoreHandle:
    """An asynchronous store; ``wait()`` returns once the blocks are committed and visible."""

    def __init__(self, ref: Any, num_blocks: int, timeout_s: float,
                 before: StoreCommit | None = None, link: Any = None,
                 times: StoreTimes = StoreTimes(0.0, 0.0)) -> None:
        self._ref = ref  # the last commit, still under way (None: nothing left to wait for)
        self.num_blocks = num_blocks
        self._timeout_s = timeout_s
        self._result = before or StoreCommit(0)  # of the windows before it
        self._link = link  # what started the commit (None: a Ray ObjectRef)
        self.times = times  # the writer's side, up to the last commit's start

    def wait(self, timeout_s: float | None = None) -> int:
        """Blocks committed by this store (already-present blocks are not stored again)."""
        if self._ref is not None:
            last: StoreCommit
            if self._link is not None:
                last = self._link.result(self._ref, timeout_s or self._timeout_s)
            else:
                import ray

                last = ray.get(self._ref, timeout=timeout_s or self._timeout_s)
            self._result, self._ref = _add(self._result, last), None
        return self._result.committed

    @property
    def refused(self) -> tuple[BlockHash, ...]:
        """Keys of the blocks written but not stored (``StoreCommit.refused``): known once
        ``wait()`` has returned. A later store of them writes them again."""
        return self._result.refused

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
    result = StoreCommit(0)
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
        args = (window_keys, window_parents, done, namespace, replication)
        ref = cm.link.submit(_agent(cm), "commit_store", *args)
        if stop < len(keys):  # the next window's grants may evict these blocks: commit first
            result = _add(result, cm.link.result(ref, cm.config.load_timeout_s))
            ref = None
            waiting += time.perf_counter() - t1
    return StoreHandle(ref, len(keys), cm.config.load_timeout_s, result, cm.link,
                       StoreTimes(copying, waiting))


def _add(a: StoreCommit, b: StoreCommit) -> StoreCommit:
    return StoreCommit(a.committed + b.committed, a.refused + b.refused)


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
            csum = copy_block(layout, slot, kv[:, :, :, i * T : (i + 1) * T])
            done.append((grant, layout.block_bytes, csum))
    except BaseException:
        cm.link.tell(actor_name(Tier.DRAM.value, cm.node_id), "abort",
                     [g.lease for g in grants if g is not None])
        raise
    return done


def copy_block(layout: KVLayout, slot: Any, kv: Any) -> Checksum:
    """Copy one block's KV [L, 2, H, T, D] into ``slot`` in payload order; returns the
    checksum of ``kv``'s bytes in that order, taken of the source, never of the slot.

    The copy goes one outer slice of the payload at a time (a layer, or a head), each slice
    hashed from the source right after it is copied, while it is still in the CPU's cache: no
    second pass over the block. numpy does the moving: torch's threads would meet at a
    barrier for every slice."""
    dst = layout.from_payload(slot)
    # The dims in the payload's memory order: the slot's view permuted back to contiguous.
    strides = dst.stride()
    order = sorted(range(3), key=lambda d: -strides[d]) + [3, 4]
    src = kv.permute(order)
    if src.device.type != "cpu":  # the host copy is the source then: hashed as it is made
        src = src.cpu()
    d, s = _numpy(dst.permute(order)), _numpy(src)
    stream = ChecksumStream()
    for i in range(d.shape[0]):
        np.copyto(d[i], s[i])
        piece = s[i]
        if piece.flags.c_contiguous:
            stream.feed(piece)
            continue
        for j in range(piece.shape[0]):
            for k in range(piece.shape[1]):  # [T, D]: contiguous in an engine's layout
                stream.feed(np.ascontiguousarray(piece[j, k]))
    return stream.value()


_SAME_SIZE_INTS = {1: "uint8", 2: "int16", 4: "int32", 8: "int64"}


def _numpy(t: Any) -> np.ndarray:
    """A numpy view of a CPU tensor, same shape and strides, as ints of its element size
    (numpy has no bfloat16): for moving and hashing bytes, not for arithmetic."""
    import torch

    ints = getattr(torch, _SAME_SIZE_INTS[t.element_size()])
    return t.detach().view(ints).numpy()
