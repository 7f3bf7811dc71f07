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
   slot, and its late bytes must fail the checksum where they are used, not pass it. Small
   blocks of a KV tensor go a run at a time (``TensorSource.copy_run``): the run gathered into
   one buffer in payload order, each block hashed there, the run written to its slots in one
   numpy call.
3. ``agent.commit_store(keys, parents, done, namespace, replication, owner)``: committed and
   visible to lookups, each block pinned for the store's owner as it is committed, then
   written through to NVMe and the pool as placement and admission say, then unpinned; a
   ``StoreCommit`` names the blocks refused (a lease that ended, a DRAM tier that restarted,
   bytes that no longer match).

Window k+1 is granted and copied while window k commits and writes through: k's pins keep
k+1's grants from evicting its blocks before they reach NVMe (unpinned, 128 of 1,024
write-through blocks were evicted between their commit and their write-through and lost).
At most two windows are in flight: k-1's commit is waited for before k+1's grants, so the
slots k+1 needs are free or hold blocks already written through, and the last window's
commit alone goes on behind ``StoreHandle``. A window whose grants come back short while
the window before it still commits is asked again, its rest, once that commit is done: as a
store without overlap would ask.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol, cast, runtime_checkable

import numpy as np
import xxhash

from cmx.checksum import Checksum, ChecksumStream
from cmx.client.copy_out import run_blocks
from cmx.doors import Abort, CommitStore, GrantStore, Pending
from cmx.keys import BlockHash
from cmx.layout import KVLayout
from cmx.protocol import StoreCommit, actor_name, arena_name
from cmx.storage.arena import check_slots, slot_rows
from cmx.tiers import Tier

__all__ = ["Source", "StoreHandle", "StoreTimes", "TensorSource", "copy_block",
           "store_into_dram"]


@runtime_checkable
class Source(Protocol):
    """Where a store's blocks come from, block ``i`` of the store at its own place: a KV
    tensor (``TensorSource``) or an engine's paged cache (``cmx.connectors.paged.PagedSource``).
    ``copy_block`` may raise (the engine took its blocks back): the store ends there."""

    blocks: int  # how many blocks it holds

    def copy_block(self, i: int, slot: np.ndarray) -> Checksum:
        """Copy block ``i`` into ``slot`` in payload order; the checksum of its bytes in that
        order, taken of the source as it is copied."""


class TensorSource:
    """A KV tensor [L, 2, H, n * T, D] (CPU or GPU): block ``i`` is its tokens ``[i * T,
    (i + 1) * T)``."""

    def __init__(self, layout: KVLayout, kv: Any) -> None:
        self.layout = layout
        self.kv = kv
        self.blocks = kv.shape[3] // layout.block_tokens

    def copy_block(self, i: int, slot: np.ndarray) -> Checksum:
        T = self.layout.block_tokens
        return copy_block(self.layout, slot, self.kv[:, :, :, i * T : (i + 1) * T])

    def copy_run(self, i: int, n: int) -> tuple[np.ndarray, list[Checksum]]:
        """Blocks ``i`` to ``i + n`` gathered in (layer-major) payload order into one buffer,
        ``[n, block_bytes]``, and the checksum of each, taken there."""
        T = self.layout.block_tokens
        src = self.kv[:, :, :, i * T : (i + n) * T]
        if src.device.type != "cpu":
            src = src.cpu()
        a = _numpy(src)
        L, two, H, _, D = a.shape
        rows = np.ascontiguousarray(a.reshape(L, two, H, n, T, D).transpose(3, 0, 1, 2, 4, 5))
        rows = rows.view(np.uint8).reshape(n, -1)
        return rows, [Checksum(xxhash.xxh3_64_intdigest(row.data)) for row in rows]


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
    kv: Source, namespace: str, owner: str, replication: int | None,
    grant_timeout_s: float | None = None,
) -> StoreHandle:
    """Store ``keys`` whose blocks are ``kv``'s, in order; returns once the bytes are in DRAM,
    before the last window is committed (the module's protocol). ``grant_timeout_s`` bounds
    each ``grant_store`` (default ``load_timeout_s``): UnavailableError past it."""
    window = max(1, cm.config.dram_bytes // cm.config.block_bytes // 2)
    commits = _Commits(cm)
    copying = 0.0
    for start in range(0, len(keys), window):
        stop = min(start + window, len(keys))
        window_keys, window_parents = list(keys[start:stop]), list(parents[start:stop])
        commits.wait_until(1)  # window k-1's, before window k+1's grants
        t0, waited = time.perf_counter(), commits.waiting_s
        done = _copy_window(cm, layout, window_keys, window_parents, kv, start, owner,
                            commits, grant_timeout_s)
        copying += time.perf_counter() - t0 - (commits.waiting_s - waited)
        commits.submit(window_keys, window_parents, done, namespace, replication, owner)
    commits.wait_until(1)
    return StoreHandle(commits.last(), len(keys), cm.config.load_timeout_s, commits.result,
                       cm.link, StoreTimes(copying, commits.waiting_s))


class _Commits:
    """A store's window commits in flight, oldest first, and what those done answered."""

    def __init__(self, cm: Any) -> None:
        self._cm = cm
        self._refs: list[Pending[StoreCommit]] = []
        self.result = StoreCommit(0)
        self.waiting_s = 0.0  # waiting for commits, in all

    def submit(self, keys: list[BlockHash], parents: list[BlockHash | None],
               done: list[tuple[Any, int, int]], namespace: str, replicas: int | None,
               owner: str) -> None:
        self._refs.append(self._cm.link.submit(_agent(self._cm), CommitStore(
            keys=keys, parents=parents, done=done, namespace=namespace, replicas=replicas,
            owner=owner)))

    def wait_until(self, in_flight: int) -> bool:
        """Wait for the oldest commits until at most ``in_flight`` are left; whether any
        was waited for."""
        t0 = time.perf_counter()
        waited = len(self._refs) > in_flight
        while len(self._refs) > in_flight:
            ref = self._refs.pop(0)
            self.result = _add(self.result,
                               self._cm.link.result(ref, self._cm.config.load_timeout_s))
        self.waiting_s += time.perf_counter() - t0
        return waited

    def last(self) -> Pending[StoreCommit] | None:
        return self._refs.pop() if self._refs else None


def _add(a: StoreCommit, b: StoreCommit) -> StoreCommit:
    return StoreCommit(a.committed + b.committed, a.refused + b.refused)


def _agent(cm: Any) -> str:
    return actor_name("agent", cm.node_id)


def _copy_window(
    cm: Any, layout: KVLayout, keys: list[BlockHash], parents: list[BlockHash | None],
    kv: Source, first: int, owner: str, commits: _Commits, grant_timeout_s: float | None,
) -> list[tuple[Any, int, int]]:
    """Copy blocks ``first`` on of ``kv`` into the DRAM slots granted for ``keys``: (grant,
    size, checksum) of each written. What was granted is given back if a copy fails."""
    grants = _grant(cm, keys, parents, owner, grant_timeout_s)
    done: list[tuple[Any, int, int]] = []
    try:
        short = [i for i, g in enumerate(grants) if g is None]
        if short and commits.wait_until(0):  # the window before may hold the slots: ask again
            again = _grant(cm, [keys[i] for i in short], [parents[i] for i in short], owner,
                           grant_timeout_s)
            for i, grant in zip(short, again):
                grants[i] = grant
        runs = run_blocks(layout) if isinstance(kv, TensorSource) else 1
        i = 0
        while i < len(grants):
            grant = grants[i]
            if grant is None:
                i += 1
                continue
            arena = cm.plane.arena(arena_name(Tier.DRAM, cm.node_id, grant.epoch))
            n = _granted_run(grants, i, runs)
            if n > 1:
                run = grants[i : i + n]
                rows, sums = cast(TensorSource, kv).copy_run(first + i, n)
                _write_run(arena, [g.slot for g in run], rows)
                done.extend((g, layout.block_bytes, c) for g, c in zip(run, sums))
            else:
                slot = arena.slot_view(grant.slot)[: layout.block_bytes]
                done.append((grant, layout.block_bytes, kv.copy_block(first + i, slot)))
            i += n
    except BaseException:
        cm.link.tell(actor_name(Tier.DRAM.value, cm.node_id),
                     Abort(leases=[g.lease for g in grants if g is not None]))
        raise
    return done


def _granted_run(grants: list[Any], i: int, most: int) -> int:
    """How many grants from ``i`` on (``grants[i]`` one) are granted, in one arena: at most
    ``most``."""
    n = 1
    while n < most and i + n < len(grants) and grants[i + n] is not None \
            and grants[i + n].epoch == grants[i].epoch:
        n += 1
    return n


def _write_run(arena: Any, slots: list[int], rows: np.ndarray) -> None:
    """``rows[j]`` into the first bytes of slot ``slots[j]`` of ``arena``, in one call. A
    block wider than the arena's slots (LayoutMismatchError) or a slot it does not have
    (IndexError) writes nothing."""
    check_slots(slots, arena.num_slots)
    slot_rows(arena.buffer, arena.slot_bytes, rows.shape[1])[slots] = rows


def _grant(cm: Any, keys: list[BlockHash], parents: list[BlockHash | None],
           owner: str, timeout_s: float | None = None) -> list[Any]:
    return list(cm.link.call(_agent(cm), GrantStore(keys=keys, parents=parents, owner=owner),
                             timeout_s=timeout_s or cm.config.load_timeout_s))


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
        # A strided slice is gathered once (it stays in the CPU's cache), then copied and
        # hashed whole: one hash call per slice, not one per [T, D] run.
        piece = np.ascontiguousarray(s[i])
        np.copyto(d[i], piece)
        stream.feed(piece)
    return stream.value()


_SAME_SIZE_INTS = {1: "uint8", 2: "int16", 4: "int32", 8: "int64"}


def _numpy(t: Any) -> np.ndarray:
    """A numpy view of a CPU tensor, same shape and strides, as ints of its element size
    (numpy has no bfloat16): for moving and hashing bytes, not for arithmetic."""
    import torch

    ints = getattr(torch, _SAME_SIZE_INTS[t.element_size()])
    return t.detach().view(ints).numpy()
