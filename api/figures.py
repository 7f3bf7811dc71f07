"""The service's metrics, once: named, typed figures computed from a stats view.

Both exports read this list: ``/metrics`` renders it in the Prometheus text format
(``cmx.api.prometheus``) and ``cmx.api.ray_metrics`` sets ``ray.util.metrics`` from it, so the
two never disagree. Every name starts with ``cmx_``; counters are named without ``_total``
(the exporters add it).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from cmx.api.models import PoolStatus, TiersView
from cmx.api.views import degradations

__all__ = ["Figure", "HistogramValue", "Kind", "figures", "scalar"]


class Kind(str, enum.Enum):
    GAUGE = "gauge"
    COUNTER = "counter"
    HISTOGRAM = "histogram"


@dataclass(frozen=True)
class HistogramValue:
    buckets: tuple[float, ...]  # upper bounds; +Inf implied
    counts: tuple[int, ...]  # per bucket, not cumulative; the last is +Inf
    sum: float


def scalar(value: float | HistogramValue) -> float:
    """A gauge's or a counter's sample as a number: a histogram's is not one."""
    if isinstance(value, HistogramValue):
        raise TypeError("a histogram sample where a number belongs")
    return float(value)


@dataclass
class Figure:
    name: str
    kind: Kind
    help: str
    labels: tuple[str, ...]
    samples: list[tuple[tuple[str, ...], float | HistogramValue]] = field(default_factory=list)

    def add(self, values: tuple[str, ...], value: float | HistogramValue) -> None:
        self.samples.append((values, value))


def _catalogue() -> dict[str, Figure]:
    G, C, H = Kind.GAUGE, Kind.COUNTER, Kind.HISTOGRAM
    nt = ("node", "tier")
    specs = [
        ("cmx_nodes", G, "Nodes the service runs on.", ()),
        ("cmx_component_up", G, "1 if the actor answered its last stats call.",
         ("node", "component")),
        ("cmx_tier_capacity_bytes", G, "Capacity of a tier of a node.", nt),
        ("cmx_tier_used_bytes", G, "Bytes held by a tier of a node.", nt),
        ("cmx_tier_occupancy_ratio", G, "Used over capacity, 0..1.", nt),
        ("cmx_tier_blocks", G, "Committed blocks in a tier.", nt),
        ("cmx_tier_pinned_blocks", G, "Blocks pinned by readers.", nt),
        ("cmx_tier_hit_ratio", G, "Hits over lookups since the tier started.", nt),
        ("cmx_tier_emulated", G, "1 for an HBM tier emulated on host memory.", nt),
        ("cmx_tier_bandwidth_bytes_per_second", G,
         "Bytes per second into (in) or out of (out) a tier between the last two samples.",
         ("node", "tier", "direction")),
        ("cmx_tier_hits", C, "Lookups a tier answered with a block.", nt),
        ("cmx_tier_misses", C, "Lookups a tier could not answer.", nt),
        ("cmx_tier_evictions", C, "Blocks a tier evicted.", nt),
        ("cmx_tier_bytes_in", C, "Bytes written into a tier.", nt),
        ("cmx_tier_bytes_out", C, "Bytes read out of a tier.", nt),
        ("cmx_moved_bytes", C, "Bytes the node's agent moved from one tier to another.",
         ("node", "src", "dst")),
        ("cmx_moved_via_bytes", C, "Bytes the node's agent moved, by transport.",
         ("node", "via")),
        ("cmx_transfer_latency_seconds", H, "Latency of the agent's operations.",
         ("node", "op")),
        ("cmx_agent_queue_depth", G, "Moves waiting in the agent's queue, by priority.",
         ("node", "priority")),
        ("cmx_agent_staging_bytes_in_use", G, "Staging memory the agent holds.", ("node",)),
        ("cmx_agent_info", G, "The agent's transport and placement (value 1).",
         ("node", "transport", "placement")),
        ("cmx_degraded", G, "1 for each fallback in force (object-store transport, buffered "
         "I/O).", ("node", "component", "kind")),
        ("cmx_directory_blocks", G, "Blocks a directory shard knows.", ("shard",)),
        ("cmx_directory_copies", G, "Copies a directory shard knows.", ("shard",)),
        ("cmx_pool_enabled", G, "1 if the service runs a pool tier.", ()),
        ("cmx_pool_capacity_bytes", G, "Capacity of the pool tier.", ()),
        ("cmx_pool_used_bytes", G, "Bytes held by the pool tier.", ()),
        ("cmx_pool_blocks", G, "Blocks in the pool tier.", ()),
    ]
    return {name: Figure(name, kind, doc, labels) for name, kind, doc, labels in specs}


CATALOGUE = tuple(_catalogue().values())  # what figures() may answer, empty


def figures(view: TiersView, pool: PoolStatus) -> list[Figure]:
    f = _catalogue()
    f["cmx_nodes"].add((), len(view.nodes))
    for n in view.nodes:
        f["cmx_component_up"].add((n.node, "agent"), float(n.agent.available))
        for t in n.tiers:
            f["cmx_component_up"].add((n.node, t.tier), float(t.available))
            if not t.available:
                continue
            key = (n.node, t.tier)
            for name, value in (
                ("cmx_tier_capacity_bytes", t.capacity_bytes),
                ("cmx_tier_used_bytes", t.used_bytes),
                ("cmx_tier_occupancy_ratio", t.occupancy),
                ("cmx_tier_blocks", t.blocks),
                ("cmx_tier_pinned_blocks", t.pinned),
                ("cmx_tier_emulated", float(t.emulated)),
                ("cmx_tier_hits", t.hits),
                ("cmx_tier_misses", t.misses),
                ("cmx_tier_evictions", t.evictions),
                ("cmx_tier_bytes_in", t.bytes_in),
                ("cmx_tier_bytes_out", t.bytes_out),
            ):
                f[name].add(key, float(value))
            if t.hit_ratio is not None:
                f["cmx_tier_hit_ratio"].add(key, t.hit_ratio)
            bw = f["cmx_tier_bandwidth_bytes_per_second"]
            if t.bandwidth.in_bytes_per_s is not None:
                bw.add((*key, "in"), t.bandwidth.in_bytes_per_s)
            if t.bandwidth.out_bytes_per_s is not None:
                bw.add((*key, "out"), t.bandwidth.out_bytes_per_s)
        a = n.agent
        if not a.available:
            continue
        for pair, moved in sorted(a.moved_bytes.items()):
            src, _, dst = pair.partition("->")
            f["cmx_moved_bytes"].add((n.node, src, dst), float(moved))
        for via, moved in sorted(a.moved_via.items()):
            f["cmx_moved_via_bytes"].add((n.node, via), float(moved))
        for op, h in sorted(a.latency_s.items()):
            f["cmx_transfer_latency_seconds"].add(
                (n.node, op), HistogramValue(tuple(h.buckets), tuple(h.counts), h.sum))
        for prio in ("load", "prefetch", "demote"):
            f["cmx_agent_queue_depth"].add((n.node, prio), float(getattr(a.queues, prio)))
        f["cmx_agent_staging_bytes_in_use"].add((n.node,), float(a.queues.staging_bytes_in_use))
        f["cmx_agent_info"].add((n.node, a.transport or "", "dpu" if a.dpu else "host"), 1.0)
    for node, component, kind, _ in degradations(view):
        f["cmx_degraded"].add((node, component, kind), 1.0)
    for shard in view.directory:
        f["cmx_component_up"].add(("", f"dir:{shard.shard}"), float(shard.available))
        if shard.available:
            f["cmx_directory_blocks"].add((str(shard.shard),), float(shard.blocks))
            f["cmx_directory_copies"].add((str(shard.shard),), float(shard.copies))
    f["cmx_pool_enabled"].add((), float(pool.enabled))
    if pool.enabled:
        f["cmx_pool_capacity_bytes"].add((), float(pool.capacity_bytes))
        f["cmx_pool_used_bytes"].add((), float(pool.used_bytes))
        f["cmx_pool_blocks"].add((), float(pool.blocks))
    return list(f.values())
