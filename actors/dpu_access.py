"""How an offload agent reaches its host's bytes: arena slots (HBM, DRAM) and NVMe extents.

An agent on its own node maps the host's arenas and opens the NVMe segment files
(``LocalAccess``). An agent on a DPU is on another computer: it has neither the host's shared
memory nor its files, and every byte goes through NIXL (``NixlAccess``): the host runs a
``HostEndpoint`` (``dpu_host.py``) that registers its arenas with NIXL's UCX backend and
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

import itertools
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from cmx.actors.arena_tier import ArenaInfo
from cmx.actors.dpu_bounce import BouncePool
from cmx.actors.transport import TransferError
from cmx.errors import CmxError
from cmx.selection import Runs, gather, runs_bytes
from cmx.storage.arena import SharedArena
from cmx.storage.nvme.dataplane import Extent, ExtentPlane

__all__ = ["STAGING_TIER", "BouncePool", "HostAccess", "HostAccessForbidden", "HostArenaRetired",
           "HostPeer", "HostRegion", "LocalAccess", "NixlAccess", "NoHostFiles",
           "forbid_host_access"]

STAGING_TIER = "staging"  # the ``tier`` of a host endpoint's staging region, no tier's arena


class HostArenaRetired(TransferError):
    """A move into or out of an arena of an earlier incarnation of a host tier: the tier
    restarted, the endpoint let the arena go, and no byte may land in it."""


class HostAccessForbidden(CmxError):
    """An agent that reaches its host over the network tried to map host memory or open a
    host file: a DPU, a separate computer, has no such path."""


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


PIECE_BYTES = 2 << 20  # one UCX descriptor: several in flight per transfer


class NixlAccess(HostAccess):
    """The agent on a DPU: every byte over NIXL, through ``buffers`` bounce buffers of
    ``bounce_bytes`` of its own memory.

    Host to host moves (a DRAM block into an HBM slot) pass through a bounce buffer: READ
    from the host, then WRITE to it, in windows of the buffer's size. Each move holds one
    buffer, so ``buffers`` moves are in flight at once (one block's crossing overlaps
    another's). Extents move on the host, through the endpoint's NIXL POSIX backend: the DPU
    commands them and carries no file.
    """

    name = "nixl-dpu"

    def __init__(self, agent: str, endpoint: Endpoint, bounce_bytes: int = 32 << 20,
                 timeout_s: float = 60.0, buffers: int = 2) -> None:
        from cmx.nixl_api import nixl_api

        api = nixl_api()
        self._nixl = api.nixl_agent(agent, api.nixl_agent_config(backends=["UCX"]))
        self._endpoint = endpoint
        self._timeout_s = timeout_s
        self.bounce = BouncePool(self._nixl, bounce_bytes, buffers, timeout_s)
        self._attaching = threading.Lock()  # one reload of the host's registrations at a time
        self._host = ""
        self._regions: dict[str, HostRegion] = {}  # what the endpoint has registered now
        self._retired: set[str] = set()  # arenas of tier incarnations the endpoint let go
        self.bytes_read = 0
        self.bytes_written = 0

    def attach(self, info: ArenaInfo) -> None:
        """Reach ``info``'s arena; re-resolve the rest from what the endpoint publishes now.

        The endpoint keeps one incarnation of each tier: attaching a tier's new arena lets
        the earlier one go there, and here its region is retired, so no move lands in it."""
        if info.arena in self._regions:
            return
        self._endpoint.attach(info)
        peer = self._endpoint.peer()  # the endpoint's registrations now include the region
        with self._attaching, self.bounce.every():  # no move runs during the reload
            if self._host and peer.agent != self._host:
                self._forget_host()  # another endpoint: the host restarted it
            name = self._nixl.add_remote_agent(peer.metadata)
            self._host = name.decode() if isinstance(name, bytes) else name
            live = {r.arena: r for r in peer.regions}
            self._retired |= self._regions.keys() - live.keys()
            self._regions = live

    def _forget_host(self) -> None:
        try:
            self._nixl.remove_remote_agent(self._host)
        except Exception:  # noqa: BLE001 - the host may be gone already
            pass
        self._host = ""

    def view(self, arena: str, slot: int) -> np.ndarray:
        raise HostAccessForbidden(
            f"no view of host arena {arena}: an agent on a DPU reaches host memory through "
            "NIXL only")

    def read(self, arena: str, slot: int, nbytes: int) -> np.ndarray:
        out = np.empty(nbytes, np.uint8)
        with self.bounce.take() as buf:
            for off, n in self._windows(nbytes):
                self._move("READ", buf, self._region(arena).address(slot, off), n)
                out[off:off + n] = buf[:n]
        return out

    def read_runs(self, arena: str, slot: int, runs: Runs) -> np.ndarray:
        """Only the runs cross: each window of the bounce buffer in one READ, a descriptor
        per run (or piece of one)."""
        region = self._region(arena)
        if any(off < 0 or off + n > region.slot_bytes for off, n in runs):
            raise ValueError(f"runs {list(runs)[:4]}... leave a slot of {region.slot_bytes}")
        out = np.empty(runs_bytes(runs), np.uint8)
        with self.bounce.take() as buf:
            for at, ranges in self._run_windows(region, slot, runs):
                n = sum(length for _, length in ranges)
                self._move_ranges("READ", buf, ranges)
                out[at:at + n] = buf[:n]
        return out

    def write(self, arena: str, slot: int, data: np.ndarray) -> None:
        flat = data.view(np.uint8).reshape(-1)
        with self.bounce.take() as buf:
            for off, n in self._windows(flat.nbytes):
                buf[:n] = flat[off:off + n]
                self._move("WRITE", buf, self._region(arena).address(slot, off), n)

    def copy(self, src: tuple[str, int], dst: tuple[str, int], nbytes: int) -> None:
        with self.bounce.take() as buf:
            for off, n in self._windows(nbytes):
                self._move("READ", buf, self._region(src[0]).address(src[1], off), n)
                self._move("WRITE", buf, self._region(dst[0]).address(dst[1], off), n)

    def read_extent(self, extent: Extent, arena: str, slot: int) -> None:
        self._region(arena).address(slot)
        self._endpoint.read_extent(extent, arena, slot)

    def select(self, arena: str, slot: int, size: int, want: int, runs: Runs) -> int | None:
        """The checksum of the ``runs`` of a host slot's block, taken on the host after the
        whole block matched ``want`` there; None if it did not."""
        self._region(arena).address(slot)
        return self._endpoint.select(arena, slot, size, want, runs)

    def select_extent(self, extent: Extent, runs: Runs, slot: int) -> int | None:
        """The ``runs`` of an NVMe block gathered on the host into its staging ``slot``
        (the covering chunks checked there): their checksum, or None."""
        self.staging().address(slot)
        return self._endpoint.select_extent(extent, runs, slot)

    def staging(self) -> HostRegion:
        """The host endpoint's staging region (slots for partial loads from NVMe)."""
        found = [r for r in self._regions.values() if r.tier == STAGING_TIER]
        if not found:
            raise TransferError("the host endpoint has no staging region")
        return found[0]

    def write_extent(self, extent: Extent, arena: str, slot: int) -> None:
        self._region(arena).address(slot)
        self._endpoint.write_extent(extent, arena, slot)

    def close(self) -> None:
        if self._host:
            self._forget_host()

    def _region(self, arena: str) -> HostRegion:
        region = self._regions.get(arena)
        if region is None:
            if arena in self._retired:
                raise HostArenaRetired(
                    f"host arena {arena} is of an earlier incarnation of its tier")
            raise TransferError(f"host arena {arena} is not attached")
        return region

    def _windows(self, nbytes: int) -> Iterator[tuple[int, int]]:
        size = self.bounce.size
        for off in range(0, nbytes, size):
            yield off, min(size, nbytes - off)

    def _run_windows(self, region: HostRegion, slot: int, runs: Runs
                     ) -> Iterator[tuple[int, list[tuple[int, int]]]]:
        """The runs of a slot as (offset in the output, host ranges) windows, each at most a
        bounce buffer, each range at most a descriptor's piece."""
        size = self.bounce.size
        at, used, ranges = 0, 0, []
        for off, length in runs:
            while length:
                n = min(length, PIECE_BYTES, size - used)
                ranges.append((region.address(slot, off), n))
                off, length, used = off + n, length - n, used + n
                if used == size:
                    yield at, ranges
                    at, used, ranges = at + used, 0, []
        if ranges:
            yield at, ranges

    def _move(self, op: str, buf: np.ndarray, remote: int, nbytes: int) -> None:
        """``op`` between the front of bounce buffer ``buf`` and host memory at ``remote``."""
        self._move_ranges(op, buf, [(remote + o, min(PIECE_BYTES, nbytes - o))
                                    for o in range(0, nbytes, PIECE_BYTES)])

    def _move_ranges(self, op: str, buf: np.ndarray, ranges: list[tuple[int, int]]) -> None:
        """``op`` between the front of bounce buffer ``buf``, filled in order, and the host
        memory ``ranges`` (address, length)."""
        nbytes = sum(n for _, n in ranges)
        ends = itertools.accumulate(n for _, n in ranges)
        local = self._nixl.get_xfer_descs(
            [(buf.ctypes.data + end - n, n, 0) for end, (_, n) in zip(ends, ranges)], "DRAM")
        far = self._nixl.get_xfer_descs([(r, n, 0) for r, n in ranges], "DRAM")
        handle = self._nixl.initialize_xfer(op, local, far, self._host)
        try:
            if self._nixl.transfer(handle) == "ERR":
                raise TransferError(f"NIXL {op} to the host could not start")
            deadline = time.monotonic() + self._timeout_s
            pause = 20e-6
            while (state := self._nixl.check_xfer_state(handle)) != "DONE":
                if state == "ERR" or time.monotonic() > deadline:
                    raise TransferError(f"NIXL {op} to the host ended in {state}")
                time.sleep(pause)
                pause = min(2 * pause, 1e-3)
        finally:
            self._nixl.release_xfer_handle(handle)
        if op == "READ":
            self.bytes_read += nbytes
        else:
            self.bytes_written += nbytes


class NoHostFiles(ExtentPlane):
    """The NVMe plane of an agent that reaches its host over the network: it opens no host
    file (the host endpoint moves extents), so any attempt raises HostAccessForbidden."""

    def _open(self, path: str) -> Iterator[int]:  # type: ignore[override]
        return _refuse_open(self, path)


def _refuse_open(self: ExtentPlane, path: str) -> Iterator[int]:
    raise HostAccessForbidden(f"cannot open host file {path}: this process is a DPU's")


def forbid_host_access() -> None:
    """From now on, mapping a shared-memory arena or opening an NVMe segment in this process
    raises HostAccessForbidden: the process plays a DPU, which has neither. For the whole
    process and for good, as a separate computer would be."""

    def refuse_map(cls: Any, name: str, populate: bool = False) -> SharedArena:
        raise HostAccessForbidden(f"cannot map host arena {name}: this process is a DPU's")

    SharedArena.attach = classmethod(refuse_map)  # type: ignore[assignment, method-assign]
    ExtentPlane._open = _refuse_open  # type: ignore[assignment, method-assign]
