"""The host's side of an agent on a DPU: its arenas registered with NIXL, its files served.

A DPU is a separate computer: it cannot map the host's shared memory or open the host's
files. ``HostEndpoint`` runs on the host node (a thin Ray actor, ``host_endpoint_actor``):
it maps the arenas there, registers each with a NIXL agent (UCX backend, with a progress
thread, so that the DPU's reads and writes are served while this process moves nothing) and
publishes the agent's metadata; NVMe extents move between the segment files and the host's
slots through NIXL's POSIX backend (io_uring), as the DPU asks.

Partial loads: a block's selection is checked where the whole block is, here (a memory copy
against its block checksum, an NVMe copy as the checksummed chunks that cover the runs, read
into a slot of the endpoint's registered staging region), and the endpoint answers the
checksum of the selected bytes; only those bytes then cross, read by the DPU (or by a peer)
over NIXL and checked where they land, as ``cmx.selection`` describes.
"""

from __future__ import annotations

from typing import Any

from cmx.actors.dpu.access import STAGING_TIER, HostPeer, HostRegion
from cmx.actors.slices.expose import selection_checksum
from cmx.actors.slices.reads import ExtentSlices
from cmx.actors.tiers.arena import ArenaInfo
from cmx.actors.transport.base import TransferError
from cmx.buffers import aligned_empty
from cmx.checksum import checksum
from cmx.errors import CmxError
from cmx.selection import Runs
from cmx.storage.arena import SharedArena
from cmx.storage.nvme.dataplane import Extent, ExtentPlane, PlaneStats

__all__ = ["HostEndpoint", "RayEndpoint", "host_endpoint_actor"]


class HostEndpoint:
    """``staging_slots`` slots of ``slot_bytes`` (a block each) of the host's memory,
    registered with NIXL: where partial loads gather a block's selection from NVMe."""

    def __init__(self, name: str, io_engine: str = "nixl", slot_bytes: int = 0,
                 staging_slots: int = 0) -> None:
        from cmx.actors.transport.nixl_ucx import PROGRESS_DELAY_US, _progress_thread_delay
        from cmx.nixl_api import nixl_api

        api = nixl_api()
        with _progress_thread_delay(PROGRESS_DELAY_US):
            self._nixl = api.nixl_agent(name, api.nixl_agent_config(backends=["UCX"]))
        self.name = name
        self.nvme = ExtentPlane(io_engine)
        # arena -> its mapping, its region, its NIXL registration
        self._arenas: dict[str, tuple[SharedArena, HostRegion, Any]] = {}
        self._staging = aligned_empty(slot_bytes * staging_slots)
        self._staging[:] = 0  # faulted in once, not on the first reads
        self._staging_region: tuple[HostRegion, ...] = ()
        if self._staging.nbytes:
            base = self._staging.ctypes.data
            self._staging_reg = self._nixl.register_memory(
                [(base, self._staging.nbytes, 0, "")], "DRAM")
            self._staging_region = (HostRegion(f"{name}-staging", base, slot_bytes,
                                               staging_slots, STAGING_TIER),)

    def attach(self, info: ArenaInfo) -> HostRegion:
        """Map and register ``info``'s arena (once); its region as the DPU addresses it.

        One incarnation of a tier at a time: an arena of the tier's earlier incarnation is
        deregistered and unmapped, so a late move into it fails instead of landing in memory
        no live tier uses (and the dead arena's memory is freed)."""
        if info.arena not in self._arenas:
            for name in [n for n, (_, r, _) in self._arenas.items()
                         if r.tier == info.tier.value and r.epoch != info.epoch]:
                self._let_go(name)
            arena = SharedArena.attach(info.arena, populate=True)
            base = arena.buffer.ctypes.data
            nbytes = arena.slot_bytes * arena.num_slots
            registered = self._nixl.register_memory([(base, nbytes, 0, "")], "DRAM")
            self._arenas[info.arena] = (arena, HostRegion(
                info.arena, base, arena.slot_bytes, arena.num_slots, info.tier.value,
                info.epoch), registered)
        return self._arenas[info.arena][1]

    def _let_go(self, name: str) -> None:
        arena, _, registered = self._arenas.pop(name)
        try:
            self._nixl.deregister_memory(registered)
        finally:
            arena.close()

    def peer(self) -> HostPeer:
        return HostPeer(self.name, self._nixl.get_agent_metadata(),
                        tuple(r for _, r, _ in self._arenas.values()) + self._staging_region)

    def read_extent(self, extent: Extent, arena: str, slot: int) -> None:
        self.nvme.read_many([extent], [self._slot(arena, slot)])

    def write_extent(self, extent: Extent, arena: str, slot: int) -> None:
        self.nvme.write_many([extent], [self._slot(arena, slot)])

    def move_extents(self, pairs: list[tuple[Extent, Extent]]) -> list[bool | None]:
        """Compaction's copies on the host: each block from its old extent to its new one,
        verified (None: its bytes failed their checksum, it was not copied)."""
        return self.nvme.copy_many(pairs)

    def select(self, arena: str, slot: int, size: int, want: int, runs: Runs) -> int | None:
        """The checksum of the ``runs`` of the block of ``size`` bytes in a host slot, or
        None if the block fails its checksum ``want`` (the caller quarantines it)."""
        payload = self._slot(arena, slot)[:size]
        if checksum(payload) != want:
            return None
        return selection_checksum(payload, runs)

    def select_extent(self, extent: Extent, runs: Runs, slot: int) -> int | None:
        """The ``runs`` of the block at ``extent`` gathered into staging slot ``slot``, read
        as the chunks that cover them: their checksum, or None if a chunk fails its own."""
        if not self._staging_region or not 0 <= slot < self._staging_region[0].num_slots:
            raise CmxError(f"no staging slot {slot} at host endpoint {self.name}")
        n = self._staging_region[0].slot_bytes
        data = ExtentSlices(self.nvme).read(extent, runs)
        if data is None:
            return None
        # The checksum is of this call's own bytes: a late call into a slot reused since
        # cannot make its bytes pass for another block's.
        sum_of_selection = checksum(data)
        self._staging[slot * n:slot * n + data.nbytes] = data
        return sum_of_selection

    def stats(self) -> PlaneStats:
        return self.nvme.stats()

    def arenas(self) -> list[str]:
        """The host arenas this endpoint maps and has registered now."""
        return sorted(self._arenas)

    def _slot(self, arena: str, slot: int) -> Any:
        if arena not in self._arenas:
            raise CmxError(f"host arena {arena} is not attached to endpoint {self.name}")
        return self._arenas[arena][0].slot_view(slot)

    def close(self) -> None:
        self.nvme.close()
        for name in list(self._arenas):
            self._let_go(name)
        if self._staging_region:
            self._nixl.deregister_memory(self._staging_reg)
            self._staging_region = ()


def host_endpoint_actor() -> Any:
    """``HostEndpoint`` as a Ray actor class (Ray imported only where it is used)."""
    import ray

    # Restarted in place if its process dies: the DPU's access attaches its arenas again.
    return ray.remote(num_cpus=0, max_restarts=-1)(HostEndpoint)


class RayEndpoint:
    """A host endpoint actor called as ``dpu.access.Endpoint``: each call bounded, and any
    failure of Ray's (the actor restarting, a timeout) a TransferError."""

    def __init__(self, handle: Any, timeout_s: float = 60.0) -> None:
        self._handle = handle
        self._timeout_s = timeout_s

    def _get(self, ref: Any) -> Any:
        import ray

        try:
            return ray.get(ref, timeout=self._timeout_s)
        except ray.exceptions.RayError as exc:
            raise TransferError(f"host endpoint: {exc}") from exc

    def peer(self) -> HostPeer:
        peer: HostPeer = self._get(self._handle.peer.remote())
        return peer

    def attach(self, info: ArenaInfo) -> HostRegion:
        region: HostRegion = self._get(self._handle.attach.remote(info))
        return region

    def read_extent(self, extent: Extent, arena: str, slot: int) -> None:
        self._get(self._handle.read_extent.remote(extent, arena, slot))

    def write_extent(self, extent: Extent, arena: str, slot: int) -> None:
        self._get(self._handle.write_extent.remote(extent, arena, slot))

    def move_extents(self, pairs: list[tuple[Extent, Extent]]) -> list[bool | None]:
        moved: list[bool | None] = self._get(self._handle.move_extents.remote(pairs))
        return moved

    def select(self, arena: str, slot: int, size: int, want: int, runs: Runs) -> int | None:
        sums: int | None = self._get(self._handle.select.remote(arena, slot, size, want, runs))
        return sums

    def select_extent(self, extent: Extent, runs: Runs, slot: int) -> int | None:
        sums: int | None = self._get(self._handle.select_extent.remote(extent, runs, slot))
        return sums
