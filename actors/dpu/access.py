"""How an offload agent reaches its host's bytes: arena slots (HBM, DRAM) and NVMe extents.

An agent on its own node maps the host's arenas and opens the NVMe segment files
(``LocalAccess``). An agent on a DPU is on another computer: it has neither the host's shared
memory nor its files, and every byte goes through NIXL (``nixl_access.NixlAccess``): the
host runs a ``HostEndpoint`` (``host.py``) that registers its arenas with NIXL's UCX backend and
serves NVMe extents through NIXL's POSIX backend; the DPU agent reads and writes host slots
over UCX through a bounce buffer of its own, and asks the endpoint to move extents between
the files and the host's slots. ``NixlAccess`` holds no arena mapping and no file: asking it
for a view of host memory raises ``HostAccessForbidden``, and ``forbid_host_access`` makes
mapping a host arena or opening a host file in its process raise too.

Protocol, in call order: ``attach(info)`` for each tier incarnation before its slots are
used; then any number of ``read``, ``read_runs``, ``write``, ``copy``, ``read_extent``,
``write_extent``; ``close`` last. Every call returns once the bytes are where it says, or
raises; none returns with part of a slot moved silently.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from cmx.actors.dpu.forbid import HostAccessForbidden, NoHostFiles, forbid_host_access
from cmx.actors.tiers.arena import ArenaInfo
from cmx.actors.transport.base import TransferError
from cmx.selection import Runs, gather
from cmx.storage.arena import SharedArena
from cmx.storage.nvme.dataplane import Extent, ExtentPlane

__all__ = ["STAGING_TIER", "Endpoint", "HostAccess", "HostAccessForbidden", "HostArenaRetired",
           "HostPeer", "HostRegion", "LocalAccess", "NoHostFiles", "forbid_host_access"]


STAGING_TIER = "staging"  # the ``tier`` of a host endpoint's staging region, no tier's arena


class HostArenaRetired(TransferError):
    """A move into or out of an arena of an earlier incarnation of a host tier: the tier
    restarted, the endpoint let the arena go, and no byte may land in it."""


@dataclass(frozen=True)
class HostRegion:
    """A host arena as registered with NIXL: where its slots are in the host's process."""

    arena: str
    base: int
    slot_bytes: int
    num_slots: int
    tier: str = ""  # the tier whose incarnation this arena is: one incarnation at a time
    epoch: str = ""

    def address(self, slot: int, offset: int = 0) -> int:
        if not 0 <= slot < self.num_slots:
            raise ValueError(f"slot {slot} outside arena {self.arena} of {self.num_slots}")
        return self.base + slot * self.slot_bytes + offset


@dataclass(frozen=True)
class HostPeer:
    """What a host endpoint publishes: its NIXL agent's metadata and its regions."""

    agent: str
    metadata: bytes
    regions: tuple[HostRegion, ...]


class HostAccess(ABC):
    """Moves between the agent and its host's slots and extents; see the module's protocol."""

    name: str

    @abstractmethod
    def attach(self, info: ArenaInfo) -> None:
        """Make ``info``'s arena reachable. Idempotent per arena."""

    @abstractmethod
    def read(self, arena: str, slot: int, nbytes: int) -> np.ndarray:
        """A copy of the first ``nbytes`` of a host slot, in the agent's memory."""

    @abstractmethod
    def read_runs(self, arena: str, slot: int, runs: Runs) -> np.ndarray:
        """A copy of the ``runs`` (offset, length) of a host slot, concatenated in order."""

    @abstractmethod
    def write(self, arena: str, slot: int, data: np.ndarray) -> None:
        """``data`` into the front of a host slot."""

    @abstractmethod
    def copy(self, src: tuple[str, int], dst: tuple[str, int], nbytes: int) -> None:
        """The first ``nbytes`` of host slot ``src`` (arena, slot) into host slot ``dst``."""

    @abstractmethod
    def read_extent(self, extent: Extent, arena: str, slot: int) -> None:
        """An NVMe extent of the host into the front of a host slot."""

    @abstractmethod
    def write_extent(self, extent: Extent, arena: str, slot: int) -> None:
        """The front of a host slot into an NVMe extent of the host."""

    def close(self) -> None:  # noqa: B027 - nothing to end by default
        pass


class LocalAccess(HostAccess):
    """The agent on its host: the arenas mapped here, the segment files opened here."""

    name = "local"

    def __init__(self, nvme: ExtentPlane | None = None) -> None:
        self.nvme = nvme or ExtentPlane()
        self._arenas: dict[str, SharedArena] = {}

    def attach(self, info: ArenaInfo) -> None:
        if info.arena not in self._arenas:
            self._arenas[info.arena] = SharedArena.attach(info.arena, populate=True)

    def view(self, arena: str, slot: int) -> np.ndarray:
        """The slot itself (no copy): only an agent on its host has one."""
        return self._arenas[arena].slot_view(slot)

    def read(self, arena: str, slot: int, nbytes: int) -> np.ndarray:
        return self.view(arena, slot)[:nbytes].copy()

    def read_runs(self, arena: str, slot: int, runs: Runs) -> np.ndarray:
        return gather(self.view(arena, slot), runs)

    def write(self, arena: str, slot: int, data: np.ndarray) -> None:
        np.copyto(self.view(arena, slot)[: data.nbytes], data.view(np.uint8).reshape(-1))

    def copy(self, src: tuple[str, int], dst: tuple[str, int], nbytes: int) -> None:
        np.copyto(self.view(*dst)[:nbytes], self.view(*src)[:nbytes])

    def read_extent(self, extent: Extent, arena: str, slot: int) -> None:
        self.nvme.read_many([extent], [self.view(arena, slot)])

    def write_extent(self, extent: Extent, arena: str, slot: int) -> None:
        self.nvme.write_many([extent], [self.view(arena, slot)])

    def close(self) -> None:
        self.nvme.close()
        for arena in self._arenas.values():
            arena.close()
        self._arenas.clear()


class Endpoint(Protocol):
    """The host endpoint as the DPU agent calls it (a Ray actor behind a bounded call)."""

    def peer(self) -> HostPeer: ...
    def attach(self, info: ArenaInfo) -> HostRegion: ...
    def read_extent(self, extent: Extent, arena: str, slot: int) -> None: ...
    def write_extent(self, extent: Extent, arena: str, slot: int) -> None: ...
    def move_extents(self, pairs: list[tuple[Extent, Extent]]) -> list[bool | None]: ...
    def select(self, arena: str, slot: int, size: int, want: int, runs: Runs) -> int | None: ...
    def select_extent(self, extent: Extent, runs: Runs, slot: int) -> int | None: ...
