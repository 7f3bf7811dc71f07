"""``NixlAccess``: the host access of an agent on a DPU, every byte over NIXL.

Slots move over UCX between the host's registered arenas (``dpu.host.HostEndpoint``) and
bounce buffers of the agent's own memory (``dpu.bounce``); extents and selections are made on
the host by the endpoint, as the agent asks. An endpoint that restarts (Ray restarts its
actor in place) comes back with none of its registrations: the failed move is made once
more after every arena in use is attached to it again.
"""

from __future__ import annotations

import functools
import itertools
import logging
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, TypeVar, cast

import numpy as np

from cmx.actors.dpu.access import (
    STAGING_TIER,
    Endpoint,
    HostAccess,
    HostAccessForbidden,
    HostArenaRetired,
    HostRegion,
)
from cmx.actors.dpu.bounce import BouncePool
from cmx.actors.tiers.arena import ArenaInfo
from cmx.actors.transport.base import TransferError
from cmx.errors import CmxError
from cmx.selection import Runs, runs_bytes
from cmx.storage.nvme.dataplane import Extent

__all__ = ["PIECE_BYTES", "NixlAccess"]

log = logging.getLogger(__name__)

T = TypeVar("T")
F = TypeVar("F", bound=Callable[..., Any])


def _again_if_endpoint_restarted(method: F) -> F:
    """A move of ``NixlAccess`` made once more if it failed because the host endpoint
    restarted (``NixlAccess._again_if_restarted``)."""

    @functools.wraps(method)
    def move(self: NixlAccess, *args: Any) -> Any:
        return self._again_if_restarted(lambda: method(self, *args))

    return cast(F, move)


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
        self._metadata = b""  # the endpoint's NIXL agent as last loaded
        self._infos: dict[str, ArenaInfo] = {}  # each arena attached, by name, until retired
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
        self._infos[info.arena] = info
        self._endpoint.attach(info)
        self._resolve()

    def _resolve(self) -> bool:
        """Load the endpoint's registrations as it publishes them now; whether it restarted.

        An endpoint that restarted (its NIXL agent's metadata differ) holds none of the
        registrations made before: every arena still in use here is attached to it again
        first, so a live tier's arena is never taken for a retired one."""
        peer = self._endpoint.peer()
        restarted = bool(self._host) and peer.metadata != self._metadata
        if restarted:
            for info in [i for a, i in self._infos.items() if a not in self._retired]:
                try:
                    self._endpoint.attach(info)
                except (CmxError, OSError):  # its tier restarted too: it stays unpublished
                    pass
            peer = self._endpoint.peer()
        with self._attaching, self.bounce.every():  # no move runs during the reload
            if restarted:
                self._forget_host()
            name = self._nixl.add_remote_agent(peer.metadata)
            self._host = name.decode() if isinstance(name, bytes) else name
            self._metadata = peer.metadata
            live = {r.arena: r for r in peer.regions}
            self._retired |= self._regions.keys() - live.keys()
            self._regions = live
            for gone in self._infos.keys() & self._retired:
                del self._infos[gone]
        return restarted

    def _again_if_restarted(self, move: Callable[[], T]) -> T:
        """``move``; if it failed because the host endpoint restarted, once more after every
        arena in use is attached to the new one (a move is whole or raises, so making it
        again is safe). Any other failure is the caller's, unchanged."""
        try:
            return move()
        except HostArenaRetired:
            raise
        except CmxError:
            try:
                restarted = self._resolve()
            except (CmxError, OSError):
                restarted = False  # the endpoint is down: the first failure stands
            if not restarted:
                raise
        log.warning("host endpoint of %s restarted: its arenas attached again", self.name)
        return move()

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

    @_again_if_endpoint_restarted
    def read(self, arena: str, slot: int, nbytes: int) -> np.ndarray:
        out = np.empty(nbytes, np.uint8)
        with self.bounce.take() as buf:
            for off, n in self._windows(nbytes):
                self._move("READ", buf, self._region(arena).address(slot, off), n)
                out[off:off + n] = buf[:n]
        return out

    @_again_if_endpoint_restarted
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

    @_again_if_endpoint_restarted
    def write(self, arena: str, slot: int, data: np.ndarray) -> None:
        flat = data.view(np.uint8).reshape(-1)
        with self.bounce.take() as buf:
            for off, n in self._windows(flat.nbytes):
                buf[:n] = flat[off:off + n]
                self._move("WRITE", buf, self._region(arena).address(slot, off), n)

    @_again_if_endpoint_restarted
    def copy(self, src: tuple[str, int], dst: tuple[str, int], nbytes: int) -> None:
        with self.bounce.take() as buf:
            for off, n in self._windows(nbytes):
                self._move("READ", buf, self._region(src[0]).address(src[1], off), n)
                self._move("WRITE", buf, self._region(dst[0]).address(dst[1], off), n)

    @_again_if_endpoint_restarted
    def read_extent(self, extent: Extent, arena: str, slot: int) -> None:
        self._region(arena).address(slot)
        self._endpoint.read_extent(extent, arena, slot)

    @_again_if_endpoint_restarted
    def select(self, arena: str, slot: int, size: int, want: int, runs: Runs) -> int | None:
        """The checksum of the ``runs`` of a host slot's block, taken on the host after the
        whole block matched ``want`` there; None if it did not."""
        self._region(arena).address(slot)
        return self._endpoint.select(arena, slot, size, want, runs)

    @_again_if_endpoint_restarted
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

    @_again_if_endpoint_restarted
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
        handle = None
        try:
            handle = self._nixl.initialize_xfer(op, local, far, self._host)
            if self._nixl.transfer(handle) == "ERR":
                raise TransferError(f"NIXL {op} to the host could not start")
            deadline = time.monotonic() + self._timeout_s
            pause = 20e-6
            while (state := self._nixl.check_xfer_state(handle)) != "DONE":
                if state == "ERR" or time.monotonic() > deadline:
                    raise TransferError(f"NIXL {op} to the host ended in {state}")
                time.sleep(pause)
                pause = min(2 * pause, 1e-3)
        except TransferError:
            raise
        except Exception as exc:  # noqa: BLE001 - NIXL raises its own kinds (the host gone, ...)
            raise TransferError(f"NIXL {op} to the host failed: {exc}") from exc
        finally:
            if handle is not None:
                try:
                    self._nixl.release_xfer_handle(handle)
                except Exception:  # noqa: BLE001 - a failed transfer may refuse release
                    pass
        if op == "READ":
            self.bytes_read += nbytes
        else:
            self.bytes_written += nbytes
