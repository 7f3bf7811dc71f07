"""The service's figures, typed from the actor that counts them to the API and the CLI.

Each actor's ``stats()`` answers one of these frozen dataclasses: a tier ``TierStats``, an
agent ``AgentStats``, a directory shard ``DirectoryStats``. ``collect`` gathers them into one
``ServiceStats`` (per node a ``NodeStats``, the directory, the pool); a part that did not answer
in time is ``Unreachable(reason)`` in its place, never a dict with an error in it, and a stopped
service is no exception: its controller, which lists the nodes and pool members, is then
``Unreachable`` and none are listed. Counters run since the part started (its ``epoch`` changes
on a restart); gauges are the state at the call.

The pieces other modules own are composed, not copied: a store's ``StoreStats``, the NVMe
data plane's ``PlaneStats``. The admin API converts these to its pydantic models at its edge
(``cmx.api.views``); nothing in between passes figures by string key.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from cmx.doors import (
    AgentStatsOf,
    Nodes,
    PoolMembers,
    PoolReplicas,
    Request,
    ShardStatsOf,
    TierStatsOf,
)
from cmx.errors import UnavailableError
from cmx.protocol import actor_name
from cmx.storage.base import StoreStats
from cmx.storage.nvme.dataplane import PlaneStats
from cmx.tiers import Tier, node_tiers

__all__ = [
    "AgentStats", "DirectoryStats", "DiskStats", "HostAccessStats", "LatencyStats",
    "LeaseStats", "NODE_TIERS", "NodeStats", "PoolStats", "QueueStats", "ServiceStats",
    "TierStats", "TransportStats", "Unreachable", "collect", "transport_of",
]

# The built-in tiers every node runs, those the admin API's models name (``api.models.NodeTier``);
# ``collect`` gathers every registered one (``cmx.tiers.node_tiers``).
NODE_TIERS = (Tier.HBM, Tier.DRAM, Tier.NVME)


@dataclass(frozen=True)
class Unreachable:
    """A part that did not answer its stats call; ``reason`` says what the caller saw."""

    reason: str


# -- the parts of a tier -----------------------------------------------------------------------


@dataclass(frozen=True)
class LeaseStats:
    pinned: int  # pins held
    reserved: int  # reservations held
    expired: int  # leases taken back because they ran out, since the tier started
    released: int  # leases given back by ``release_owner``, and late pins of owners it released


@dataclass(frozen=True)
class DiskStats:
    """The store directory an NVMe tier runs on (``cmx.operate.store_dirs``)."""

    store_id: str  # the node's stable store identity (its directory is ``node-<store_id>``)
    orphan_dirs: int  # store directories no live tier claims, as last scanned
    orphan_bytes: int


@dataclass(frozen=True)
class TierStats:
    """One tier actor of one node (or a pool node, ``tier`` POOL)."""

    tier: Tier
    node: str
    epoch: str  # changes when the tier restarts: counters start again from zero
    store: StoreStats  # capacity, use, blocks, hits, misses, evictions, bytes in and out
    pinned: int  # blocks pinned by readers now
    reserved: int  # slots (or extents) reserved for writes not yet committed
    leases: LeaseStats
    # Slots whose reservation ended without its holder, held out of use for another lease
    # period so that a late writer's copy lands where nobody reads.
    fenced_slots: int = 0
    refused_commits: int = 0  # commits refused: lease ended, tier restarted, bytes changed
    emulated: bool = False  # an HBM tier on host memory (no GPU)
    disk: DiskStats | None = None  # NVMe tiers: their store directory
    degraded: str | None = None  # a fallback in force, ``cmx.operate.degraded.describe``

    @property
    def capacity_bytes(self) -> int:
        return self.store.capacity_bytes

    @property
    def used_bytes(self) -> int:
        return self.store.used_bytes

    @property
    def blocks(self) -> int:
        return self.store.blocks


# -- the parts of an agent ---------------------------------------------------------------------


@dataclass
class TransportStats:
    """What a transport moved between nodes. Mutable: the transport counts into it; the
    agent's ``AgentStats`` holds a copy taken at the call."""

    reads: int = 0
    bytes_read: int = 0
    seconds: float = 0.0  # spent waiting for reads to land
    failures: int = 0
    per_peer: dict[str, int] = field(default_factory=dict)  # peer agent -> bytes read from it
    range_reads: int = 0  # reads of byte ranges (partial loads), counted in reads too
    range_bytes: int = 0  # their bytes, counted in bytes_read too


@dataclass(frozen=True)
class QueueStats:
    """The agent's work queues, per priority class (``load``, ``prefetch``, ``demote``)."""

    queued: Mapping[str, int]  # waiting now
    done: Mapping[str, int]  # finished since the agent started
    staging_bytes_in_use: int
    staging_bytes: int  # the bound on staging memory


@dataclass(frozen=True)
class LatencyStats:
    """A latency histogram at one moment (``cmx.metrics.Histogram``)."""

    buckets: tuple[float, ...]  # upper bounds in seconds; +Inf implied
    counts: tuple[int, ...]  # per bucket, not cumulative; the last is +Inf
    sum: float
    count: int


@dataclass(frozen=True)
class HostAccessStats:
    """An agent on a DPU: the bytes it moved from and to its host, through NIXL only."""

    name: str
    bytes_read: int
    bytes_written: int
    bounced_from_peers: int = 0  # blocks pulled from peers through the DPU's bounce slots


@dataclass(frozen=True)
class AgentStats:
    agent: str  # unique name (node and incarnation)
    node: str  # the node whose memory and files it moves
    placed_on: str  # the Ray node it runs on: ``node``, or that node's DPU
    transport: str  # "nixl-ucx" or "ray"
    moved_bytes: Mapping[str, int]  # "src->dst" (a peer's tier as "dram@peer") -> bytes
    moved_via: Mapping[str, int]  # transport, "local" or "nvme" -> bytes
    dropped_blocks: Mapping[str, int]  # why evicted blocks were not demoted -> blocks
    # Where a copy failed its checksum -> blocks, each then quarantined at its source: "nvme"
    # (the agent's own NVMe read), "peer" (a peer's staged copy), "consumer" (the load's caller).
    corrupt_blocks: Mapping[str, int]
    latency: Mapping[str, LatencyStats]  # "store", "load", "stage", "prefetch"
    queues: QueueStats
    transport_stats: TransportStats
    plane: PlaneStats  # its NVMe reads and writes
    # A store's blocks "committed" or "refused" (lease ended, tier restarted, bytes changed).
    store_commits: Mapping[str, int] = field(default_factory=dict)
    host_access: HostAccessStats | None = None  # on a DPU
    degraded: str | None = None  # a fallback in force, ``cmx.operate.degraded.describe``

    @property
    def dpu(self) -> bool:
        return self.placed_on != self.node

    @property
    def loads(self) -> int:
        """Loads served (each a prefix of blocks)."""
        return self._count("load")

    @property
    def stores(self) -> int:
        """Store commits (a store larger than half of DRAM commits in windows)."""
        return self._count("store")

    @property
    def promoted_bytes(self) -> int:
        """Bytes moved into a faster tier (a load or a prefetch)."""
        return sum(n for pair, n in self.moved_bytes.items() if _direction(pair) < 0)

    @property
    def demoted_bytes(self) -> int:
        """Bytes moved into a slower tier (eviction to DRAM, NVMe or the pool)."""
        return sum(n for pair, n in self.moved_bytes.items() if _direction(pair) > 0)

    @property
    def verify_failures(self) -> int:
        return sum(self.corrupt_blocks.values())

    def _count(self, op: str) -> int:
        h = self.latency.get(op)
        return h.count if h is not None else 0


def _direction(pair: str) -> int:
    """-1 for a move into a faster tier, +1 into a slower one, 0 otherwise ("client->dram")."""
    src, _, dst = pair.partition("->")
    try:
        a, b = Tier(src.partition("@")[0]), Tier(dst.partition("@")[0])
    except ValueError:
        return 0
    return (b.rank > a.rank) - (b.rank < a.rank)


# -- the service -------------------------------------------------------------------------------


@dataclass(frozen=True)
class DirectoryStats:
    shard: int
    blocks: int  # keys with at least one committed copy
    copies: int
    sources: int  # tier incarnations publishing to this shard
    source_slots: int  # live sources plus slots free for reuse
    resyncs: int
    lookups: int


@dataclass(frozen=True)
class NodeStats:
    node: str
    tiers: Mapping[Tier, TierStats | Unreachable]  # each node tier: HBM, DRAM, NVMe, ...
    agent: AgentStats | Unreachable


@dataclass(frozen=True)
class PoolStats:
    members: Mapping[str, TierStats | Unreachable]  # pool node -> its stats
    replication: int  # copies each pooled block should have
    blocks: int  # pooled blocks the directory knows
    under_replicated: int  # of those, blocks with fewer copies than ``replication``

    @property
    def capacity_bytes(self) -> int:
        return sum(m.capacity_bytes for m in self.members.values() if isinstance(m, TierStats))

    @property
    def used_bytes(self) -> int:
        return sum(m.used_bytes for m in self.members.values() if isinstance(m, TierStats))


@dataclass(frozen=True)
class ServiceStats:
    nodes: Mapping[str, NodeStats]  # none when the controller did not answer
    directory: tuple[DirectoryStats | Unreachable, ...]  # by shard
    pool: PoolStats  # no members when the controller did not answer
    controller: Unreachable | None = None  # the controller's lists of nodes and pool members


def transport_of(stats: ServiceStats, node: str) -> str:
    """The transport ``node``'s agent moves bytes between nodes with; "unknown" if it did
    not answer."""
    entry = stats.nodes.get(node)
    agent = entry.agent if entry is not None else None
    return agent.transport if isinstance(agent, AgentStats) else "unknown"


# -- gathering ---------------------------------------------------------------------------------


def collect(link: Any, shards: int, replication: int) -> ServiceStats:
    """Every node's tiers and agent, the directory's shards and the pool, through ``link``
    (a ``cmx.links.RayLink``): all the stats calls in flight at once, each bounded. A part
    that does not answer, the controller included, is ``Unreachable``: never an error."""
    listed: list[tuple[str, Request[Any]]] = [("cmx:controller", Nodes()),
                                              ("cmx:controller", PoolMembers())]
    answered = link.call_many(listed, return_exceptions=True)
    controller = next((_answer(call, a) for call, a in zip(listed, answered)
                       if isinstance(a, Exception)), None)
    nodes, members = ([], []) if controller is not None else answered
    want = min(replication, len(members)) if members else 0
    on_node = node_tiers()
    calls: list[tuple[str, Request[Any]]] = [
        (actor_name(t.value, n), TierStatsOf()) for n in nodes for t in on_node]
    calls += [(actor_name("agent", n), AgentStatsOf()) for n in nodes]
    calls += [(actor_name("dir", i), ShardStatsOf()) for i in range(shards)]
    calls += [(actor_name("pool", m), TierStatsOf()) for m in members]
    calls += [(actor_name("dir", i), PoolReplicas(want=want)) for i in range(shards)]
    answers = iter([_answer(call, a) for call, a in
                    zip(calls, link.call_many(calls, return_exceptions=True))])
    tiers = {n: {t: next(answers) for t in on_node} for n in nodes}
    by_node = {n: NodeStats(n, tiers[n], next(answers)) for n in nodes}
    directory = tuple(next(answers) for _ in range(shards))
    pool_members = {m: next(answers) for m in members}
    counts = [c for c in answers if not isinstance(c, Unreachable)]
    pool = PoolStats(pool_members, replication, sum(c["blocks"] for c in counts),
                     sum(c["under_replicated"] for c in counts))
    return ServiceStats(by_node, directory, pool, controller)


def _answer(call: tuple[str, Request[Any]], answer: Any) -> Any:
    """A call's answer, or Unreachable with why it did not come (a part whose ``stats``
    failed is shown as such too: the rest of the cluster is worth seeing)."""
    if isinstance(answer, UnavailableError):
        return Unreachable(str(answer))
    if isinstance(answer, Exception):
        return Unreachable(f"{call[0]}.{call[1].method} failed: {answer!r}")
    return answer
