"""A service in memory for the admin API's unit tests: two nodes, three tiers each, no Ray."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from cmx.actors.directory.shard import Copy
from cmx.api.backend import Backend, NotSupportedError
from cmx.config import AdminConfig
from cmx.doors import PinFor, Request, Unpin
from cmx.errors import UnavailableError
from cmx.keys import BlockHash
from cmx.metrics import Histogram
from cmx.stats import (
    NODE_TIERS,
    AgentStats,
    DirectoryStats,
    LeaseStats,
    NodeStats,
    PoolStats,
    QueueStats,
    ServiceStats,
    TierStats,
    TransportStats,
    Unreachable,
)
from cmx.storage.base import NvmeStats, StoreStats
from cmx.storage.nvme.dataplane import PlaneStats
from cmx.tiers import Tier

NODE_A = "a1" * 28
NODE_B = "b2" * 28
TOKEN = "test-token-0123456789"
BLOCK = 32 << 10
CAPACITY = {Tier.HBM: 8 * BLOCK, Tier.DRAM: 16 * BLOCK, Tier.NVME: 1024 * BLOCK,
            Tier.POOL: 4096 * BLOCK}


class FakeTier:
    def __init__(self, tier: Tier, node: str) -> None:
        self.tier, self.node = tier, node
        self.blocks: dict[bytes, int] = {}  # key -> pins
        self.hits = self.misses = self.bytes_in = self.bytes_out = self.evictions = 0
        self.epoch = "e1"
        self.down = False

    def stats(self) -> TierStats | Unreachable:
        if self.down:
            return Unreachable(f"cmx:{self.tier.value}:{self.node} did not answer")
        kind, extra = ((NvmeStats, {"segments": 1, "io_engine": "pwritev"})
                       if self.tier is Tier.NVME else (StoreStats, {}))
        store = kind(CAPACITY[self.tier], len(self.blocks) * BLOCK, len(self.blocks),
                     hits=self.hits, misses=self.misses, evictions=self.evictions,
                     bytes_written=self.bytes_in, bytes_read=self.bytes_out, **extra)
        pinned = sum(1 for p in self.blocks.values() if p)
        return TierStats(self.tier, self.node, self.epoch, store, pinned, 0,
                         LeaseStats(pinned, 0, 0, 0), emulated=self.tier is Tier.HBM)


def agent_stats(node: str, latency: Histogram | None = None) -> AgentStats:
    """An agent's stats as the service answers them: some bytes moved, some moves queued."""
    return AgentStats(
        agent=f"cmx-agent-{node[:12]}", node=node, placed_on=node, transport="nixl-ucx",
        moved_bytes={"client->dram": 3 * BLOCK, "dram->nvme": BLOCK},
        moved_via={"local": 3 * BLOCK, "nvme": BLOCK}, dropped_blocks={}, corrupt_blocks={},
        latency={"store": (latency or Histogram()).snapshot(), "load": Histogram().snapshot()},
        queues=QueueStats({"load": 1, "prefetch": 0, "demote": 2},
                          {"load": 5, "prefetch": 0, "demote": 1}, 0, 1 << 20),
        transport_stats=TransportStats(),
        plane=PlaneStats("pwritev", 16, True, 0, 0, 0, 0, 0),
    )


NO_POOL = PoolStats({}, 1, 0, 0)


class FakeBackend(Backend):
    def __init__(self) -> None:
        self.node_ids = [NODE_A, NODE_B]
        self.tiers = {(n, t): FakeTier(t, n) for n in self.node_ids
                      for t in (Tier.HBM, Tier.DRAM, Tier.NVME)}
        self.latency = Histogram()
        self.pool = NO_POOL
        self.dropped: list[str] = []
        self.can_drop = False
        self.calls = 0

    # -- scenario helpers ----------------------------------------------------------------------

    def put(self, key: bytes, node: str, tier: Tier) -> None:
        t = self.tiers[(node, tier)]
        t.blocks.setdefault(key, 0)
        t.bytes_in += BLOCK

    # -- Backend -------------------------------------------------------------------------------

    def stats(self) -> ServiceStats:
        self.calls += 1
        nodes = {n: NodeStats(n, {t: self.tiers[(n, t)].stats() for t in NODE_TIERS},
                              agent_stats(n, self.latency))
                 for n in self.node_ids}
        directory = (DirectoryStats(0, blocks=2, copies=3, sources=6, source_slots=6,
                                    resyncs=0, lookups=4),
                     Unreachable("cmx:dir:1 did not answer"))
        return ServiceStats(nodes, directory, self.pool)

    def nodes(self) -> list[str]:
        return list(self.node_ids)

    def copies(self, keys: Sequence[BlockHash]) -> list[list[Copy]]:
        out = []
        for key in keys:
            out.append([Copy(t, n, BLOCK, 7) for (n, t), ft in self.tiers.items()
                        if key in ft.blocks])
        return out

    def tier_call(self, node: str, tier: Tier, request: Request[Any]) -> Any:
        t = self.tiers[(node, tier)]
        if t.down:
            raise UnavailableError(f"cmx:{tier.value}:{node} did not answer")
        method = request.method
        keys = list(request.leases if isinstance(request, Unpin) else request.keys)
        if method == "pin_for":
            out: list[Any] = []
            for k in keys:
                if k in t.blocks:
                    t.blocks[k] += 1
                    out.append(("pinned", k))
                else:
                    out.append(None)
            return out
        if method == "unpin":
            for k in keys:
                if t.blocks.get(k):
                    t.blocks[k] -= 1
            return None
        if method == "contains":
            return [k in t.blocks for k in keys]
        if method == "evict":
            gone = [k for k in keys if k in t.blocks and not t.blocks[k]]
            for k in gone:
                del t.blocks[k]
            t.evictions += len(gone)
            return len(gone)
        raise AssertionError(method)

    def pin(self, node: str, tier: Tier, key: BlockHash, ttl_s: float) -> bool:
        return self.tier_call(node, tier, PinFor(keys=[key], ttl_s=ttl_s, owner="admin"))[0] \
            is not None

    def drop_namespace(self, namespace_id: str) -> int:
        if not self.can_drop:
            raise NotSupportedError("this version of the service cannot drop a namespace")
        self.dropped.append(namespace_id)
        return 3


def admin(**changes: Any) -> AdminConfig:
    return AdminConfig(**{"token": TOKEN, "sample_s": 0.05, "history_s": 60.0, **changes})
