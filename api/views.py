"""The service's raw stats as the API's typed views. Pure functions of samples.

A part of the service that did not answer appears with ``available: false`` and its error,
never as a failed request: the admin wants to see the rest of the cluster anyway.

Every figure is per node, tier or directory shard, summed over tenants: a figure a part reports
per namespace, tenant or salt (or a nested map, which could be keyed by one) is left out, so
no reader of these views learns one tenant's hits or what it stored.
"""

from __future__ import annotations

from typing import Any

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
    TierStats,
    TiersView,
)
from cmx.api.stats_samples import Sample, rates_between
from cmx.operate.degraded import parse
from cmx.tiers import Tier

__all__ = ["degradations", "history_view", "nodes_view", "pool_view", "tiers_view"]

NODE_TIERS = (Tier.HBM.value, Tier.DRAM.value, Tier.NVME.value)
_TIER_FIELDS = ("capacity_bytes", "used_bytes", "blocks", "pinned", "hits", "misses",
                "evictions", "bytes_in", "bytes_out")
_COMMON = {"tier", "node", "emulated", "epoch", *_TIER_FIELDS}


def _int(value: Any) -> int:
    try:
        return int(value)
    except (TypeError, ValueError):
        return 0


def tier_stats(node: str, tier: str, raw: Any, bandwidth: TierBandwidth) -> TierStats:
    if not isinstance(raw, dict) or "error" in raw or "capacity_bytes" not in raw:
        error = raw.get("error") if isinstance(raw, dict) else None
        return TierStats(node=node, tier=tier, available=False,
                         error=str(error or "no stats"))
    figures = {f: _int(raw.get(f)) for f in _TIER_FIELDS}
    lookups = figures["hits"] + figures["misses"]
    cap = figures["capacity_bytes"]
    extra = {k: v for k, v in raw.items()
             if k not in _COMMON and _public_figure(k, v) and not isinstance(v, bool)}
    return TierStats.model_validate({
        "node": node, "tier": tier, "available": True,
        "emulated": bool(raw.get("emulated", False)), "epoch": raw.get("epoch"),
        "occupancy": figures["used_bytes"] / cap if cap else 0.0,
        "hit_ratio": figures["hits"] / lookups if lookups else None, "bandwidth": bandwidth,
        "extra": extra, **figures,
    })


def agent_info(raw: Any) -> AgentInfo:
    if not isinstance(raw, dict) or "error" in raw:
        error = raw.get("error") if isinstance(raw, dict) else None
        return AgentInfo(available=False, error=str(error or "no stats"))
    queues = raw.get("queues") or {}
    queued = queues.get("queued") or {}
    placement = raw.get("placement") or {}
    latency = {}
    for op, h in (raw.get("latency_s") or {}).items():
        if isinstance(h, dict) and {"buckets", "counts", "sum", "count"} <= h.keys():
            latency[op] = LatencyHistogram(buckets=[float(b) for b in h["buckets"]],
                                           counts=[_int(c) for c in h["counts"]],
                                           sum=float(h["sum"]), count=_int(h["count"]))
    return AgentInfo(
        available=True, name=raw.get("agent"), transport=raw.get("transport"),
        placed_on=placement.get("placed_on"), dpu=bool(placement.get("dpu", False)),
        degraded=raw.get("degraded"),
        queues=QueueDepths(
            load=_int(queued.get("load")), prefetch=_int(queued.get("prefetch")),
            demote=_int(queued.get("demote")),
            staging_bytes_in_use=_int(queues.get("staging_bytes_in_use")),
            staging_bytes=_int(queues.get("staging_bytes")),
        ),
        moved_bytes={str(k): _int(v) for k, v in (raw.get("moved_bytes") or {}).items()},
        moved_via={str(k): _int(v) for k, v in (raw.get("moved_via") or {}).items()},
        latency_s=latency,
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
    for node, entry in sorted((latest.stats.get("nodes") or {}).items()):
        tiers = []
        raw_tiers = entry.get("tiers") or {}
        for tier in [*NODE_TIERS, *sorted(set(raw_tiers) - set(NODE_TIERS))]:
            rates = rates_between(previous, latest, (node, tier)) if previous else None
            bw = TierBandwidth() if rates is None else TierBandwidth(
                in_bytes_per_s=rates.in_bytes_per_s, out_bytes_per_s=rates.out_bytes_per_s,
                window_s=rates.window_s)
            tiers.append(tier_stats(node, tier, raw_tiers.get(tier), bw))
        nodes.append(NodeView(node=node, agent=agent_info(entry.get("agent")), tiers=tiers))
    shards = []
    for i, raw in enumerate(latest.stats.get("directory") or []):
        if not isinstance(raw, dict):
            continue
        ok = "error" not in raw
        shards.append(DirectoryShardInfo(
            shard=_int(raw.get("shard", i)), available=ok, error=raw.get("error"),
            **{f: _int(raw.get(f)) for f in ("blocks", "copies", "sources", "lookups")}))
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


def pool_view(raw: Any) -> PoolStatus:
    """The pool tier's status from ``stats()["pool"]``; an empty pool where there is none."""
    if not isinstance(raw, dict) or not raw:
        return PoolStatus(enabled=False)
    nodes_raw = raw.get("nodes") or []
    if isinstance(nodes_raw, dict):
        nodes_raw = [{"node": k, **(v if isinstance(v, dict) else {})} for k, v in
                     nodes_raw.items()]
    nodes = []
    for item in nodes_raw:
        if isinstance(item, dict):
            nodes.append(PoolNode(
                node=str(item.get("node", item.get("name", "?"))),
                capacity_bytes=_int(item.get("capacity_bytes")),
                used_bytes=_int(item.get("used_bytes")), blocks=_int(item.get("blocks")),
                available="error" not in item))
        elif isinstance(item, str):
            nodes.append(PoolNode(node=item))
    replication = raw.get("replication", raw.get("replicas"))
    known = {"nodes", "capacity_bytes", "used_bytes", "blocks", "replication", "replicas"}
    detail = {k: v for k, v in raw.items() if k not in known and _public_figure(k, v)}
    return PoolStatus(
        enabled=bool(raw.get("enabled", bool(nodes))),
        capacity_bytes=_int(raw.get("capacity_bytes", sum(n.capacity_bytes for n in nodes))),
        used_bytes=_int(raw.get("used_bytes", sum(n.used_bytes for n in nodes))),
        blocks=_int(raw.get("blocks", sum(n.blocks for n in nodes))),
        replication=None if replication is None else _int(replication),
        nodes=nodes, detail=detail,
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


_TENANT_WORDS = ("namespace", "tenant", "salt")


def _public_figure(name: Any, value: Any) -> bool:
    """A scalar figure whose name does not say it is one tenant's."""
    if not isinstance(name, str) or any(w in name.lower() for w in _TENANT_WORDS):
        return False
    return isinstance(value, (bool, int, float, str))
