"""The host's side of an agent on a DPU: its arenas registered with NIXL, its files served.

A DPU is a separate computer: it cannot map the host's shared memory or open the host's
files. ``HostEndpoint`` runs on the host node (a thin Ray actor, ``host_endpoint_actor``):
it maps the arenas there, registers each with a NIXL agent (UCX backend, with a progress
thread, so that the DPU's reads and writes are served while this process moves nothing) and
publishes the agent's metadata; NVMe extents move between the segment files and the host's
slots through NIXL's POSIX backend (io_uring), as the DPU asks.
"""

from __future__ import annotations

from typing import Any

from cmx.actors.arena_tier import ArenaInfo
from cmx.actors.dpu_access import HostPeer, HostRegion
from cmx.errors import CmxError
from cmx.storage.arena import SharedArena
from cmx.storage.nvme.dataplane import Extent, ExtentPlane, PlaneStats

__all__ = ["HostEndpoint", "RayEndpoint", "host_endpoint_actor"]


class HostEndpoint:
    def __init__(self, name: str, io_engine: str = "nixl") -> None:
        from cmx.actors.nixl_transport import PROGRESS_DELAY_US, _progress_thread_delay
        from cmx.nixl_api import nixl_api

        api = nixl_api()
        with _progress_thread_delay(PROGRESS_DELAY_US):
            self._nixl = api.nixl_agent(name, api.nixl_agent_config(backends=["UCX"]))
        self.name = name
        self.nvme = ExtentPlane(io_engine)
        # arena -> its mapping, its region, its NIXL registration
        self._arenas: dict[str, tuple[SharedArena, HostRegion, Any]] = {}

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
                        tuple(r for _, r, _ in self._arenas.values()))

    def read_extent(self, extent: Extent, arena: str, slot: int) -> None:
        self.nvme.read_many([extent], [self._slot(arena, slot)])

    def write_extent(self, extent: Extent, arena: str, slot: int) -> None:
        self.nvme.write_many([extent], [self._slot(arena, slot)])

    def move_extents(self, pairs: list[tuple[Extent, Extent]]) -> list[bool | None]:
        """Compaction's copies on the host: each block from its old extent to its new one,
        verified (None: its bytes failed their checksum, it was not copied)."""
        return self.nvme.copy_many(pairs)

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


def host_endpoint_actor() -> Any:
    """``HostEndpoint`` as a Ray actor class (Ray imported only where it is used)."""
    import ray

    return ray.remote(num_cpus=0)(HostEndpoint)


class RayEndpoint:
    """A host endpoint actor called as ``dpu_access.Endpoint``: each call bounded."""

    def __init__(self, handle: Any, timeout_s: float = 60.0) -> None:
        self._handle = handle
        self._timeout_s = timeout_s

    def _get(self, ref: Any) -> Any:
        import ray

        return ray.get(ref, timeout=self._timeout_s)

    def peer(self) -> HostPeer:
        return self._get(self._handle.peer.remote())  # type: ignore[no-any-return]

    def attach(self, info: ArenaInfo) -> HostRegion:
        return self._get(self._handle.attach.remote(info))  # type: ignore[no-any-return]

    def read_extent(self, extent: Extent, arena: str, slot: int) -> None:
        self._get(self._handle.read_extent.remote(extent, arena, slot))

    def write_extent(self, extent: Extent, arena: str, slot: int) -> None:
        self._get(self._handle.write_extent.remote(extent, arena, slot))

    def move_extents(self, pairs: list[tuple[Extent, Extent]]) -> list[bool | None]:
        return self._get(self._handle.move_extents.remote(pairs))  # type: ignore[no-any-return]
