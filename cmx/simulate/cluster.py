"""The simulated cluster's state: nodes, replicas, tiers, links and the directory.

Where a block is lives in one place, ``Cluster.directory`` (key -> location codes), changed
only by ``add_copy`` and ``drop_copy``, so a tier and the directory never disagree. The tiers'
decisions are the service's policy objects: placement (which tiers a stored block is written
to, where an evicted one goes), admission (is a block worth an NVMe or pool write), eviction
(inside each ``TierCache``) and rendezvous hashing (which pool node owns a block).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any

from cmx.policies import AdmissionPolicy, PlacementPolicy, make_admission, make_placement
from cmx.policies.rendezvous import owners
from cmx.simulate.agent import Agent
from cmx.simulate.cache import TierCache
from cmx.simulate.cores import Cores
from cmx.simulate.hardware import NetworkSpec, NodeSpec, TierSpec
from cmx.simulate.links import Resource
from cmx.simulate.strategy import Strategy
from cmx.tiers import Tier

__all__ = ["DRAM", "HBM", "NVME", "POOL", "TIER_OF", "Cluster", "ClusterSpec", "Node", "Replica"]

HBM, DRAM, NVME, POOL = 0, 1, 2, 3  # tier codes; a location is node.index * 4 + tier
TIER_OF = (Tier.HBM, Tier.DRAM, Tier.NVME, Tier.POOL)


@dataclass(frozen=True)
class ClusterSpec:
    nodes: int = 4
    node: NodeSpec = field(default_factory=NodeSpec)
    network: NetworkSpec = field(default_factory=NetworkSpec)
    pool_nodes: int = 0  # storage nodes that form the pooled NVMe tier (G4)
    pool: TierSpec = field(default_factory=lambda: TierSpec(30 * 10**12, 7e9, 300e-6))

    def __post_init__(self) -> None:
        if self.nodes < 1 or self.pool_nodes < 0:
            raise ValueError(f"nodes must be >= 1 and pool_nodes >= 0: {self.nodes}, "
                             f"{self.pool_nodes}")

    @property
    def gpus(self) -> int:
        return self.nodes * self.node.gpus

    @property
    def replicas(self) -> int:
        return self.nodes * self.node.replicas


class Holders(dict[int, int]):
    """The nodes holding copies of one block in one tier: O(1) add, remove, membership and a
    uniform pick (a thousand nodes may hold a hot prefix). As a dict, node -> its place in
    ``nodes``: membership and size are the dict's own."""

    __slots__ = ("nodes",)

    def __init__(self) -> None:
        super().__init__()
        self.nodes: list[int] = []

    def add(self, node: int) -> None:
        if node not in self:
            self[node] = len(self.nodes)
            self.nodes.append(node)

    def discard(self, node: int) -> None:
        i = self.pop(node, None)
        if i is None:
            return
        last = self.nodes.pop()
        if last != node:
            self.nodes[i] = last
            self[last] = i

    def pick(self, u: float) -> int:
        """The holder at ``u`` in [0, 1): a caller's random draw spreads readers."""
        return self.nodes[int(u * len(self.nodes))]


class Replica:
    __slots__ = ("index", "node", "h2d", "d2h", "queue", "busy", "hbm_used")

    def __init__(self, index: int, node: Node, link_bw: float) -> None:
        self.index = index
        self.node = node
        self.h2d = Resource(f"r{index}.h2d", link_bw)
        self.d2h = Resource(f"r{index}.d2h", link_bw)
        self.queue: deque[Any] = deque()  # requests waiting for this replica
        self.busy: Any = None  # the request it computes, or None
        self.hbm_used = 0


class Node:
    def __init__(self, index: int, spec: ClusterSpec, strategy: Strategy, pool: bool,
                 hbm_cache_bytes: int = 0) -> None:
        n, net = spec.node, spec.network
        self.index = index
        self.name = f"{'pool' if pool else 'node'}-{index}"
        self.caches: list[TierCache | None] = [None, None, None, None]
        if pool:
            self.caches[POOL] = TierCache(f"{self.name}.pool", spec.pool.capacity_bytes,
                                          strategy.eviction)
        else:
            # HBM left over by the replicas' weights and working KV keeps blocks loaded or
            # computed here, as the service's HBM tier does, until they are evicted.
            self.caches[HBM] = TierCache(f"{self.name}.hbm", hbm_cache_bytes, strategy.eviction)
            self.caches[DRAM] = TierCache(f"{self.name}.dram", n.dram.capacity_bytes,
                                          strategy.eviction)
            self.caches[NVME] = TierCache(f"{self.name}.nvme", n.nvme.capacity_bytes,
                                          strategy.eviction)
        disk = spec.pool if pool else n.nvme
        self.hbm = Resource(f"{self.name}.hbm", n.gpu.hbm_bandwidth * n.gpus)
        self.dram_bus = Resource(f"{self.name}.dram", n.dram_bus_bandwidth)
        self.nvme_read = Resource(f"{self.name}.nvme.r", disk.bandwidth)
        self.nvme_write = Resource(f"{self.name}.nvme.w", min(n.nvme_write_bandwidth,
                                                              disk.bandwidth))
        self.nic_in = Resource(f"{self.name}.nic.in", net.bandwidth)
        self.nic_out = Resource(f"{self.name}.nic.out", net.bandwidth)
        self.cpu = Cores(f"{self.name}.cpu", n.host_cores)
        self.agent = Agent(strategy.lanes, strategy.queue_bound)
        # Sketches of 64 KiB: a thousand nodes each keep one.
        self.admission: AdmissionPolicy = (
            make_admission("frequency", min_count=strategy.admission_min_count, capacity=1 << 14)
            if strategy.admission == "frequency" else make_admission(strategy.admission))
        self.replicas = [] if pool else [
            Replica(index * n.replicas + i, self, n.replica_link_bandwidth)
            for i in range(n.replicas)]
        for r in self.replicas:  # each replica's engine: a process of its own on these cores
            self.cpu.limit(r.index, n.process_threads)

    def resources(self) -> list[Resource]:
        out = [self.hbm, self.dram_bus, self.nvme_read, self.nvme_write, self.nic_in, self.nic_out]
        for r in self.replicas:
            out += [r.h2d, r.d2h]
        return out


class Cluster:
    def __init__(self, spec: ClusterSpec, strategy: Strategy, hbm_cache_bytes: int = 0) -> None:
        self.spec = spec
        self.strategy = strategy
        self.nodes = [Node(i, spec, strategy, pool=False, hbm_cache_bytes=hbm_cache_bytes)
                      for i in range(spec.nodes)]
        self.pool_nodes = [Node(spec.nodes + j, spec, strategy, pool=True)
                           for j in range(spec.pool_nodes if strategy.pool else 0)]
        self.all_nodes = self.nodes + self.pool_nodes
        self.replicas = [r for node in self.nodes for r in node.replicas]
        self.placement: PlacementPolicy = make_placement(strategy.placement)
        # key -> per tier, the nodes that hold a copy
        self.directory: dict[bytes, list[Holders | None]] = {}
        self.parent: dict[bytes, bytes | None] = {}  # every key ever stored -> its parent
        self._pool_names = [n.name for n in self.pool_nodes]
        self._owner: dict[bytes, Node] = {}

    def cache(self, code: int) -> TierCache:
        cache = self.all_nodes[code // 4].caches[code % 4]
        assert cache is not None, f"location {code} names a tier its node does not have"
        return cache

    def add_copy(self, key: bytes, node: Node, tier: int, size: int) -> list[bytes] | None:
        """Commit a copy; evicted keys leave the directory here. None: it did not fit."""
        cache = node.caches[tier]
        assert cache is not None
        evicted = cache.insert(key, self.parent.get(key), size)
        if evicted is None:
            return None
        for victim in evicted:
            self._forget(victim, node.index, tier)
        tiers = self.directory.get(key)
        if tiers is None:
            tiers = self.directory[key] = [None, None, None, None]
        holders = tiers[tier]
        if holders is None:
            holders = tiers[tier] = Holders()
        holders.add(node.index)
        return evicted

    def drop_copy(self, key: bytes, code: int) -> None:
        self.cache(code).remove(key)
        self._forget(key, code // 4, code % 4)

    def _forget(self, key: bytes, node: int, tier: int) -> None:
        tiers = self.directory.get(key)
        if tiers is None or tiers[tier] is None:
            return
        holders = tiers[tier]
        assert holders is not None
        holders.discard(node)
        if not holders:
            tiers[tier] = None
            if not any(tiers):
                del self.directory[key]

    def pool_owner(self, key: bytes) -> Node | None:
        """The pool node that owns ``key`` (rendezvous hashing, one replica), if any."""
        if not self.pool_nodes:
            return None
        node = self._owner.get(key)
        if node is None:
            name = owners(key, self._pool_names, 1)[0]
            node = self.pool_nodes[self._pool_names.index(name)]
            self._owner[key] = node
        return node

    def has(self, key: bytes, node: Node, tier: int) -> bool:
        tiers = self.directory.get(key)
        if tiers is None:
            return False
        holders = tiers[tier]
        return holders is not None and node.index in holders

    def check_integrity(self) -> None:
        listed: dict[int, int] = {}
        for key, tiers in self.directory.items():
            where = [n * 4 + t for t, h in enumerate(tiers) if h for n in h.nodes]
            if not where:
                raise AssertionError(f"{key.hex()}: listed with no copy")
            for code in where:
                if key not in self.cache(code):
                    raise AssertionError(f"{key.hex()}: listed at {code}, not resident there")
                listed[code] = listed.get(code, 0) + 1
        for node in self.all_nodes:
            for tier, cache in enumerate(node.caches):
                if cache is None:
                    continue
                cache.check_integrity()
                if len(cache.sizes) != listed.get(node.index * 4 + tier, 0):
                    raise AssertionError(f"{cache.name}: holds {len(cache.sizes)} blocks, the "
                                         f"directory lists {listed.get(node.index * 4 + tier, 0)}")
            node.agent.check_integrity()
