"""Node-to-node transports: NIXL over UCX, and a Ray object-store fallback.

A transport moves whole slots of registered regions (shared-memory arenas) between offload
agents. Each agent registers its regions once and publishes a ``PeerInfo``; a reader connects
to a peer once (``connect``), preparing one descriptor list per region on both sides, and
then every ``read`` is a prepared transfer by slot index: no registration and no descriptor
building on the hot path.

Protocol, in call order: ``register(region)`` for every local region, ``info()`` to publish,
``connect(peer_info)`` on the reader, then ``read(peer, moves)`` any number of times.
``read`` returns once the bytes are in the local slots or raises TransferError; it never
returns partial data silently.
"""

from __future__ import annotations

import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field

import numpy as np

from cmx.errors import CmxError
from cmx.nixl_api import nixl_api

__all__ = [
    "Move",
    "NixlTransport",
    "PeerInfo",
    "RayTransport",
    "Region",
    "Transport",
    "TransferError",
    "make_transport",
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


OnDone = Callable[[Sequence[Move]], None]  # a batch of moves has landed

# Moves per NIXL request: a load's requests are all in flight at once, and the blocks of each
# are verified as it completes, while later ones still move (4 x 32 MiB: 128 MiB a request).
PIPELINE_MOVES = 4


@dataclass(frozen=True)
class PeerInfo:
    agent: str  # unique agent name (node id + incarnation)
    transport: str  # "nixl-ucx" or "ray"
    regions: tuple[Region, ...]
    metadata: bytes = b""  # NIXL agent metadata


@dataclass
class TransportStats:
    reads: int = 0
    bytes_read: int = 0
    seconds: float = 0.0
    failures: int = 0
    per_peer: dict[str, int] = field(default_factory=dict)


class Transport(ABC):
    name: str

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
              on_done: OnDone) -> None: ...

    def read(self, peer: PeerInfo, moves: Sequence[Move], timeout_s: float = 30.0,
             on_done: OnDone | None = None) -> int:
        """Move ``moves`` from ``peer``; returns bytes moved.

        ``on_done(batch)`` is called with each batch of moves as soon as it has landed, while
        later batches may still be moving: the caller verifies early blocks during the rest.
        """
        if not moves:
            return 0
        start = time.perf_counter()
        try:
            self._read(peer, moves, timeout_s, on_done or (lambda _batch: None))
        except TransferError:
            self.stats.failures += 1
            raise
        nbytes = sum(self.regions[m.dst_region][0].slot_bytes for m in moves)
        self.stats.reads += 1
        self.stats.bytes_read += nbytes
        self.stats.seconds += time.perf_counter() - start
        self.stats.per_peer[peer.agent] = self.stats.per_peer.get(peer.agent, 0) + nbytes
        return nbytes

    def close(self) -> None:  # noqa: B027 - most transports hold nothing to release
        """Release transport resources."""


class NixlTransport(Transport):
    """NIXL agent with the UCX backend; regions prepared once as strided descriptor lists."""

    name = "nixl-ucx"

    def __init__(self, agent: str) -> None:
        super().__init__(agent)
        api = nixl_api()
        with _progress_thread_delay(PROGRESS_DELAY_US):
            self._nixl = api.nixl_agent(agent, api.nixl_agent_config(backends=["UCX"]))
        self._local: dict[str, object] = {}  # region -> prepared local dlist
        self._remote: dict[tuple[str, str], object] = {}  # (peer, region) -> prepared dlist
        self._peers: dict[str, bytes] = {}  # peer agent -> metadata it was connected with

    def register(self, region: Region, buffer: np.ndarray) -> None:
        super().register(region, buffer)
        nbytes = region.slot_bytes * region.num_slots
        self._nixl.register_memory([(region.base, nbytes, 0, "")], "DRAM")
        self._local[region.name] = self._nixl.prep_xfer_dlist(
            "NIXL_INIT_AGENT", _strided(region), "DRAM"
        )

    def info(self) -> PeerInfo:
        return PeerInfo(
            agent=self.agent,
            transport=self.name,
            regions=tuple(r for r, _ in self.regions.values()),
            metadata=self._nixl.get_agent_metadata(),
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
                name, _strided(region), "DRAM"
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
              on_done: OnDone) -> None:
        groups: dict[tuple[str, str], list[Move]] = {}
        for m in moves:
            groups.setdefault((m.src_region, m.dst_region), []).append(m)
        batches = [group[i : i + PIPELINE_MOVES] for group in groups.values()
                   for i in range(0, len(group), PIPELINE_MOVES)]
        handles: list[object] = []
        try:
            self.connect(peer)
            self._start_and_wait(peer, batches, handles, timeout_s, on_done)
        except TransferError:
            raise
        except Exception as exc:  # noqa: BLE001 - NIXL raises its own kinds (a peer gone, ...)
            raise TransferError(f"transfer from {peer.agent} failed: {exc}") from exc
        finally:
            for h in handles:
                try:
                    self._nixl.release_xfer_handle(h)
                except Exception:  # noqa: BLE001 - a failed transfer may refuse release
                    pass

    def _start_and_wait(
        self, peer: PeerInfo, batches: list[list[Move]], handles: list[object],
        timeout_s: float, on_done: OnDone,
    ) -> None:
        """Start one prepared READ per batch (all in flight); wait for each in turn."""
        for batch in batches:
            src_region, dst_region = batch[0].src_region, batch[0].dst_region
            remote = self._remote.get((peer.agent, src_region))
            if remote is None:
                raise TransferError(f"peer {peer.agent} has no region {src_region}")
            h = self._nixl.make_prepped_xfer(
                "READ", self._local[dst_region], [m.dst_slot for m in batch],
                remote, [m.src_slot for m in batch],
            )
            if self._nixl.transfer(h) == "ERR":
                raise TransferError(f"transfer from {peer.agent} could not start")
            handles.append(h)
        deadline = time.monotonic() + timeout_s
        for h, batch in zip(handles, batches):
            pause = 20e-6  # back off while polling: a spinning poller starves UCX's progress
            while (state := self._nixl.check_xfer_state(h)) != "DONE":
                if state == "ERR":
                    raise TransferError(f"transfer from {peer.agent} failed")
                if time.monotonic() > deadline:
                    raise TransferError(f"transfer from {peer.agent} timed out")
                time.sleep(pause)
                pause = min(pause * 2, 1e-3)
            on_done(batch)

    def close(self) -> None:
        for peer in list(self._peers):
            self._forget(peer)


class RayTransport(Transport):
    """Fallback where NIXL cannot load: the peer's slots travel through Ray's object store.

    ``fetch(peer_agent, [(region, slot)])`` is supplied by the agent: a call on the peer agent's
    actor that returns the slots' bytes.
    """

    name = "ray"

    def __init__(
        self, agent: str, fetch: Callable[[str, list[tuple[str, int]]], list[np.ndarray]]
    ) -> None:
        super().__init__(agent)
        self._fetch = fetch

    def info(self) -> PeerInfo:
        return PeerInfo(self.agent, self.name, tuple(r for r, _ in self.regions.values()))

    def connect(self, peer: PeerInfo) -> None:
        """Nothing to prepare."""

    def _read(self, peer: PeerInfo, moves: Sequence[Move], timeout_s: float,
              on_done: OnDone) -> None:
        try:
            blobs = self._fetch(peer.agent, [(m.src_region, m.src_slot) for m in moves])
        except Exception as exc:  # noqa: BLE001 - any failure of the peer is a failed transfer
            raise TransferError(f"fetch from {peer.agent} failed: {exc}") from exc
        for m, blob in zip(moves, blobs):
            region, buf = self.regions[m.dst_region]
            off = m.dst_slot * region.slot_bytes
            buf[off : off + blob.nbytes] = blob
        on_done(moves)


def make_transport(
    agent: str,
    prefer: str,
    fetch: Callable[[str, list[tuple[str, int]]], list[np.ndarray]],
) -> Transport:
    """NIXL where it loads (unless ``prefer == "ray"``), else the Ray fallback."""
    if prefer != "ray":
        try:
            return NixlTransport(agent)
        except Exception:  # noqa: BLE001 - any load failure means falling back
            if prefer == "nixl":
                raise
    return RayTransport(agent, fetch)


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
        class DelayedConfig(original):  # type: ignore[misc, valid-type]
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


def _strided(region: Region) -> np.ndarray:
    """One row (addr, len, dev, stride, count): every slot of the region as a descriptor."""
    return np.array(
        [[region.base, region.slot_bytes, 0, region.slot_bytes, region.num_slots]],
        dtype=np.uint64,
    )
