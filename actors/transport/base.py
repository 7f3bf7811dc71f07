"""Node-to-node transports: the interface, and the Ray object-store fallback (NIXL over UCX is
in ``actors/transport/nixl_ucx.py``; one of them chosen: ``actors/transport/factory.py``).

A transport moves whole slots of registered regions (shared-memory arenas) between offload
agents. Each agent registers its regions once and publishes a ``PeerInfo``; a reader connects
to a peer once (``connect``), preparing one descriptor list per region on both sides, and
then every ``read`` is a prepared transfer by slot index: no registration and no descriptor
building on the hot path.

Protocol, in call order: ``register(region)`` for every local region, ``info()`` to publish,
``connect(peer_info)`` on the reader, then ``read(peer, moves)`` any number of times.
``read`` returns once the bytes are in the local slots or raises TransferError; it never
returns partial data silently. As the pieces of each slot land, in order, ``read`` reports
them (``on_landed``), so the caller checks each block while the rest still moves, and reads
the bytes it checks while they are still in the CPU's cache.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from cmx.errors import CmxError
from cmx.stats import TransportStats

__all__ = [
    "Move",
    "OnLanded",
    "PeerInfo",
    "RayTransport",
    "Region",
    "Transport",
    "TransferError",
]


class TransferError(CmxError):
    """A transfer failed or timed out; the destination slots hold no valid data."""


@dataclass(frozen=True)
class Region:
    """A registered memory region made of equal slots (one arena)."""

    name: str  # arena name, unique in the cluster
    base: int  # address of slot 0 in the owner's process
    slot_bytes: int
    num_slots: int


@dataclass(frozen=True)
class Move:
    """Copy ``remote`` slot ``src`` of the peer into local slot ``dst``."""

    src_region: str
    src_slot: int
    dst_region: str
    dst_slot: int


OnLanded = Callable[["Move", int, int], None]  # bytes [start, stop) of a move's slot landed

@dataclass(frozen=True)
class PeerInfo:
    agent: str  # unique agent name (node id + incarnation)
    transport: str  # "nixl-ucx" or "ray"
    regions: tuple[Region, ...]
    metadata: bytes = b""  # NIXL agent metadata


class Transport(ABC):
    name: str
    reads_ranges = False  # whether ``read_ranges`` moves byte ranges (NIXL does)

    def __init__(self, agent: str) -> None:
        self.agent = agent
        self.regions: dict[str, tuple[Region, np.ndarray]] = {}
        self.stats = TransportStats()

    def register(self, region: Region, buffer: np.ndarray) -> None:
        self.regions[region.name] = (region, buffer)

    @abstractmethod
    def info(self) -> PeerInfo: ...

    @abstractmethod
    def connect(self, peer: PeerInfo) -> None: ...

    @abstractmethod
    def _read(self, peer: PeerInfo, moves: Sequence[Move], timeout_s: float,
              on_landed: OnLanded) -> None: ...

    def read(self, peer: PeerInfo, moves: Sequence[Move], timeout_s: float = 30.0,
             on_landed: OnLanded | None = None) -> int:
        """Move ``moves`` from ``peer``; returns bytes moved.

        ``on_landed(move, start, stop)`` reports that bytes ``[start, stop)`` of the move's
        local slot have landed: for each move, pieces in order from ``0`` to the slot's size,
        from one thread; different moves may be reported from different threads at once.
        An exception it raises fails the read.
        """
        if not moves:
            return 0
        start = time.perf_counter()
        try:
            self._read(peer, moves, timeout_s, on_landed or (lambda _m, _a, _b: None))
        except TransferError:
            self.stats.failures += 1
            raise
        nbytes = sum(self.regions[m.dst_region][0].slot_bytes for m in moves)
        self.stats.reads += 1
        self.stats.bytes_read += nbytes
        self.stats.seconds += time.perf_counter() - start
        self.stats.per_peer[peer.agent] = self.stats.per_peer.get(peer.agent, 0) + nbytes
        return nbytes

    def read_ranges(self, peer: PeerInfo, remote: np.ndarray, local: np.ndarray,
                    landing: np.ndarray, timeout_s: float = 30.0) -> int:
        """Move byte ranges of the peer's registered regions into ``landing`` in one
        transfer; returns bytes moved. ``remote`` rows are (address at the peer, length, 0),
        ``local`` rows the same inside ``landing``, pairwise. Only where ``reads_ranges``."""
        raise TransferError(f"the {self.name} transport moves whole slots only")

    def close(self) -> None:  # noqa: B027 - most transports hold nothing to release
        """Release transport resources."""


class RayTransport(Transport):
    """Fallback where NIXL cannot load: the peer's slots travel through Ray's object store.

    ``fetch(peer_agent, [(region, slot)])`` is supplied by the agent: a call on the peer agent's
    actor that returns the slots' bytes.
    """

    name = "ray"

    def __init__(
        self, agent: str, fetch: Callable[[str, list[tuple[str, int]]], list[np.ndarray]],
        fallback_reason: str | None = None,
    ) -> None:
        super().__init__(agent)
        self._fetch = fetch
        self.fallback_reason = fallback_reason  # why NIXL is not used, when it was wanted

    def info(self) -> PeerInfo:
        return PeerInfo(self.agent, self.name, tuple(r for r, _ in self.regions.values()))

    def connect(self, peer: PeerInfo) -> None:
        """Nothing to prepare."""

    def _read(self, peer: PeerInfo, moves: Sequence[Move], timeout_s: float,
              on_landed: OnLanded) -> None:
        try:
            blobs = self._fetch(peer.agent, [(m.src_region, m.src_slot) for m in moves])
        except Exception as exc:  # noqa: BLE001 - any failure of the peer is a failed transfer
            raise TransferError(f"fetch from {peer.agent} failed: {exc}") from exc
        for m, blob in zip(moves, blobs):
            region, buf = self.regions[m.dst_region]
            off = m.dst_slot * region.slot_bytes
            buf[off : off + blob.nbytes] = blob
            on_landed(m, 0, blob.nbytes)
