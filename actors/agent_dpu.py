"""The offload agent on a DPU that reaches its host only over the network (``dpu_access="nixl"``).

A BlueField is a separate computer: it cannot map the host's shared memory or open the
host's NVMe files. This agent is the node's agent with its host-facing moves replaced: the
host's arenas are reached through ``NixlAccess`` (UCX, via the host's ``HostEndpoint``), NVMe
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
from dataclasses import replace
from typing import Any

import numpy as np
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from cmx.actors.agent import OffloadAgent
from cmx.actors.agent_fetch import LandedChecks
from cmx.actors.arena_tier import Grant, Pinned
from cmx.actors.dpu_access import (
    Endpoint,
    HostAccessForbidden,
    NoHostFiles,
    forbid_host_access,
)
from cmx.actors.dpu_host import RayEndpoint, host_endpoint_actor
from cmx.actors.dpu_nixl import NixlAccess
from cmx.actors.dpu_staging import HostOutbox, host_staging_slots
from cmx.actors.links import RAY_NAMESPACE, RayLink, actor_name
from cmx.actors.scheduler import Priority
from cmx.actors.service import AgentActor
from cmx.actors.slice_expose import SliceOutbox
from cmx.actors.transport import Move, PeerInfo, Region, TransferError
from cmx.buffers import aligned_empty
from cmx.checksum import checksum
from cmx.config import ServiceConfig
from cmx.keys import BlockHash
from cmx.protocol import Staged
from cmx.selection import Runs, runs_bytes
from cmx.stats import AgentStats, HostAccessStats
from cmx.storage.nvme.chunks import block_sums
from cmx.storage.nvme.dataplane import Extent, ExtentPlane
from cmx.tiers import Tier

__all__ = ["BounceSlots", "DpuAgent", "DpuAgentActor", "start_host_endpoint"]

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


class DpuAgent(OffloadAgent):
    """The node's agent with every host-facing move over NIXL (see the module's docstring);
    a plain class: ``DpuAgentActor`` runs it on the DPU, in a process that cannot map a host
    arena or open a host file."""

    nvme: ExtentPlane  # opens no host file: the host endpoint moves every extent

    def __init__(self, node: str, config: ServiceConfig, link: object, endpoint: Endpoint
                 ) -> None:
        self.endpoint = endpoint
        self.host = NixlAccess(f"cmx-dpu-{node[:12]}-{uuid.uuid4().hex[:6]}", endpoint,
                               timeout_s=config.load_timeout_s)
        OffloadAgent.__init__(self, node, config, link)  # not the actor's: see DpuAgentActor
        own, self.nvme = self.nvme, NoHostFiles()
        own.close()
        slot_bytes = self._arenas[Tier.HBM][0].slot_bytes
        self.bounce = BounceSlots(f"{self.name}-bounce", slot_bytes, max(1, min(
            MAX_BOUNCE_SLOTS, config.staging_bytes // slot_bytes)))
        self.transport.register(self.bounce.region, self.bounce.buffer)
        self._bounce_lock = threading.Lock()  # one pull through the bounce slots at a time
        self._outbox_lock = threading.Lock()  # the host staging's books are made once
        self.bounced = 0  # bytes from peers that passed through the bounce slots

    # -- the host's arenas: names to address, never mapped -------------------------------------

    def _attach(self, tier: Tier) -> None:
        """The tier's current arena, reached through the endpoint; its earlier incarnations
        are forgotten here as the endpoint lets them go (no copy may land in them)."""
        info = self.link.call(actor_name(tier.value, self.node), "info")
        if info.epoch in self._epochs:
            return
        self.host.attach(info)
        arena: Any = HostArena(info.arena)
        for old in [e for e, (i, _) in self._epochs.items() if i.tier is tier]:
            del self._epochs[old]
        self._arenas[tier] = (info, arena)
        self._epochs[info.epoch] = (info, arena)

    def _name(self, epoch: str) -> str:
        return self._arena(epoch).name

    # -- stores and local loads ----------------------------------------------------------------

    def _copy_in(
        self, grants: Sequence[Grant | None], payload: np.ndarray, size: int
    ) -> list[tuple[Grant, int, int]]:
        futures = []
        for i, grant in enumerate(grants):
            if grant is None:
                continue
            src = payload[i * size : (i + 1) * size]

            def copy(grant: Grant = grant, src: np.ndarray = src) -> tuple[Grant, int, int]:
                self.host.write(self._name(grant.epoch), grant.slot, src)
                return grant, src.nbytes, checksum(src)

            futures.append(self.scheduler.submit(Priority.DEMOTE, copy))
        return [f.result() for f in futures]

    def _read_pinned(self, tier: Tier, pins: Sequence[Pinned | Extent], grants: Sequence[Grant],
                     priority: Priority) -> list[bool]:
        """One NIXL move per block (the host's memory and files are out of reach here); an
        NVMe block that fails its checksum is quarantined at the tier."""
        jobs = [self.scheduler.submit(priority, functools.partial(self._read_local, tier, p, g))
                for p, g in zip(pins, grants)]
        ok = [f.result() for f in jobs]
        if tier is Tier.NVME and (bad := [p.key for p, good in zip(pins, ok) if not good]):
            self.corrupt["nvme"] += len(bad)
            self._call(Tier.NVME, "quarantine", bad)
        return ok

    def _read_local(self, tier: Tier, pin: Pinned | Extent, grant: Grant) -> bool:
        dst = self._name(grant.epoch)
        if isinstance(pin, Extent):
            self.host.read_extent(pin, dst, grant.slot)
            return checksum(self.host.read(dst, grant.slot, pin.size)) == pin.checksum
        self.host.copy((self._name(pin.epoch), pin.slot), (dst, grant.slot), pin.size)
        return True

    def _copy_extents(self, pairs: Sequence[tuple[Extent, Extent]]) -> list[bool | None]:
        """Compaction's copies, made on the host by its endpoint (NIXL POSIX)."""
        return self.endpoint.move_extents(list(pairs))

    # -- DRAM to NVMe --------------------------------------------------------------------------

    def _slot_source(self, epoch: str, slot: int) -> tuple[str, int]:
        """A host slot by name (arena, slot): its bytes are read over NIXL."""
        return self._name(epoch), slot

    def _write_extents(self, extents: Sequence[Extent], sources: Sequence[Any]
                       ) -> list[tuple[int, bytes]]:
        """Each block's checksums from its bytes read over NIXL; the host endpoint writes it
        to its extent."""
        jobs = [self.scheduler.submit(Priority.DEMOTE,
                                      functools.partial(self._to_extent, ext, src, ext.size))
                for ext, src in zip(extents, sources)]
        return [f.result() for f in jobs]

    def _to_extent(self, ext: Extent, src: tuple[str, int], size: int) -> tuple[int, bytes]:
        """The block's checksums from its bytes read over NIXL; then the host writes it."""
        sums = block_sums(self.host.read(src[0], src[1], size))
        self.host.write_extent(ext, *src)
        return sums

    # -- other nodes: the peer path, every byte over NIXL ---------------------------------------

    def _copy_slot(self, src: Grant, dst: Grant, nbytes: int) -> None:
        """An HBM to DRAM demotion: host slot to host slot over NIXL."""
        self.host.copy((self._name(src.epoch), src.slot), (self._name(dst.epoch), dst.slot),
                       nbytes)

    def peer_info(self) -> PeerInfo:
        """The host endpoint's NIXL agent and regions: a peer reads the host's memory."""
        host = self.endpoint.peer()
        regions = tuple(Region(r.arena, r.base, r.slot_bytes, r.num_slots) for r in host.regions)
        return PeerInfo(host.agent, "nixl-ucx", regions, host.metadata)

    def read_slots(self, slots: Sequence[tuple[str, int]]) -> list[np.ndarray]:
        """The fallback transport's server side: whole host slots, read over NIXL."""
        size = {info.arena: info.slot_bytes for info, _ in self._epochs.values()}
        if missing := {region for region, _ in slots} - size.keys():
            raise TransferError(f"no host region {sorted(missing)} here")
        return [self.host.read(region, slot, size[region]) for region, slot in slots]

    def _land_staged(self, peer_agent: str, pairs: list[tuple[int, Staged]],
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
        peer = self._peer_holding(peer_agent, pairs)
        moves = [Move(s.region, s.slot, self.bounce.name, j) for j, (_, s) in enumerate(pairs)]
        checks = LandedChecks({m: (self.bounce, s.size, s.checksum)
                               for m, (_, s) in zip(moves, pairs)})
        try:
            self._transfer(peer, moves, checks.landed, priority)
        except TransferError:
            self._peers.pop(peer_agent, None)  # the peer may have restarted
            raise
        landed = [(i, s, dst, self.bounce.slot_view(m.dst_slot)[:s.size])
                  for m, (i, s), dst in zip(moves, pairs, dsts) if m in checks.intact]
        writes = [self.scheduler.submit(priority, functools.partial(self.host.write, *dst, src))
                  for _, _, dst, src in landed]  # as many at once as there are bounce buffers
        for w in writes:
            w.result()
        self.bounced += sum(s.size for _, s, _, _ in landed)
        return {i for i, _, _, _ in landed}

    # -- partial loads: checked on the host, only the selected bytes cross ---------------------

    def _outbox(self) -> SliceOutbox:
        with self._outbox_lock:
            box: SliceOutbox | None = getattr(self, "_slice_outbox", None)
            if box is None:
                staging = self.host.staging()
                box = self._slice_outbox = HostOutbox(
                    Region(staging.arena, staging.base, staging.slot_bytes, staging.num_slots),
                    self.config.lease_s, self.owner)
            return box

    def _pinned_selection_checksum(self, pin: Pinned, runs: Runs) -> int | None:
        return self.host.select(self._name(pin.epoch), pin.slot, pin.size, pin.checksum, runs)

    def _pinned_selection(self, pin: Pinned, runs: Runs) -> np.ndarray | None:
        want = self._pinned_selection_checksum(pin, runs)
        if want is None:
            return None
        return self._crossed(self.host.read_runs(self._name(pin.epoch), pin.slot, runs), want)

    def _extent_into_outbox(self, ext: Extent, runs: Runs, box: SliceOutbox,
                            slot: int) -> int | None:
        try:
            return self.host.select_extent(ext, runs, slot)
        except TransferError:
            if isinstance(box, HostOutbox):
                box.doubt(slot)  # the gather may still land: the slot waits for expiry
            raise

    def _extent_selection(self, ext: Extent, runs: Runs) -> np.ndarray | None:
        """Gathered on the host into a staging slot held for the read, then read over NIXL."""
        box = self._outbox()
        took = box.take(self.owner, BlockHash(ext.key))
        if took is None:
            raise TransferError("every host staging slot is in use")
        slot, lease = took
        try:
            want = self._extent_into_outbox(ext, runs, box, slot)
            if want is None:
                return None
            data = self.host.read_runs(box.region.name, slot, ((0, runs_bytes(runs)),))
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

    def stats(self) -> AgentStats:
        host = HostAccessStats(self.host.name, self.host.bytes_read, self.host.bytes_written,
                               self.bounced)
        return replace(super().stats(), host_access=host)

    def close(self) -> None:
        super().close()
        self.host.close()


class DpuAgentActor(DpuAgent, AgentActor):
    def __init__(self, node: str, config: ServiceConfig) -> None:
        forbid_host_access()  # before anything could map or open what is the host's
        endpoint = RayEndpoint(start_host_endpoint(node, config), config.call_timeout_s)
        DpuAgent.__init__(self, node, config, RayLink(config.call_timeout_s), endpoint)
        self._note_placement()
