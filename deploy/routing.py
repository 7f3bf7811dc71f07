"""Which replica should take a request: the one where its time to first token is lowest.

For each replica the estimate is what that replica's own break-even gate would decide (the
same ``BreakEven.plan``, with the figures the replica measured and reports in its routing
stats): the cached prefix's blocks are priced by where their copies are *seen from the
replica's node* (this node's DRAM is cheap, another node's NVMe is not), the rest of the prompt
by the replica's prefill speed, and the requests already queued there by its time per request.
A plain function of plain data, so it is tested without Serve.
"""

from __future__ import annotations

import random
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from cmx.policies.breakeven import BreakEven, PrefillCost
from cmx.tiers import tier_specs

__all__ = ["CopySeen", "ReplicaView", "Route", "best_source", "known_replicas",
           "publish_replicas", "rank_replicas"]

_KNOWN: dict[str, list[dict[str, str]]] = {}  # deployment name -> [{"replica", "node"}]
_KNOWN_LOCK = threading.Lock()


def publish_replicas(deployment: str, replicas: list[dict[str, str]]) -> None:
    """What a router in this process routes ``deployment``'s requests to (it calls this)."""
    with _KNOWN_LOCK:
        _KNOWN[deployment] = [dict(r) for r in replicas]


def known_replicas(deployment: str) -> list[dict[str, str]]:
    with _KNOWN_LOCK:
        return [dict(r) for r in _KNOWN.get(deployment, [])]


@dataclass(frozen=True)
class CopySeen:
    """A committed copy of a block, as the directory reports it."""

    tier: str  # "hbm", "dram", "nvme", "pool"
    node: str
    size: int


@dataclass(frozen=True)
class ReplicaView:
    replica_id: str
    node: str
    queue_len: int = 0  # requests on the replica now (running and waiting)
    per_request_s: float = 1.0  # mean seconds a request holds the replica
    # (per_token_s, per_pair_s, per_pass_s) measured
    prefill: tuple[float, float, float] | None = None
    links: Mapping[str, tuple[float, float]] = field(default_factory=dict)  # class -> (lat, bw)
    gating: bool = True  # the replica gates loads by break-even (False: it loads every hit)


@dataclass(frozen=True)
class Route:
    replica_id: str
    est_ttft_s: float  # queue wait + load + prefill, estimated
    load_tokens: int  # what the replica would load
    wait_s: float  # the queue part


def best_source(copies: Sequence[CopySeen], node: str) -> str | None:
    """The source class a load on ``node`` would use: this node's fastest, else a peer's."""
    rank = {s.name: s.rank for s in tier_specs()}
    local = sorted((rank.get(c.tier, 9), c.tier) for c in copies if c.node == node)
    if local:
        return local[0][1]
    remote = sorted((rank.get(c.tier, 9), c.tier) for c in copies)
    return f"{remote[0][1]}@peer" if remote else None


def rank_replicas(
    replicas: Sequence[ReplicaView], prefix: Sequence[Sequence[CopySeen]], block_tokens: int,
    prompt_tokens: int, chunk_tokens: int, rng: random.Random | None = None,
) -> list[Route]:
    """Replicas best first. ``prefix``: the copies of each cached block, in prompt order."""
    rng = rng or random.Random()
    routes = []
    for r in replicas:
        cost = PrefillCost(*r.prefill) if r.prefill else PrefillCost()
        cost.chunk = chunk_tokens
        gate = BreakEven(cost, enabled=r.gating)
        for name, (lat, bw) in r.links.items():
            link = gate.link(name)
            link.latency_s, link.bandwidth = lat, bw
        blocks = []
        for copies in prefix:
            source = best_source(copies, r.node)
            if source is None:
                break
            blocks.append((source, max(c.size for c in copies)))
        plan = gate.plan(blocks, block_tokens, prompt_tokens, align=chunk_tokens)
        wait = r.queue_len * r.per_request_s
        routes.append((wait + plan.est_ttft_s, rng.random(),
                       Route(r.replica_id, wait + plan.est_ttft_s, plan.load_tokens, wait)))
    routes.sort(key=lambda t: (t[0], t[1]))
    return [route for _, _, route in routes]
