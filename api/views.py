"""The service's typed stats (``cmx.stats``) as the API's views. Pure functions of samples.

A part of the service that did not answer (``Unreachable``) appears with ``available: false``
and its reason, never as a failed request: the admin wants to see the rest of the cluster.

Every figure is per node, tier or directory shard, summed over tenants, and named one by one
here: no reader of these views learns one tenant's hits or what it stored.
"""

from __future__ import annotations

from cmx.api.models import (
    AgentInfo,
    DirectoryShardInfo,
    History,
    HistoryPoint,
    HistorySeries,
    LatencyHistogram,
    NodeInfo,
    NodesView,
    NodeView,
    Placement,
    PoolNode,
    PoolStatus,
    QueueDepths,
    TierBandwidth,
    TiersView,
)
from cmx.api.models import TierStats as TierView
from cmx.api.stats_samples import Sample, rates_between
from cmx.operate.degraded import parse
from cmx.stats import (
    NODE_TIERS,
    AgentStats,
    DirectoryStats,
    PoolStats,
    TierStats,
    Unreachable,
)
from cmx.storage.base import NvmeStats

__all__ = ["degradations", "history_view", "nodes_view", "pool_view", "tiers_view"]


def tier_stats(node: str, tier: str, stats: TierStats | Unreachable | None,
               bandwidth: TierBandwidth) -> TierView:
    if not isinstance(stats, TierStats):
        reason = stats.reason if isinstance(stats, Unreachable) else "no stats"
        return TierView(node=node, tier=tier, available=False, error=reason)
    s = stats.store
    lookups = s.hits + s.misses
    return TierView(
        node=node, tier=tier, available=True, emulated=stats.emulated, epoch=stats.epoch,
        capacity_bytes=s.capacity_bytes, used_bytes=s.used_bytes,
        occupancy=s.used_bytes / s.capacity_bytes if s.capacity_bytes else 0.0,
        blocks=s.blocks, pinned=stats.pinned, hits=s.hits, misses=s.misses,
        hit_ratio=s.hits / lookups if lookups else None, evictions=s.evictions,
        bytes_in=s.bytes_written, bytes_out=s.bytes_read, bandwidth=bandwidth,
        extra=_tier_extra(stats),
    )


def _tier_extra(stats: TierStats) -> dict[str, int | float | str]:
    """The figures a tier has beyond the common ones: reservations, leases, quarantines, its
    store's segments and directory, a fallback in force. Named one by one: a figure a store
    keeps per tenant can never slip through."""
    leases = stats.leases
    extra: dict[str, int | float | str] = {
        "reserved": stats.reserved, "pin_leases": leases.pinned,
        "reserve_leases": leases.reserved, "expired_leases": leases.expired,
        "released_leases": leases.released, "quarantined": stats.store.quarantined,
    }
    if isinstance(stats.store, NvmeStats):  # an NVMe store's, shown as they are
        s = stats.store
        extra.update(segments=s.segments, dead_bytes=s.dead_bytes, io_engine=s.io_engine)
    if stats.disk is not None:
        extra.update(store_id=stats.disk.store_id, orphan_dirs=stats.disk.orphan_dirs,
                     orphan_bytes=stats.disk.orphan_bytes)
    if stats.degraded:
        extra["degraded"] = stats.degraded
    return extra


def agent_info(stats: AgentStats | Unreachable | None) -> AgentInfo:
    if not isinstance(stats, AgentStats):
        reason = stats.reason if isinstance(stats, Unreachable) else "no stats"
        return AgentInfo(available=False, error=reason)
    q = stats.queues
    return AgentInfo(
        available=True, name=stats.agent, transport=stats.transport, placed_on=stats.placed_on,
        dpu=stats.dpu, degraded=stats.degraded,
        queues=QueueDepths(
            load=q.queued.get("load", 0), prefetch=q.queued.get("prefetch", 0),
            demote=q.queued.get("demote", 0), staging_bytes_in_use=q.staging_bytes_in_use,
            staging_bytes=q.staging_bytes,
        ),
        moved_bytes=dict(stats.moved_bytes), moved_via=dict(stats.moved_via),
        latency_s={op: LatencyHistogram(buckets=list(h.buckets), counts=list(h.counts),
                                        sum=h.sum, count=h.count)
                   for op, h in stats.latency.items()},
    )


def degradations(view: TiersView) -> list[tuple[str, str, str, str]]:
    """(node, component, kind, why) of every fallback in force: agents' and tiers'."""
    found = []
    for n in view.nodes:
        if n.agent.degraded:
            found.append((n.node, "agent", *parse(n.agent.degraded)))
        for t in n.tiers:
            text = t.extra.get("degraded")
            if isinstance(text, str):
                found.append((n.node, t.tier, *parse(text)))
    return found


def tiers_view(latest: Sample, previous: Sample | None) -> TiersView:
    nodes = []
    for node, entry in sorted(latest.stats.nodes.items()):
        tiers = []
        for tier in NODE_TIERS:
            rates = rates_between(previous, latest, (node, tier.value)) if previous else None
            bw = TierBandwidth() if rates is None else TierBandwidth(
                in_bytes_per_s=rates.in_bytes_per_s, out_bytes_per_s=rates.out_bytes_per_s,
                window_s=rates.window_s)
            tiers.append(tier_stats(node, tier.value, entry.tiers.get(tier), bw))
        nodes.append(NodeView(node=node, agent=agent_info(entry.agent), tiers=tiers))
    shards = []
    for i, d in enumerate(latest.stats.directory):
        if isinstance(d, DirectoryStats):
            shards.append(DirectoryShardInfo(shard=d.shard, available=True, blocks=d.blocks,
                                             copies=d.copies, sources=d.sources,
                                             lookups=d.lookups))
        else:
            shards.append(DirectoryShardInfo(shard=i, available=False, error=d.reason))
    return TiersView(sampled_at=latest.t, nodes=nodes, directory=shards)


def nodes_view(view: TiersView) -> NodesView:
    out = []
    for n in view.nodes:
        placement: Placement = ("unknown" if not n.agent.available else
                                ("dpu" if n.agent.dpu else "host"))
        out.append(NodeInfo(
            node=n.node, agent_available=n.agent.available, agent_placed_on=n.agent.placed_on,
            placement=placement, transport=n.agent.transport,
            tiers=[t.tier for t in n.tiers if t.available],
        ))
    return NodesView(nodes=out)


def pool_view(pool: PoolStats) -> PoolStatus:
    """The pool tier's status; ``enabled: false`` where the service runs no pool node."""
    if not pool.members:
        return PoolStatus(enabled=False)
    nodes = []
    for node, m in sorted(pool.members.items()):
        if isinstance(m, TierStats):
            nodes.append(PoolNode(node=node, capacity_bytes=m.capacity_bytes,
                                  used_bytes=m.used_bytes, blocks=m.blocks))
        else:
            nodes.append(PoolNode(node=node, available=False))
    return PoolStatus(
        enabled=True, capacity_bytes=pool.capacity_bytes, used_bytes=pool.used_bytes,
        blocks=pool.blocks, replication=pool.replication, nodes=nodes,
        detail={"under_replicated": pool.under_replicated},
    )


def history_view(samples: list[Sample], window_s: float, sample_s: float) -> History:
    series: dict[tuple[str, str], list[HistoryPoint]] = {}
    for before, after in zip([None, *samples[:-1]], samples):
        for tid, point in sorted(after.tiers.items()):
            rates = rates_between(before, after, tid) if before is not None else None
            series.setdefault(tid, []).append(HistoryPoint(
                t=after.t, used_bytes=point.used_bytes, capacity_bytes=point.capacity_bytes,
                hit_ratio=rates.hit_ratio if rates else None,
                in_bytes_per_s=rates.in_bytes_per_s if rates else None,
                out_bytes_per_s=rates.out_bytes_per_s if rates else None,
            ))
    return History(window_s=window_s, sample_s=sample_s, series=[
        HistorySeries(node=node, tier=tier, points=points)
        for (node, tier), points in sorted(series.items())])
