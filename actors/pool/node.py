"""A pool node (G4): NVMe on a storage node, pooled for every node of the cluster.

A pool node is its own small data plane: an NVMe store (``ExtentBooks``, its bytes and
compaction's through an ``ExtentPlane``), a DRAM staging arena
registered with its transport, and the same pull protocol as the offload agents:

- ``ingest(source, items)``: pull blocks from the arena of ``source`` (an agent or another
  pool node that has them pinned) over the transport, verify, write to NVMe with each block's
  namespace id (so the directory learns it again after it or this node restarts), commit,
  announce.
- ``stage(keys, owner)`` / ``unstage(staged)``: for a reader: pin each block in the staging
  arena (reading it from NVMe and verifying it first), so the reader pulls it with one
  transfer. The pins are leases: a reader that dies holds them only until they expire.
- ``rebalance(members, replicas, generation)``: after membership or replication changed, push
  every block held here to its owners (rendezvous hashing over the live members) that lack it,
  and drop the copies held here past their owners once the owners confirm theirs; a rebalance
  of an older membership view than one seen here does nothing (``pool.rebalance``).

The store lives under ``<nvme_dir>/pool-<pool id>``, the pool id being the node's label value,
so a node that comes back with the same label offers what its disk still holds.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from cmx.actors.directory.shard import Entry, Source
from cmx.actors.pool.rebalance import Rebalanced, SurplusCopies, confirmed, placement
from cmx.actors.pool.slices import PoolExposure, pool_selection
from cmx.actors.slices.expose import ExposedSlice, Exposure, SliceOutbox
from cmx.actors.tiers.events import EventPublisher
from cmx.actors.tiers.leases import Clock, LeaseKind, Leases
from cmx.actors.tiers.nvme import extent_holdings, extent_tag
from cmx.actors.transport.base import Move, PeerInfo, Region, TransferError
from cmx.actors.transport.factory import make_transport
from cmx.checksum import checksum
from cmx.doors import Contains, Ingest, PeerInfoOf, ReadSlots
from cmx.errors import BlockStateError, CmxError, StoreFullError, UnavailableError
from cmx.keys import BlockHash
from cmx.protocol import Offer, Staged
from cmx.selection import Runs, SlicedBlock
from cmx.stats import TierStats
from cmx.storage.dram import DramStore, Reservation
from cmx.storage.nvme.dataplane import Extent, ExtentPlane, PlaneMover
from cmx.storage.nvme.extents import ExtentBooks, PendingExtent
from cmx.storage.nvme.records import check_tag
from cmx.tiers import Tier

__all__ = ["PoolNodeService"]

log = logging.getLogger(__name__)

DEFAULT_LEASE_S = 90.0


class PoolNodeService:
    def __init__(
        self, node: str, pool_id: str, root: str, capacity_bytes: int, block_bytes: int,
        staging_bytes: int, link: Any, num_shards: int, transport: str = "auto",
        eviction: str = "lru", segment_bytes: int = 256 << 20,
        lease_s: float = DEFAULT_LEASE_S, clock: Clock = time.monotonic,
    ) -> None:
        self.node = node
        self.pool_id = pool_id
        self.link = link
        self.epoch = uuid.uuid4().hex[:8]
        self.name = f"cmx-pool-{pool_id}-{self.epoch}"
        self.io = ExtentPlane()  # this node's data plane: the NVMe store's reader and writer
        self.store = ExtentBooks(root, capacity_bytes=capacity_bytes, block_bytes=block_bytes,
                                 eviction=eviction, segment_bytes=segment_bytes,
                                 mover=PlaneMover(self.io))
        self.staging = DramStore(staging_bytes, block_bytes, name=self.name)
        self.leases = Leases(lease_s, clock)  # readers' pins of staged blocks
        self.transport = make_transport(self.name, transport, self._fetch)
        arena = self.staging.arena
        self.transport.register(
            Region(arena.name, arena.buffer.ctypes.data, arena.slot_bytes, arena.num_slots),
            arena.buffer,
        )
        self._peers: dict[str, PeerInfo] = {}
        self._lock = threading.Lock()
        self.publisher = EventPublisher(
            Source(node, Tier.POOL), self.epoch, num_shards,
            lambda shard, request: link.call(f"cmx:dir:{shard}", request),
            self._holdings, self.store.event_lock, functools.partial(extent_tag, self.store),
        )
        self.store.subscribe(self.publisher.on_event)
        self._outbox: SliceOutbox | None = None  # made at the first partial load over NIXL
        self.exposure = PoolExposure(node, self.staging, self.store, self.io, self.leases,
                                     self.outbox, self._unstage_later)
        self.surplus = SurplusCopies(self.store, self.staging, self._announce_drops)

    def outbox(self) -> SliceOutbox:
        with self._lock:
            if self._outbox is None:
                self._outbox = SliceOutbox.registered(
                    self.transport, f"{self.name}-outbox", self.staging.arena.slot_bytes,
                    self.leases.ttl_s)
            return self._outbox

    def peer_info(self) -> PeerInfo:
        return self.transport.info()

    # -- writes into the pool ------------------------------------------------------------------

    def ingest(self, source: str, offers: Sequence[Offer]) -> int:
        """Pull ``offers`` from the actor ``source``; returns blocks now stored here. A block
        held here untagged takes the offer's namespace id instead (on disk, its bytes kept)."""
        for o in offers:
            check_tag(o.namespace)  # before anything is held: a bad tag changes nothing
        self.surplus.keep(o.key for o in offers)
        todo = [o for o in offers if o.key not in self.store]
        if self._adopt_tags([o for o in offers if o.key in self.store and o.namespace]):
            self.store.flush()
            self.publisher.flush()
        if not todo:
            return 0
        grants = []
        for o in todo:
            try:
                grants.append((o, self.staging.reserve(o.key, o.parent)))
            except (BlockStateError, StoreFullError):
                continue
        try:
            peer = self._peer(source)
            moves = [Move(o.region, o.slot, self.staging.arena.name, r.slot) for o, r in grants]
            self.transport.read(peer, moves)
        except (TransferError, UnavailableError, CmxError) as exc:
            log.warning("ingest from %s failed: %s", source, exc)
            for _, r in grants:
                self.staging.abort(r)
            self._peers.pop(source, None)
            return 0
        stored = self._write_through(grants)
        self.store.flush()
        self.publisher.flush()
        return stored

    def _adopt_tags(self, offers: Sequence[Offer]) -> int:
        """Tag the blocks of ``offers`` held here untagged with their offer's namespace id (a
        drop then finds them); returns how many took it."""
        return sum(self.store.adopt_tag(o.key, o.namespace, o.checksum) for o in offers)

    # -- reads out of the pool -----------------------------------------------------------------

    def stage(self, keys: Sequence[BlockHash], owner: str) -> list[Staged | None]:
        self.leases.expire()
        out: list[Staged | None] = []
        region = self.staging.arena.name
        cached = [self.staging.pin(key) for key in keys]
        loaded = self._load_into_staging([k for k, c in zip(keys, cached) if not c])
        for key, was_cached in zip(keys, cached):
            if not was_cached and key not in loaded:
                out.append(None)
                continue
            ref = self.staging.locate(key)
            if ref is None:
                self._unpin_staged(key)
                out.append(None)
                continue
            lease = self.leases.grant(owner, LeaseKind.PIN, key, self._unstage_later(key))
            out.append(Staged(key, Tier.POOL, region, ref.slot, ref.size, ref.checksum or 0,
                              Tier.POOL, lease, extent_tag(self.store, key)))
        return out

    def read_selection(self, keys: Sequence[BlockHash], runs: Runs) -> list[SlicedBlock | None]:
        """The selected bytes of ``keys`` held here, for a partial load (``pool.slices``)."""
        out = pool_selection(self.node, self.staging, self.store, self.io, keys, runs)
        self.publisher.flush()
        return out

    def expose_selection(self, keys: Sequence[BlockHash], runs: Runs,
                         owner: str) -> Exposure:
        """The selections of ``keys`` held here, held for ``owner`` to pull over NIXL."""
        out = self.exposure.expose(keys, runs, owner)
        self.publisher.flush()
        return out

    def release_selection(self, exposed: Sequence[ExposedSlice]) -> None:
        self.exposure.release(exposed)

    def unstage(self, staged: Sequence[Staged]) -> None:
        self.leases.end([s.lease for s in staged])

    def quarantine_staged(self, staged: Sequence[Staged]) -> None:
        """A reader found these staged copies corrupt: drop them, and the disk's copy too."""
        self.quarantine_copies([s.key for s in staged], Tier.POOL)

    def quarantine_copies(self, keys: Sequence[BlockHash], tier: Tier = Tier.POOL) -> None:
        for key in keys:
            self._drop_staged(key)
            self.store.quarantine(key)
        self.publisher.flush()

    def _unstage_later(self, key: BlockHash) -> Callable[[int], None]:
        """The undo of a reader's lease of staged ``key``: unpin it when the lease ends."""
        def undo(_lease: int) -> None:
            self._unpin_staged(key)
        return undo

    def _unpin_staged(self, key: BlockHash) -> None:
        try:
            self.staging.unpin(key)
        except BlockStateError:
            pass
        if key in self.surplus:
            self.surplus.retry([key])

    def _write_through(self, grants: list[tuple[Offer, Reservation]]) -> int:
        """Write the verified blocks pulled into staging to NVMe, all in flight at once;
        commit each to both. Returns how many are stored."""
        held: list[tuple[Offer, Reservation, PendingExtent]] = []
        for o, r in grants:
            pending = None
            if checksum(r.buffer[: o.size]) == o.checksum:
                pending = self.store.reserve_extent(o.key, o.parent, o.size, o.namespace)
            if pending is None:
                self.staging.abort(r)
            else:
                held.append((o, r, pending))
        try:
            sums = self.io.write_many(
                [Extent(o.key, p.path, p.offset, o.size) for o, _, p in held],
                [r.buffer for _, r, _ in held])
        except OSError as exc:
            log.warning("pool write of %d blocks failed: %s", len(held), exc)
            for _, r, p in held:
                self.store.abort_extent(p)
                self.staging.abort(r)
            return 0
        for (o, r, p), (whole, chunk_sums) in zip(held, sums):
            self.store.commit_extent(p, whole, chunk_sums)
            self.staging.commit(r, o.size, o.checksum)
        return len(held)

    def _load_into_staging(self, keys: Sequence[BlockHash]) -> set[BlockHash]:
        """Read blocks from NVMe into pinned staging slots, all in flight at once; the keys
        now staged and pinned. A miss, a full staging arena or a failed read stages nothing
        of that key and leaves nothing reserved or pinned; a corrupt block is quarantined."""
        held: list[tuple[Extent, Reservation]] = []
        try:
            for key in keys:
                if not self.store.pin(key):
                    continue
                entry = self.store.entry_of(key)
                res = None
                if entry is not None:
                    try:
                        res = self.staging.reserve(key, entry.parent)
                    except (BlockStateError, StoreFullError):
                        res = None
                if entry is None or res is None:
                    self._unpin_stored(key)
                    continue
                held.append((Extent(key, self.store.segment_path(entry.seg), entry.offset,
                                    entry.length, entry.checksum), res))
            try:
                ok = self.io.read_many([e for e, _ in held], [r.buffer for _, r in held])
            except OSError as exc:  # the disk failed, not the blocks: nothing is quarantined
                log.warning("pool read of %d blocks failed: %s", len(held), exc)
                for _, res in held:
                    self.staging.abort(res)
                return set()
            staged: set[BlockHash] = set()
            for (ext, res), good in zip(held, ok):
                key = BlockHash(ext.key)
                if not good:
                    self.staging.abort(res)
                    continue
                self.staging.commit(res, ext.size, ext.checksum)
                if self.staging.pin(key):
                    staged.add(key)
            bad = [BlockHash(e.key) for (e, _), good in zip(held, ok) if not good]
            for key in bad:
                self._unpin_stored(key)
                self.store.quarantine(key)
            held = [(e, r) for e, r in held if e.key not in set(bad)]
            if bad:
                self.publisher.flush()
            return staged
        finally:
            for ext, _ in held:
                self._unpin_stored(BlockHash(ext.key))

    def _unpin_stored(self, key: BlockHash) -> None:
        try:
            self.store.unpin(key)
        except BlockStateError:
            pass  # quarantined under the pin
        if key in self.surplus:
            self.surplus.retry([key])

    def drop_staging(self) -> int:
        """Empty the staging cache of unpinned blocks (cold reads in benchmarks)."""
        return sum(1 for key in list(self.staging.keys()) if self._drop_staged(key))

    def _drop_staged(self, key: BlockHash) -> bool:
        try:
            return self.staging.delete(key)
        except BlockStateError:
            return False  # pinned by a reader

    def read_slots(self, slots: Sequence[tuple[str, int]]) -> list[object]:
        arena = self.staging.arena
        return [arena.slot_view(slot).copy() for region, slot in slots if region == arena.name]

    # -- membership ----------------------------------------------------------------------------

    def contains(self, keys: Sequence[BlockHash]) -> list[bool]:
        return [k in self.store for k in keys]

    def checksums(self, keys: Sequence[BlockHash], generation: int = 0) -> list[int | None]:
        """The checksum of the committed copy of each key held here (None: none is), for a
        rebalance of ``generation`` that drops its own copy only with the owners' confirmed.
        To a rebalance of an older view than one seen here, none is confirmed."""
        if not self.surplus.advance(generation):
            return [None] * len(keys)
        entries = [self.store.entry_of(k) for k in keys]
        return [None if e is None else e.checksum for e in entries]

    def evict(self, keys: Sequence[BlockHash]) -> int:
        """Drop unpinned blocks from this pool node, durably (a namespace drop stays dropped
        across a restart); returns how many left."""
        for key in keys:
            self._drop_staged(key)
        gone = self.store.delete_unpinned(keys)
        if gone:
            self.store.flush()
        self.publisher.flush()
        return gone

    def rebalance(self, members: Sequence[str], replicas: int, generation: int = 0
                  ) -> Rebalanced:
        """Push blocks held here to the owners that lack them, then drop each copy held here
        past its owners once they all hold one of its checksum (``pool.rebalance``). Under an
        older view (``generation``) than one seen here, nothing is done."""
        if not self.surplus.advance(generation):
            log.info("rebalance of generation %d ignored: a newer one was seen", generation)
            return Rebalanced(0, 0, len(self.surplus))
        held = list(self.store.keys())
        want, surplus = placement(held, members, replicas, self.node)
        self.surplus.keep(set(held).difference(surplus))  # owned here now: none of it goes
        pushed = sum(self._push(owner, keys) for owner, keys in want.items())
        entries = {key: self.store.entry_of(key) for key in surplus}
        sums = {key: e.checksum for key, e in entries.items() if e is not None}
        dropped = self.surplus.drop(confirmed(self.link, sums, members, replicas, generation),
                                    generation)
        return Rebalanced(pushed, dropped, len(self.surplus))

    def _push(self, owner: str, keys: list[BlockHash]) -> int:
        """Have ``owner`` pull those of ``keys`` it lacks from here; how many it stored."""
        pushed = 0
        me = f"cmx:pool:{self.node}"
        target = f"cmx:pool:{owner}"
        try:
            have = self.link.call(target, Contains(keys=keys))
            missing = [k for k, h in zip(keys, have) if not h]
            for start in range(0, len(missing), 16):
                staged = [s for s in self.stage(missing[start : start + 16], me)
                          if s is not None]
                try:
                    offers = [Offer(s.key, None, s.region, s.slot, s.size, s.checksum,
                                    extent_tag(self.store, s.key)) for s in staged]
                    pushed += int(self.link.call(target, Ingest(source=me, offers=offers)))
                finally:
                    self.unstage(staged)
        except UnavailableError as exc:
            log.warning("rebalance to %s failed: %s", owner[:8], exc)
        return pushed

    # -- upkeep --------------------------------------------------------------------------------

    def heartbeat(self) -> bool:
        self.leases.expire()
        self.surplus.retry()  # surplus copies whose pins ended since
        return self.publisher.flush(heartbeat=True)

    def _announce_drops(self) -> None:
        self.store.flush()  # durable: a dropped copy stays dropped across a restart
        self.publisher.flush()

    def stats(self) -> TierStats:
        staging = self.staging.stats()  # what is pinned and reserved here: staging slots
        return TierStats(Tier.POOL, self.node, self.epoch, self.store.stats(), staging.pinned,
                         staging.reserved, self.leases.stats())

    def check_integrity(self) -> None:
        self.store.check_integrity()
        self.staging.check_integrity()

    def close(self) -> None:
        self.publisher.close()
        self.transport.close()
        self.io.close()
        self.staging.close()
        self.store.close()

    def _peer(self, actor: str) -> PeerInfo:
        info = self._peers.get(actor)
        if info is None:
            info = self._peers[actor] = self.link.call(actor, PeerInfoOf())
        return info

    def _fetch(self, peer_agent: str, slots: list[tuple[str, int]]) -> list[np.ndarray]:
        actor = next(a for a, p in self._peers.items() if p.agent == peer_agent)
        views = self.link.call(actor, ReadSlots(slots=slots))
        return views

    def _holdings(self) -> list[Entry]:
        return extent_holdings(self.store)
