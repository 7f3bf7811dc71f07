"""The offload agent on a DPU that reaches its host only over the network (``dpu_access="nixl"``).

A BlueField is a separate computer: it cannot map the host's shared memory or open the
host's NVMe files. This agent is the node's agent (``OffloadAgent``, its actor ``AgentActor``)
given other host parts (``dpu_agent_parts``: ``HostTiers`` and ``NixlHost``): the host's
arenas are reached through ``NixlAccess`` (UCX, via the host's ``HostEndpoint``), NVMe
extents (reads, writes, compaction's copies) move on the host through the endpoint's NIXL
POSIX backend, and the process refuses to map a host arena or open a host file at all
(``forbid_host_access``).

What it moves through NIXL: stores into DRAM, loads from this node's DRAM and NVMe, HBM to
DRAM demotions, DRAM to NVMe writes (write-through and write-back), and blocks between nodes.
Serving a peer: the agent pins and stages as any agent does, and publishes the host
endpoint's NIXL agent and regions as its own (``peer_info``): the peer's transport reads the
host's memory directly, as a remote NIC reaches host memory through the DPU. Pulling from a
peer: its transport reads the blocks into bounce slots in the DPU's own memory, where each
is checked as it lands, and the intact ones are written to their host HBM slots over NIXL.

A host tier that restarts has a new arena: the endpoint lets the earlier one go, and this
agent keeps no earlier incarnation either, so a copy into a grant or pin of a restarted
tier raises ``StaleEpochError`` before a byte moves (an agent on its host instead lets such
a copy land in the old, still mapped arena, whose commit is then refused).

Partial (layer or head) loads: each block is checked whole on the host, where its bytes
are (``HostEndpoint.select``; an NVMe copy as the checksummed chunks that cover the runs,
gathered into a slot of the endpoint's registered staging region), and only the selected
bytes cross: read here over NIXL for this node's client, or read by a peer straight from the
host's memory, as the whole-block peer path does.

An endpoint that restarts while its tiers do not (Ray restarts its actor in place) has none
of its registrations: ``NixlAccess`` finds that on the first move that fails, attaches every
arena in use to the new endpoint and makes the move once more.
"""

from __future__ import annotations

import functools
import logging
import threading
import uuid
from collections.abc import Sequence
from typing import Any

import numpy as np
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from cmx.actors.agent.host import HostBytes, LandedChecks
from cmx.actors.agent.scheduler import Priority, Scheduler
from cmx.actors.agent.shared import NodeTiers, Peers
from cmx.actors.dpu.access import (
    Endpoint,
    HostAccessForbidden,
    NoHostFiles,
    forbid_host_access,
)
from cmx.actors.dpu.host import RayEndpoint, host_endpoint_actor
from cmx.actors.dpu.nixl_access import NixlAccess
from cmx.actors.dpu.staging import HostOutbox, host_staging_slots
from cmx.actors.slices.expose import SliceOutbox
from cmx.actors.tiers.arena import ArenaInfo, Grant, Pinned
from cmx.actors.transport.base import Move, PeerInfo, Region, TransferError, Transport
from cmx.buffers import aligned_empty
from cmx.checksum import checksum
from cmx.config import ServiceConfig
from cmx.keys import BlockHash
from cmx.links import RAY_NAMESPACE, actor_name
from cmx.protocol import Staged
from cmx.selection import Runs, runs_bytes
from cmx.stats import HostAccessStats
from cmx.storage.nvme.chunks import block_sums
from cmx.storage.nvme.dataplane import Extent
from cmx.tiers import Tier

__all__ = ["BounceSlots", "DpuHost", "HostTiers", "NixlHost", "dpu_actor_parts",
           "dpu_agent_parts", "start_host_endpoint"]

log = logging.getLogger(__name__)


class HostArena:
    """A host arena as this agent knows it: a name to address over NIXL, never memory."""

    def __init__(self, name: str) -> None:
        self.name = name

    def slot_view(self, slot: int) -> np.ndarray:
        raise HostAccessForbidden(
            f"no view of host arena {self.name}: this agent reaches its host through NIXL")


class BounceSlots:
    """Slots of the DPU's own memory that blocks from peers land in before the host's HBM."""

    def __init__(self, name: str, slot_bytes: int, num_slots: int) -> None:
        self.name = name
        self.slot_bytes = slot_bytes
        self.num_slots = num_slots
        self.buffer = aligned_empty(slot_bytes * num_slots)
        self.buffer[:] = 0  # faulted in once, not on the first transfers

    @property
    def region(self) -> Region:
        return Region(self.name, self.buffer.ctypes.data, self.slot_bytes, self.num_slots)

    def slot_view(self, slot: int) -> np.ndarray:
        return self.buffer[slot * self.slot_bytes:(slot + 1) * self.slot_bytes]


MAX_BOUNCE_SLOTS = 8  # blocks from peers in flight at once through a DPU agent


def start_host_endpoint(node: str, config: ServiceConfig) -> Any:
    """The host endpoint of ``node``, on ``node`` (started once, found after)."""
    return host_endpoint_actor().options(
        name=actor_name("host-endpoint", node), namespace=RAY_NAMESPACE, get_if_exists=True,
        max_concurrency=8, scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False),
    ).remote(f"cmx-host-{node[:12]}-{uuid.uuid4().hex[:6]}", slot_bytes=config.block_bytes,
             staging_slots=host_staging_slots(config.block_bytes))


class HostTiers(NodeTiers):
    """The host's tiers as a DPU reaches them: each arena attached to the host endpoint and
    known here by name; an earlier incarnation is forgotten as the endpoint lets it go (no
    copy may land in it)."""

    keep_epochs = 1

    def __init__(self, node: str, link: Any, owner: str, transport: Transport,
                 nixl: NixlAccess) -> None:
        super().__init__(node, link, owner, transport)
        self.nixl = nixl

    def _map(self, info: ArenaInfo) -> Any:
        self.nixl.attach(info)
        return HostArena(info.arena)


class NixlHost(HostBytes):
    """The host's bytes from a DPU: every move over NIXL, through the host's endpoint."""

    def __init__(self, name: str, config: ServiceConfig, tiers: NodeTiers, peers: Peers,
                 scheduler: Scheduler, transport: Transport, nixl: NixlAccess,
                 endpoint: Endpoint) -> None:
        super().__init__(name, config, tiers, peers, scheduler, transport, NoHostFiles())
        self.nixl = nixl
        self.endpoint = endpoint
        slot_bytes = tiers.current(Tier.HBM)[0].slot_bytes
        self.bounce = BounceSlots(f"{name}-bounce", slot_bytes, max(1, min(
            MAX_BOUNCE_SLOTS, config.staging_bytes // slot_bytes)))
        transport.register(self.bounce.region, self.bounce.buffer)
        self._bounce_lock = threading.Lock()  # one pull through the bounce slots at a time
        self.bounced = 0  # bytes from peers that passed through the bounce slots

    def _name(self, epoch: str) -> str:
        return str(self.tiers.arena(epoch).name)

    # -- stores and local loads ----------------------------------------------------------------

    def _copy_block(self, grant: Grant, src: np.ndarray) -> tuple[Grant, int, int]:
        self.nixl.write(self._name(grant.epoch), grant.slot, src)
        return grant, src.nbytes, checksum(src)

    def read_extents(self, extents: Sequence[Extent], grants: Sequence[Grant],
                     priority: Priority) -> list[bool]:
        """One NIXL POSIX read per block on the host, then its bytes checked over NIXL."""
        jobs = [self.scheduler.submit(priority, functools.partial(self._read_extent, e, g))
                for e, g in zip(extents, grants)]
        return [f.result() for f in jobs]

    def _read_extent(self, ext: Extent, grant: Grant) -> bool:
        dst = self._name(grant.epoch)
        self.nixl.read_extent(ext, dst, grant.slot)
        return checksum(self.nixl.read(dst, grant.slot, ext.size)) == ext.checksum

    def copy_slot(self, src: Grant | Pinned, dst: Grant, nbytes: int) -> None:
        """Host slot to host slot over NIXL (a demotion, a local load)."""
        self.nixl.copy((self._name(src.epoch), src.slot), (self._name(dst.epoch), dst.slot),
                       nbytes)

    # -- DRAM to NVMe, and compaction ----------------------------------------------------------

    def slot_source(self, epoch: str, slot: int) -> tuple[str, int]:
        """A host slot by name (arena, slot): its bytes are read over NIXL."""
        return self._name(epoch), slot

    def write_extents(self, extents: Sequence[Extent], sources: Sequence[Any]
                      ) -> list[tuple[int, bytes]]:
        """Each block's checksums from its bytes read over NIXL; the host endpoint writes it
        to its extent."""
        jobs = [self.scheduler.submit(Priority.DEMOTE,
                                      functools.partial(self._to_extent, ext, src, ext.size))
                for ext, src in zip(extents, sources)]
        return [f.result() for f in jobs]

    def _to_extent(self, ext: Extent, src: tuple[str, int], size: int) -> tuple[int, bytes]:
        sums = block_sums(self.nixl.read(src[0], src[1], size))
        self.nixl.write_extent(ext, *src)
        return sums

    def copy_extents(self, pairs: Sequence[tuple[Extent, Extent]]) -> list[bool | None]:
        """Compaction's copies, made on the host by its endpoint (NIXL POSIX)."""
        return self.endpoint.move_extents(list(pairs))

    # -- other nodes: the peer path, every byte over NIXL ---------------------------------------

    def peer_info(self) -> PeerInfo:
        """The host endpoint's NIXL agent and regions: a peer reads the host's memory."""
        host = self.endpoint.peer()
        regions = tuple(Region(r.arena, r.base, r.slot_bytes, r.num_slots) for r in host.regions)
        return PeerInfo(host.agent, "nixl-ucx", regions, host.metadata)

    def read_slots(self, slots: Sequence[tuple[str, int]]) -> list[np.ndarray]:
        """The fallback transport's server side: whole host slots, read over NIXL."""
        size = {info.arena: info.slot_bytes for info, _ in self.tiers.in_use()}
        if missing := {region for region, _ in slots} - size.keys():
            raise TransferError(f"no host region {sorted(missing)} here")
        return [self.nixl.read(region, slot, size[region]) for region, slot in slots]

    def land_staged(self, peer_agent: str, pairs: list[tuple[int, Staged]],
                    granted: dict[int, Grant], priority: Priority) -> set[int]:
        """Blocks from a peer into the host's HBM through the bounce slots, a window of them
        at a time: the transport pulls a window in, each block checked as it lands; the
        intact ones go to their host slots over NIXL."""
        intact: set[int] = set()
        width = self.bounce.num_slots
        with self._bounce_lock:
            for start in range(0, len(pairs), width):
                intact |= self._land_window(peer_agent, pairs[start:start + width], granted,
                                            priority)
        return intact

    def _land_window(self, peer_agent: str, pairs: list[tuple[int, Staged]],
                     granted: dict[int, Grant], priority: Priority) -> set[int]:
        dsts = [(self._name(granted[i].epoch), granted[i].slot) for i, _ in pairs]
        moves = [Move(s.region, s.slot, self.bounce.name, j) for j, (_, s) in enumerate(pairs)]
        checks = LandedChecks({m: (self.bounce, s.size, s.checksum)
                               for m, (_, s) in zip(moves, pairs)})
        self.transfer(peer_agent, [s for _, s in pairs], moves, checks.landed, priority)
        landed = [(i, s, dst, self.bounce.slot_view(m.dst_slot)[:s.size])
                  for m, (i, s), dst in zip(moves, pairs, dsts) if m in checks.intact]
        writes = [self.scheduler.submit(priority, functools.partial(self.nixl.write, *dst, src))
                  for _, _, dst, src in landed]  # as many at once as there are bounce buffers
        for w in writes:
            w.result()
        self.bounced += sum(s.size for _, s, _, _ in landed)
        return {i for i, _, _, _ in landed}

    # -- partial loads: checked on the host, only the selected bytes cross ---------------------

    def _make_outbox(self) -> SliceOutbox:
        staging = self.nixl.staging()
        return HostOutbox(
            Region(staging.arena, staging.base, staging.slot_bytes, staging.num_slots),
            self.config.lease_s, self.tiers.owner)

    def pinned_selection_checksum(self, pin: Pinned, runs: Runs) -> int | None:
        return self.nixl.select(self._name(pin.epoch), pin.slot, pin.size, pin.checksum, runs)

    def pinned_selection(self, pin: Pinned, runs: Runs) -> np.ndarray | None:
        want = self.pinned_selection_checksum(pin, runs)
        if want is None:
            return None
        return self._crossed(self.nixl.read_runs(self._name(pin.epoch), pin.slot, runs), want)

    def extent_into_outbox(self, ext: Extent, runs: Runs, box: SliceOutbox,
                           slot: int) -> int | None:
        try:
            return self.nixl.select_extent(ext, runs, slot)
        except TransferError:
            if isinstance(box, HostOutbox):
                box.doubt(slot)  # the gather may still land: the slot waits for expiry
            raise

    def extent_selection(self, ext: Extent, runs: Runs) -> np.ndarray | None:
        """Gathered on the host into a staging slot held for the read, then read over NIXL."""
        box = self.outbox()
        took = box.take(self.tiers.owner, BlockHash(ext.key))
        if took is None:
            raise TransferError("every host staging slot is in use")
        slot, lease = took
        try:
            want = self.extent_into_outbox(ext, runs, box, slot)
            if want is None:
                return None
            data = self.nixl.read_runs(box.region.name, slot, ((0, runs_bytes(runs)),))
            return self._crossed(data, want)
        finally:
            box.end([lease])

    @staticmethod
    def _crossed(data: np.ndarray, want: int) -> np.ndarray:
        """``data`` read over NIXL, checked against the checksum the host took of it: a
        mismatch is the crossing's fault, not the copy's, so it is a failed transfer."""
        if checksum(data) != want:
            raise TransferError("a selection changed between the host and this agent")
        return data

    # -- plumbing ------------------------------------------------------------------------------

    def access_stats(self) -> HostAccessStats:
        return HostAccessStats(self.nixl.name, self.nixl.bytes_read, self.nixl.bytes_written,
                               self.bounced)

    def close(self) -> None:
        super().close()
        self.nixl.close()


class DpuHost:
    """The host as an agent on its DPU reaches it (see the module's docstring): its tiers'
    arenas (``HostTiers``) and its bytes (``NixlHost``), both over one ``NixlAccess`` to the
    host's endpoint. ``HostParts`` for ``OffloadAgent``."""

    def __init__(self, nixl: NixlAccess, endpoint: Endpoint) -> None:
        self.nixl = nixl
        self.endpoint = endpoint

    def node_tiers(self, node: str, link: Any, owner: str, transport: Transport) -> NodeTiers:
        return HostTiers(node, link, owner, transport, self.nixl)

    def host_bytes(self, name: str, config: ServiceConfig, tiers: NodeTiers, peers: Peers,
                   scheduler: Scheduler, transport: Transport) -> HostBytes:
        return NixlHost(name, config, tiers, peers, scheduler, transport, self.nixl,
                        self.endpoint)


def dpu_agent_parts(node: str, config: ServiceConfig, endpoint: Endpoint) -> DpuHost:
    """The host parts of ``node``'s agent on its DPU, reaching the host through ``endpoint``:
    ``OffloadAgent(node, config, link, dpu_agent_parts(node, config, endpoint))``."""
    nixl = NixlAccess(f"cmx-dpu-{node[:12]}-{uuid.uuid4().hex[:6]}", endpoint,
                      timeout_s=config.load_timeout_s)
    return DpuHost(nixl, endpoint)


def dpu_actor_parts(node: str, config: ServiceConfig) -> DpuHost:
    """``dpu_agent_parts`` as the agent's actor on the DPU makes them, in its own process:
    that process first refuses to map a host arena or open a host file at all, then reaches
    the host through its endpoint actor (started once, found after)."""
    forbid_host_access()  # before anything could map or open what is the host's
    endpoint = RayEndpoint(start_host_endpoint(node, config), config.call_timeout_s)
    return dpu_agent_parts(node, config, endpoint)
