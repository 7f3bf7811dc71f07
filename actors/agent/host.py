"""Where the agent's parts touch the bytes of its host: the node's arenas and NVMe files.

Every part of the agent reads and writes block bytes through one ``HostBytes``: the stores'
copies into DRAM, local loads, demotions, NVMe writes, compaction's copies, blocks landing
from peers, what a peer reads, and the selections of partial loads. An agent on its host
maps the arenas (shared memory) and opens the NVMe files itself (``HostBytes``, here); an
agent on a DPU reaches both over NIXL through the host's endpoint (``dpu.agent.NixlHost``).
The parts above are the same for both.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Sequence
from typing import Any, Protocol

import numpy as np

from cmx.actors.agent.scheduler import Priority, Scheduler
from cmx.actors.agent.shared import NodeTiers, Peers, StaleEpochError
from cmx.actors.slices.expose import SliceOutbox, selection_checksum
from cmx.actors.slices.reads import ExtentSlices, slice_memory
from cmx.actors.tiers.arena import Grant, Pinned
from cmx.actors.transport.base import Move, OnLanded, PeerInfo, TransferError, Transport
from cmx.checksum import ChecksumStream, checksum
from cmx.config import ServiceConfig
from cmx.errors import UnavailableError
from cmx.protocol import Staged
from cmx.selection import Runs
from cmx.stats import HostAccessStats
from cmx.storage.nvme.dataplane import Extent, ExtentPlane

__all__ = ["HostBytes", "LandedChecks", "SlotViews"]


class HostBytes:
    """The host's bytes, mapped and opened in this process: an agent on its host."""

    def __init__(self, name: str, config: ServiceConfig, tiers: NodeTiers, peers: Peers,
                 scheduler: Scheduler, transport: Transport, nvme: ExtentPlane) -> None:
        self.name = name
        self.config = config
        self.tiers = tiers
        self.peers = peers
        self.scheduler = scheduler
        self.transport = transport
        self.nvme = nvme  # the NVMe tier's bytes: the store's own I/O engine
        self._outbox: SliceOutbox | None = None
        self._outbox_lock = threading.Lock()  # the outbox is made once

    # -- into memory slots ---------------------------------------------------------------------

    def copy_in(self, grants: Sequence[Grant | None], payload: np.ndarray, size: int
                ) -> list[tuple[Grant, int, int]]:
        """Copy each granted block of ``payload`` into its slot, in the arena of its grant's
        epoch; (grant, size, checksum) of each."""
        futures = [
            self.scheduler.submit(Priority.DEMOTE, functools.partial(
                self._copy_block, grant, payload[i * size : (i + 1) * size]))
            for i, grant in enumerate(grants) if grant is not None]
        return [f.result() for f in futures]

    def _copy_block(self, grant: Grant, src: np.ndarray) -> tuple[Grant, int, int]:
        """One block into the front of its granted slot; (grant, size, checksum)."""
        np.copyto(self.tiers.arena(grant.epoch).slot_view(grant.slot)[: src.nbytes], src)
        return grant, src.nbytes, checksum(src)

    def read_memory(self, pins: Sequence[Pinned], grants: Sequence[Grant],
                    priority: Priority) -> list[bool]:
        """Copy each block pinned in a memory arena into the front of its granted slot."""
        jobs = [self.scheduler.submit(priority, functools.partial(self._copy_pinned, p, g))
                for p, g in zip(pins, grants)]
        return [f.result() for f in jobs]

    def _copy_pinned(self, pin: Pinned, grant: Grant) -> bool:
        self.copy_slot(pin, grant, pin.size)
        return True

    def read_extents(self, extents: Sequence[Extent], grants: Sequence[Grant],
                     priority: Priority) -> list[bool]:
        """Read pinned NVMe extents into the front of their granted slots, all in one job of
        the scheduler's class ``priority``; per block whether it checked out."""
        if not extents:
            return []
        dsts = [self.tiers.arena(g.epoch).slot_view(g.slot) for g in grants]
        return self.scheduler.submit(
            priority, lambda: self.nvme.read_many(extents, dsts)).result()

    def copy_slot(self, src: Grant | Pinned, dst: Grant, nbytes: int) -> None:
        """The first ``nbytes`` of ``src``'s slot into ``dst``'s, each in its epoch's arena."""
        np.copyto(self.tiers.arena(dst.epoch).slot_view(dst.slot)[:nbytes],
                  self.tiers.arena(src.epoch).slot_view(src.slot)[:nbytes])

    # -- onto NVMe -----------------------------------------------------------------------------

    def slot_source(self, epoch: str, slot: int) -> Any:
        """What an NVMe write reads a memory slot's bytes from: the slot, mapped here."""
        return self.tiers.arena(epoch).slot_view(slot)

    def write_extents(self, extents: Sequence[Extent], sources: Sequence[Any]
                      ) -> list[tuple[int, bytes]]:
        """Write each source's front to its extent, all in flight at once; per block its
        checksums (block, chunks)."""
        return self.scheduler.submit(
            Priority.DEMOTE, lambda: self.nvme.write_many(extents, sources)).result()

    def copy_extents(self, pairs: Sequence[tuple[Extent, Extent]]) -> list[bool | None]:
        """Compaction's copies, each block from its old extent to its new one, verified."""
        return self.nvme.copy_many(pairs)

    # -- between nodes -------------------------------------------------------------------------

    def land_staged(self, peer_agent: str, pairs: list[tuple[int, Staged]],
                    granted: dict[int, Grant], priority: Priority) -> set[int]:
        """Pull each staged block (key index, what the peer staged) into its granted HBM slot
        with the transport, checked as its pieces land; the key indexes that landed intact."""
        infos = [self.tiers.info(granted[i].epoch) for i, _ in pairs]
        arenas = [info.arena for info in infos if info is not None]
        if len(arenas) < len(infos):
            raise StaleEpochError("HBM restarted since it granted these slots")
        moves = [Move(s.region, s.slot, arena, granted[i].slot)
                 for (i, s), arena in zip(pairs, arenas)]
        checks = LandedChecks(
            {m: (self.tiers.arena(granted[i].epoch), s.size, s.checksum)
             for m, (i, s) in zip(moves, pairs)})
        self.transfer(peer_agent, [s for _, s in pairs], moves, checks.landed, priority)
        return {i for m, (i, _) in zip(moves, pairs) if m in checks.intact}

    def transfer(self, peer_agent: str, staged: Sequence[Staged], moves: list[Move],
                 landed: OnLanded, priority: Priority) -> None:
        """``moves`` of ``staged`` blocks from ``peer_agent`` with the transport, at
        ``priority``; ``landed`` as each piece lands."""
        peer = self.peers.holding(peer_agent, [s.region for s in staged])
        try:
            with self.scheduler.staging(0):
                self.scheduler.submit(
                    priority,
                    lambda: self.transport.read(peer, moves, self.config.load_timeout_s,
                                                landed),
                ).result()
        except TransferError:
            self.peers.forget(peer_agent)  # the peer may have restarted
            raise

    def peer_info(self) -> PeerInfo:
        """What a peer reads this node's blocks with: this agent's transport and arenas."""
        return self.transport.info()

    def read_slots(self, slots: Sequence[tuple[str, int]]) -> list[np.ndarray]:
        """The fallback transport's server side: copies of whole slots of local arenas."""
        arenas = {info.arena: arena for info, arena in self.tiers.currents()}
        missing = {region for region, _ in slots} - arenas.keys()
        if missing:
            raise UnavailableError(f"no region {sorted(missing)} here")
        return [arenas[region].slot_view(slot).copy() for region, slot in slots]

    # -- partial loads: each copy checked whole where its bytes are ----------------------------

    def outbox(self) -> SliceOutbox:
        """Where NVMe selections wait for a peer to read them (made on first use)."""
        with self._outbox_lock:
            if self._outbox is None:
                self._outbox = self._make_outbox()
            return self._outbox

    def made_outbox(self) -> SliceOutbox | None:
        return self._outbox

    def _make_outbox(self) -> SliceOutbox:
        return SliceOutbox.registered(self.transport, f"{self.name}-outbox",
                                      self.config.block_bytes, self.config.lease_s)

    def pinned_selection(self, pin: Pinned, runs: Runs) -> np.ndarray | None:
        """The ``runs`` of a copy pinned in a memory arena, or None if the copy fails its
        block checksum."""
        payload = self.tiers.arena(pin.epoch).slot_view(pin.slot)[: pin.size]
        return slice_memory(payload, pin.checksum, runs)

    def pinned_selection_checksum(self, pin: Pinned, runs: Runs) -> int | None:
        """The checksum of the ``runs`` of a copy pinned in a memory arena, or None if the
        copy fails its block checksum."""
        payload = self.tiers.arena(pin.epoch).slot_view(pin.slot)[: pin.size]
        if checksum(payload) != pin.checksum:
            return None
        return selection_checksum(payload, runs)

    def extent_selection(self, ext: Extent, runs: Runs) -> np.ndarray | None:
        """The ``runs`` of the block at ``ext``, read as the chunks that cover them, or None
        if a chunk fails its checksum."""
        return ExtentSlices(self.nvme).read(ext, runs)

    def extent_into_outbox(self, ext: Extent, runs: Runs, box: SliceOutbox,
                           slot: int) -> int | None:
        """The ``runs`` of the block at ``ext`` gathered into ``slot`` of ``box``: their
        checksum, or None if a chunk fails its checksum."""
        data = ExtentSlices(self.nvme).read(ext, runs, box.view(slot))
        return None if data is None else checksum(data)

    # -- plumbing ------------------------------------------------------------------------------

    def access_stats(self) -> HostAccessStats | None:
        """What crossed to and from the host other than by mapping it: nothing, here."""
        return None

    def close(self) -> None:
        self.nvme.close()


class SlotViews(Protocol):
    """Where blocks land: an arena mapped here, or a DPU agent's bounce slots."""

    def slot_view(self, slot: int) -> np.ndarray: ...


class LandedChecks:
    """Checksums of blocks landing piece by piece (``Transport.read``'s ``on_landed``):
    each piece is fed while it is still in the cache, as later pieces still move."""

    def __init__(self, expected: dict[Move, tuple[SlotViews, int, int]]) -> None:
        self._expected = expected  # move -> (arena it lands in, payload size, checksum)
        self._streams = {m: ChecksumStream() for m in expected}
        self.intact: set[Move] = set()  # moves whose whole payload landed and checked out

    def landed(self, move: Move, start: int, stop: int) -> None:
        arena, size, want = self._expected[move]
        end = min(stop, size)  # a slot travels whole; the payload may end before it
        if start >= end:
            return
        stream = self._streams[move]
        stream.feed(arena.slot_view(move.dst_slot)[start:end])
        if end == size and stream.value() == want:
            self.intact.add(move)
