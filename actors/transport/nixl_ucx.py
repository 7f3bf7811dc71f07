"""NIXL over UCX: the transport between offload agents (and pool nodes).

Each agent registers its arenas once and prepares one descriptor list per region, a
descriptor per piece of every slot; a read is prepared transfers by piece index, with no
registration and no descriptor building on the hot path.

A slot travels in pieces of PIECE_BYTES (a whole slot where that does not divide it), and a
slot smaller than a piece travels with its neighbours, up to PIECE_BYTES a request. LANES
threads take one slot at a time (or one request of small slots) and move its pieces in
order, each on a UCX worker of its own (NIXL gives each thread that posts a worker, round
robin): post a piece, wait for it, report it, so that the caller's checksum reads bytes that
just landed, from the cache. Between processes on one host UCX copies with CMA in the thread
that posts, so lanes are what puts a second core on the copy. Measured here, 1 GiB of
32 MiB slots between two processes, checksums included, with NIXL's progress thread running:
one thread, whole slots, checksums after the copy 5.2-5.9 GB/s; two lanes, whole slots
6.2-6.5; two lanes, 2 MiB pieces 7.1-7.8 (8.1-8.9 with no checksum at all). Without the
progress thread (see ``NixlTransport``), two lanes and 2 MiB pieces: 9.6-11.1 GB/s.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np

from cmx.actors.transport.base import Move, OnLanded, PeerInfo, Region, TransferError, Transport
from cmx.nixl_api import nixl_api

__all__ = ["LANES", "PIECE_BYTES", "NixlTransport"]

PIECE_BYTES = 2 << 20
LANES = 2


class NixlTransport(Transport):
    """Two NIXL agents with the UCX backend, both with this process's regions registered:

    - the *target*, whose metadata peers connect to, has a progress thread: a peer's
      connection needs this side to make progress even while it moves nothing itself;
    - the *reader* posts this process's reads and has no progress thread: each lane makes
      progress on its own UCX worker as it waits. A progress thread would take every
      worker's lock in turn to poll them all, and the lanes then queued behind it: 1 GiB of
      32 MiB slots between two processes, checked piece by piece, moved at 7.7-8.1 GB/s with
      one and 9.6-11.1 GB/s without.
    """

    name = "nixl-ucx"
    reads_ranges = True

    def __init__(self, agent: str, lanes: int = LANES) -> None:
        super().__init__(agent)
        api = nixl_api()
        with _progress_thread_delay(PROGRESS_DELAY_US):
            self._target = api.nixl_agent(agent, api.nixl_agent_config(backends=["UCX"]))
        self._nixl = api.nixl_agent(
            f"{agent}-reader", api.nixl_agent_config(enable_prog_thread=False, backends=[]))
        self._nixl.create_backend("UCX", {"num_workers": str(lanes)})
        self._lanes = ThreadPoolExecutor(lanes, thread_name_prefix="cmx-nixl-lane")
        self._num_lanes = lanes
        self._local: dict[str, object] = {}  # region -> prepared local dlist
        self._remote: dict[tuple[str, str], object] = {}  # (peer, region) -> prepared dlist
        self._peers: dict[str, bytes] = {}  # peer agent -> metadata it was connected with

    def register(self, region: Region, buffer: np.ndarray) -> None:
        super().register(region, buffer)
        nbytes = region.slot_bytes * region.num_slots
        for nixl in (self._target, self._nixl):
            nixl.register_memory([(region.base, nbytes, 0, "")], "DRAM")
        self._local[region.name] = self._nixl.prep_xfer_dlist(
            "NIXL_INIT_AGENT", _pieces(region), "DRAM"
        )

    def info(self) -> PeerInfo:
        return PeerInfo(
            agent=self.agent,
            transport=self.name,
            regions=tuple(r for r, _ in self.regions.values()),
            metadata=self._target.get_agent_metadata(),
        )

    def connect(self, peer: PeerInfo) -> None:
        if self._peers.get(peer.agent) == peer.metadata:
            return
        if peer.agent in self._peers:  # the peer restarted: forget its old registrations
            self._forget(peer.agent)
        remote_name = self._nixl.add_remote_agent(peer.metadata)
        name = remote_name.decode() if isinstance(remote_name, bytes) else remote_name
        for region in peer.regions:
            self._remote[(peer.agent, region.name)] = self._nixl.prep_xfer_dlist(
                name, _pieces(region), "DRAM"
            )
        self._peers[peer.agent] = peer.metadata

    def _forget(self, peer: str) -> None:
        for key in [k for k in self._remote if k[0] == peer]:
            handle = self._remote.pop(key)
            release = getattr(handle, "release", None)
            if release:
                release()
        self._peers.pop(peer, None)
        try:
            self._nixl.remove_remote_agent(peer)
        except Exception:  # noqa: BLE001 - already gone is fine
            pass

    def _read(self, peer: PeerInfo, moves: Sequence[Move], timeout_s: float,
              on_landed: OnLanded) -> None:
        try:
            self.connect(peer)
            units = _Units(self._units(peer, moves))
        except Exception as exc:  # noqa: BLE001 - NIXL raises its own kinds (a peer gone, ...)
            raise TransferError(f"transfer from {peer.agent} failed: {exc}") from exc
        deadline = time.monotonic() + timeout_s
        lanes = [self._lanes.submit(self._lane, peer.agent, units, deadline, on_landed)
                 for _ in range(min(self._num_lanes, len(units)))]
        errors = [err for lane in lanes if (err := lane.exception()) is not None]
        if errors:
            first = errors[0]
            if isinstance(first, TransferError):
                raise first
            raise TransferError(f"transfer from {peer.agent} failed: {first}") from first

    def _units(self, peer: PeerInfo, moves: Sequence[Move]) -> list[list[_Request]]:
        """What one lane takes at a time: a slot's requests (one per piece), or one request
        of several small slots."""
        units: list[list[_Request]] = []
        groups: dict[tuple[str, str], list[Move]] = {}
        for m in moves:
            groups.setdefault((m.src_region, m.dst_region), []).append(m)
        for (src_region, dst_region), group in groups.items():
            remote = self._remote.get((peer.agent, src_region))
            if remote is None:
                raise TransferError(f"peer {peer.agent} has no region {src_region}")
            local = self._local[dst_region]
            slot = self.regions[dst_region][0].slot_bytes
            piece = _piece_bytes(slot)
            per_slot = slot // piece
            if per_slot > 1:
                units += [[_Request(local, remote, [(m, j * piece, (j + 1) * piece)],
                                    [m.dst_slot * per_slot + j], [m.src_slot * per_slot + j])
                           for j in range(per_slot)] for m in group]
                continue
            per_request = max(1, PIECE_BYTES // slot)
            for i in range(0, len(group), per_request):
                batch = group[i:i + per_request]
                units.append([_Request(local, remote, [(m, 0, slot) for m in batch],
                                       [m.dst_slot for m in batch], [m.src_slot for m in batch])])
        return units

    def _lane(self, peer: str, units: _Units, deadline: float, on_landed: OnLanded) -> None:
        """Take units until none is left; move each one's requests in order, reporting each
        piece as it lands."""
        try:
            while (unit := units.take()) is not None:
                for request in unit:
                    handle = self._post(peer, request)
                    try:
                        self._wait(peer, handle, deadline, units)
                    finally:
                        self._release(handle)
                    for move, start, stop in request.landed:
                        on_landed(move, start, stop)
        except BaseException:
            units.stop()
            raise

    def _post(self, peer: str, request: _Request) -> object:
        handle = self._nixl.make_prepped_xfer(
            "READ", request.local, request.local_idx, request.remote, request.remote_idx)
        if self._nixl.transfer(handle) == "ERR":
            self._release(handle)
            raise TransferError(f"transfer from {peer} could not start")
        return handle

    def _release(self, handle: object) -> None:
        try:
            self._nixl.release_xfer_handle(handle)
        except Exception:  # noqa: BLE001 - a failed transfer may refuse release
            pass

    def _wait(self, peer: str, handle: object, deadline: float, units: _Units) -> None:
        pause = 20e-6  # back off while polling: a spinning poller starves UCX's progress
        while (state := self._nixl.check_xfer_state(handle)) != "DONE":
            if state == "ERR":
                raise TransferError(f"transfer from {peer} failed")
            if units.stopped:
                raise TransferError(f"transfer from {peer} stopped: another lane failed")
            if time.monotonic() > deadline:
                raise TransferError(f"transfer from {peer} timed out")
            time.sleep(pause)
            pause = min(pause * 2, 1e-3)

    def read_ranges(self, peer: PeerInfo, remote: np.ndarray, local: np.ndarray,
                    landing: np.ndarray, timeout_s: float = 30.0) -> int:
        """One READ of many descriptors (a partial load's ranges, ``slices.expose``), posted
        and waited for on this thread; ``landing`` is registered for this read only."""
        nbytes = int(remote[:, 1].sum())
        if nbytes == 0:
            return 0
        start = time.perf_counter()
        try:
            self._read_ranges(peer, remote, local, landing, time.monotonic() + timeout_s)
        except TransferError:
            self.stats.failures += 1
            raise
        self.stats.reads += 1
        self.stats.range_reads += 1
        self.stats.bytes_read += nbytes
        self.stats.range_bytes += nbytes
        self.stats.seconds += time.perf_counter() - start
        self.stats.per_peer[peer.agent] = self.stats.per_peer.get(peer.agent, 0) + nbytes
        return nbytes

    def _read_ranges(self, peer: PeerInfo, remote: np.ndarray, local: np.ndarray,
                     landing: np.ndarray, deadline: float) -> None:
        handle = reg = None
        try:
            self.connect(peer)
            reg = self._nixl.register_memory(
                [(landing.ctypes.data, landing.nbytes, 0, "")], "DRAM")
            handle = self._nixl.initialize_xfer(
                "READ", self._nixl.get_xfer_descs(local, "DRAM"),
                self._nixl.get_xfer_descs(remote, "DRAM"), peer.agent)
            if self._nixl.transfer(handle) == "ERR":
                raise TransferError(f"transfer from {peer.agent} could not start")
            self._wait(peer.agent, handle, deadline, _Units([]))
        except TransferError:
            raise
        except Exception as exc:  # noqa: BLE001 - NIXL raises its own kinds (a peer gone, ...)
            raise TransferError(f"transfer from {peer.agent} failed: {exc}") from exc
        finally:
            if handle is not None:
                self._release(handle)
            if reg is not None:
                self._nixl.deregister_memory(reg)

    def close(self) -> None:
        """Stop the lanes and destroy both NIXL agents now, not when the last reference to
        this transport goes: the target's progress thread polls every PROGRESS_DELAY_US until
        its agent is destroyed, and a process that made many agents would spin on them all."""
        self._lanes.shutdown(wait=True)
        for peer in list(self._peers):
            self._forget(peer)
        self._local.clear()
        self._target = self._nixl = _CLOSED


@dataclass(frozen=True)
class _Request:
    """One prepared READ: piece indexes on both sides, and what it lands."""

    local: object  # prepared local dlist
    remote: object  # prepared remote dlist
    landed: list[tuple[Move, int, int]]  # (move, start, stop) in its slot, in order
    local_idx: list[int]
    remote_idx: list[int]


class _Units:
    """The units of one read, handed to its lanes one at a time."""

    def __init__(self, units: list[list[_Request]]) -> None:
        self._todo = deque(units)
        self._lock = threading.Lock()
        self.stopped = False  # a lane failed: the others stop posting and waiting

    def __len__(self) -> int:
        return len(self._todo)

    def take(self) -> list[_Request] | None:
        with self._lock:
            return None if self.stopped or not self._todo else self._todo.popleft()

    def stop(self) -> None:
        self.stopped = True


# The NIXL agent's progress thread serves peers' reads (UCX wire-up needs the target to
# progress). The Python wrapper starts it with no delay between polls, which keeps a core busy
# per agent: on a 2-core node, two agents and a pool node starve everything else. A 100 us
# pause costs at most that much latency per transfer and brings an idle agent to ~2% of a core.
PROGRESS_DELAY_US = 100
_config_lock = threading.Lock()


@contextmanager
def _progress_thread_delay(delay_us: int) -> Iterator[None]:
    """While held, NIXL agents are created with ``delay_us`` between progress polls."""
    bind = nixl_api().nixlBind
    original = bind.nixlAgentConfig

    try:
        class DelayedConfig(original):  # type: ignore[misc, valid-type]  # found at run time
            def __setattr__(self, name: str, value: object) -> None:
                super().__setattr__(name, delay_us if name == "pthrDelay" else value)
    except TypeError:  # the binding cannot be subclassed: keep NIXL's default
        yield
        return
    with _config_lock:
        bind.nixlAgentConfig = DelayedConfig
        try:
            yield
        finally:
            bind.nixlAgentConfig = original


def _piece_bytes(slot_bytes: int) -> int:
    """The size a slot travels in: PIECE_BYTES where that divides it, else the whole slot."""
    if slot_bytes > PIECE_BYTES and slot_bytes % PIECE_BYTES == 0:
        return PIECE_BYTES
    return slot_bytes


def _pieces(region: Region) -> np.ndarray:
    """One row (addr, len, dev, stride, count): every piece of every slot as a descriptor;
    piece ``j`` of slot ``s`` is descriptor ``s * (slot_bytes // piece) + j``."""
    piece = _piece_bytes(region.slot_bytes)
    count = region.num_slots * (region.slot_bytes // piece)
    return np.array([[region.base, piece, 0, piece, count]], dtype=np.uint64)


class _Closed:
    """Stands in for a closed transport's NIXL agents: any use of them is a TransferError."""

    def __getattr__(self, name: str) -> Any:
        raise TransferError(f"the NIXL transport is closed (used: {name})")


_CLOSED: Any = _Closed()
