"""The offload agent: one per node; it moves block bytes between tiers and between nodes.

It is not the only mover: the client copies its own stores into the DRAM slots granted to it
and its local hits out of the tiers' slots (``cmx.client.stores``, ``cmx.client.copy_out``),
and an agent on a DPU has its host's endpoint do the NVMe I/O (``actors/dpu/host.py``).

It maps the node's HBM and DRAM arenas (shared memory, as a DPU reaches host memory by DMA),
owns the node's transport to other agents (NIXL over UCX, registered once, prepared
descriptor lists) and the NVMe data path (O_DIRECT, many I/Os in flight), and runs every move
through its scheduler: loads before prefetches before demotions.

Public calls, each bounded:

- ``grant_store(keys, parents, owner)`` / ``commit_store(keys, parents, done, ..., owner)``:
  a writer on this node (the client) copies blocks straight into the DRAM slots granted to
  it, once, between the two calls; the agent demotes what the grants evict and places what
  commits, holding it pinned for ``owner`` until placed (``actors/agent/stores.py``).
- ``store(keys, parents, payload)``: blocks into this node's DRAM (evicted DRAM blocks demote
  to NVMe first, if NVMe admission lets them in); with write-through placement, admitted
  blocks go to NVMe as well. Returns when committed and visible to lookups.
- ``load(keys, copies, priority, owner, namespace, of_blocks)``: the longest prefix of ``keys``
  into this node's HBM arena (tagged with the blocks' namespace id, so a namespace drop finds
  the copy after the directory restarts), each from its fastest copy, checksums verified for
  NVMe and network reads; the returned slots are pinned (leases of ``owner``) for the caller,
  who checks each block's checksum, reads them and calls ``release(leases, corrupt)``; a
  caller that stops waiting calls ``give_up(owner)``. Every copy goes into the arena of its
  grant's epoch. ``of_blocks``: the whole load's blocks, where ``keys`` are a window of it (a
  scan's windows do not demote to DRAM what NVMe holds: ``actors/agent/demote.py``).
- ``stage(keys, owner)`` / ``unstage(staged)``: for a peer agent: pin blocks in a memory arena
  here (promoting from NVMe if needed) so the peer can read them with one transfer.
- ``load_slices``, ``expose_selection``, ``read_selection``: partial (layer or head) loads
  (``actors/agent/slices.py``).

The agent is its parts, each given what it uses (``actors/agent/shared.py`` names the shared ones):
``Loads``, ``RemoteFills``, ``LocalReads``, ``Stores``, ``Demotion``, ``NvmeWrites``,
``PoolWrites``, ``PeerServing``, ``SliceServing``, over one ``HostBytes`` that touches the
host's memory and files. Which ``NodeTiers`` and ``HostBytes`` those are is the agent's
``HostParts``, given to it: ``LocalHost`` maps the host's shared memory and opens its files;
an agent on a DPU is the same agent given ``dpu_agent_parts`` (``actors/dpu/agent.py``), every
host-facing move over NIXL.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from dataclasses import replace
from typing import Any, Protocol

import numpy as np

from cmx.actors.agent.demote import Demotion
from cmx.actors.agent.fetch import RemoteFills
from cmx.actors.agent.host import HostBytes
from cmx.actors.agent.loads import Loads, LocalReads
from cmx.actors.agent.nvme import Extent, NvmeWrites, make_nvme_plane
from cmx.actors.agent.peers import PeerServing
from cmx.actors.agent.pool import PoolWrites
from cmx.actors.agent.scheduler import Priority, Scheduler
from cmx.actors.agent.shared import Counters, NodeTiers, Peers
from cmx.actors.agent.slices import SliceServing
from cmx.actors.agent.stores import Stores
from cmx.actors.directory.shard import Copy
from cmx.actors.slices.expose import ExposedSlice, Exposure
from cmx.actors.tiers.arena import Grant
from cmx.actors.transport.base import PeerInfo, Transport
from cmx.actors.transport.factory import make_transport
from cmx.config import ServiceConfig
from cmx.doors import ReadSlots
from cmx.keys import BlockHash
from cmx.policies.admission import make_admission
from cmx.policies.placement import make_placement
from cmx.protocol import Loaded, LoadResult, Staged, StoreCommit
from cmx.selection import Runs, SlicedBlock
from cmx.stats import AgentStats
from cmx.tiers import Holds, Tier, node_tiers

__all__ = ["HostParts", "LoadResult", "Loaded", "LocalHost", "OffloadAgent"]


class HostParts(Protocol):
    """How an agent reaches its host: the two parts the others touch the host through, made
    in this order when the agent starts (the tiers first: the host's bytes use them)."""

    def node_tiers(self, node: str, link: Any, owner: str, transport: Transport) -> NodeTiers:
        """The node's tier actors, and their arenas as this agent reaches them."""
        ...

    def host_bytes(self, name: str, config: ServiceConfig, tiers: NodeTiers, peers: Peers,
                   scheduler: Scheduler, transport: Transport) -> HostBytes:
        """Every read and write of the host's block bytes (arenas and NVMe files)."""
        ...


class LocalHost:
    """An agent on its host: it maps the arenas (shared memory) and opens the NVMe files."""

    def node_tiers(self, node: str, link: Any, owner: str, transport: Transport) -> NodeTiers:
        return NodeTiers(node, link, owner, transport)

    def host_bytes(self, name: str, config: ServiceConfig, tiers: NodeTiers, peers: Peers,
                   scheduler: Scheduler, transport: Transport) -> HostBytes:
        return HostBytes(name, config, tiers, peers, scheduler, transport, make_nvme_plane())


class OffloadAgent:
    """The node's agent: its parts, built here over the ``HostParts`` it is given (its own
    host's, unless it runs on a DPU), and the calls it answers (each a part's)."""

    def __init__(self, node: str, config: ServiceConfig, link: Any,
                 parts: HostParts | None = None) -> None:
        parts = LocalHost() if parts is None else parts
        self.node = node
        self.config = config
        self.link = link
        self.name = f"cmx-agent-{node[:12]}-{uuid.uuid4().hex[:6]}"
        self.owner = f"agent:{self.name}"
        self.scheduler = Scheduler(
            config.agent_workers, config.agent_queue_bound, config.staging_bytes
        )
        self.peers = Peers(link)
        self.transport = make_transport(self.name, config.transport, self._fetch_from_peer)
        self.counters = Counters()
        self.tiers = parts.node_tiers(node, link, self.owner, self.transport)
        for tier in node_tiers(Holds.MEMORY):  # every arena a move may read or write
            self.tiers.attach_when_up(tier)
        self.host = parts.host_bytes(self.name, config, self.tiers, self.peers,
                                     self.scheduler, self.transport)
        self._build()

    def _build(self) -> None:
        config, tiers, host, counters = self.config, self.tiers, self.host, self.counters
        nvme_admission = make_admission("frequency", min_count=config.nvme_admission_min_count)
        self.nvme_writes = NvmeWrites(tiers, host, counters)
        self.demotion = Demotion(tiers, host, self.nvme_writes, counters,
                                 make_placement(config.placement), nvme_admission)
        self.pool = PoolWrites(
            self.node, config, tiers, self.link, self.scheduler, self.transport.name, counters,
            make_admission("frequency", min_count=config.pool_admission_min_count),
            nvme_admission)
        self.stores = Stores(config, tiers, host, self.demotion, self.nvme_writes, self.pool,
                             counters)
        reads = LocalReads(tiers, host, counters)
        fills = RemoteFills(self.node, config, tiers, host, self.link, self.transport.name,
                            counters)
        self.loads = Loads(self.node, config, tiers, self.link, reads, fills, self.demotion,
                           self.pool, counters)
        self.serving = PeerServing(tiers, reads, self.demotion, counters)
        self.slices = SliceServing(self.node, config, tiers, host, self.peers, self.link,
                                   self.transport, self.scheduler, counters)

    # -- loads ---------------------------------------------------------------------------------

    def load(self, keys: Sequence[BlockHash], copies: Sequence[Sequence[Copy]],
             priority: Priority = Priority.LOAD, owner: str = "", namespace: str = "",
             of_blocks: int = 0) -> LoadResult:
        return self.loads.load(keys, copies, priority, owner, namespace, of_blocks)

    def release(self, leases: Sequence[int], corrupt: Sequence[Loaded] = ()) -> None:
        self.loads.release(leases, corrupt)

    def give_up(self, owner: str) -> int:
        return self.loads.give_up(owner)

    def quarantine(self, blocks: Sequence[Loaded]) -> None:
        self.loads.quarantine(blocks)

    def prefetch(self, keys: Sequence[BlockHash], copies: Sequence[Sequence[Copy]],
                 namespace: str = "") -> int:
        return self.loads.prefetch(keys, copies, namespace)

    # -- stores --------------------------------------------------------------------------------

    def store(self, keys: Sequence[BlockHash], parents: Sequence[BlockHash | None],
              payload: np.ndarray, namespace: str = "", replicas: int | None = None) -> int:
        return self.stores.store(keys, parents, payload, namespace, replicas)

    def grant_store(self, keys: Sequence[BlockHash], parents: Sequence[BlockHash | None],
                    owner: str) -> list[Grant | None]:
        return self.stores.grant_store(keys, parents, owner)

    def commit_store(self, keys: Sequence[BlockHash], parents: Sequence[BlockHash | None],
                     done: Sequence[tuple[Grant, int, int]], namespace: str = "",
                     replicas: int | None = None, owner: str = "") -> StoreCommit:
        return self.stores.commit_store(keys, parents, done, namespace, replicas, owner)

    def move_extents(self, pairs: Sequence[tuple[Extent, Extent]]) -> list[bool | None]:
        return self.nvme_writes.move_extents(pairs)

    # -- other nodes ---------------------------------------------------------------------------

    def stage(self, keys: Sequence[BlockHash], owner: str) -> list[Staged | None]:
        return self.serving.stage(keys, owner)

    def unstage(self, staged: Sequence[Staged]) -> None:
        self.serving.unstage(staged)

    def quarantine_staged(self, staged: Sequence[Staged]) -> None:
        self.serving.quarantine_staged(staged)

    def quarantine_copies(self, keys: Sequence[BlockHash], tier: Tier) -> None:
        self.serving.quarantine_copies(keys, tier)

    def peer_info(self) -> PeerInfo:
        return self.host.peer_info()

    def read_slots(self, slots: Sequence[tuple[str, int]]) -> list[np.ndarray]:
        return self.host.read_slots(slots)

    # -- partial loads -------------------------------------------------------------------------

    def load_slices(self, keys: Sequence[BlockHash], copies: Sequence[Sequence[Copy]],
                    runs: Runs) -> list[SlicedBlock]:
        return self.slices.load_slices(keys, copies, runs)

    def read_selection(self, keys: Sequence[BlockHash], runs: Runs) -> list[SlicedBlock | None]:
        return self.slices.read_selection(keys, runs)

    def expose_selection(self, keys: Sequence[BlockHash], runs: Runs, owner: str) -> Exposure:
        return self.slices.expose_selection(keys, runs, owner)

    def release_selection(self, exposed: Sequence[ExposedSlice]) -> None:
        self.slices.release_selection(exposed)

    # -- plumbing ------------------------------------------------------------------------------

    def stats(self) -> AgentStats:
        c = self.counters
        return AgentStats(
            agent=self.name, node=self.node, placed_on=self.node, transport=self.transport.name,
            moved_bytes=dict(c.moved), moved_via=dict(c.moved_via),
            dropped_blocks=dict(c.dropped), corrupt_blocks=dict(c.corrupt),
            store_commits={k: c.commits[k] for k in ("committed", "refused")},
            latency={op: h.snapshot() for op, h in c.latency.items()},
            queues=self.scheduler.stats(),
            transport_stats=replace(self.transport.stats,
                                    per_peer=dict(self.transport.stats.per_peer)),
            plane=self.host.nvme.stats(), host_access=self.host.access_stats(),
        )

    def _fetch_from_peer(self, peer_agent: str, slots: list[tuple[str, int]]) -> list[np.ndarray]:
        views = self.link.call(self.peers.actor_of(peer_agent), ReadSlots(slots=slots))
        return views

    def close(self) -> None:
        self.scheduler.close()
        self.transport.close()
        self.host.close()
