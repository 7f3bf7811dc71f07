"""Mutating endpoints: pin, unpin, evict, drop a namespace. Each needs the admin token.

A pin taken here holds the block for the TTL its request names (``ttl_s``: default an hour, at
most a day; ``cmx.actors.tiers.leases``), then the tier gives it back, unless
``/api/v1/unpin`` of the same key ends it first (tiers count pins, so unpin once per pin). A
restarted tier holds none. Eviction skips pinned and uncommitted blocks.
"""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends, Path

from cmx.api.backend import NotSupportedError
from cmx.api.lookup import parse_key, resolve_node
from cmx.api.models import (
    NAMESPACE_PATTERN,
    BlockRef,
    BlockRefResult,
    DropResult,
    EvictedAt,
    EvictRequest,
    EvictResult,
    NodeTier,
    PinRequest,
    PinResult,
)
from cmx.api.problems import ApiProblem, problem_responses
from cmx.api.routes import State
from cmx.api.security import require_admin
from cmx.doors import Contains, Evict, Unpin
from cmx.errors import UnavailableError
from cmx.keys import BlockHash
from cmx.keys import namespace_id as short_namespace_id
from cmx.tiers import Tier

__all__ = ["router"]

router = APIRouter(dependencies=[Depends(require_admin)], tags=["admin"])

_COMMON = (401, 403, 404, 422, 503)


def _target(state: State, ref: BlockRef) -> tuple[BlockHash, str, Tier]:
    key = parse_key(ref.key)
    node = resolve_node(ref.node, state.backend.nodes())
    return key, node, Tier(ref.tier.value)


@router.post("/api/v1/pin", response_model=PinResult,
             responses=problem_responses(*_COMMON))
def pin(state: State, req: PinRequest) -> PinResult:
    """Pin a block in one tier of one node for ``ttl_s`` seconds, so eviction skips it; 404 if
    it is not there, 422 for a TTL that is not a number in (0, 86400]."""
    key, node, tier = _target(state, req)
    if not state.backend.pin(node, tier, key, req.ttl_s):
        raise ApiProblem(404, f"block {key.hex()} is not in {tier.value} of node {node}")
    return PinResult(key=key.hex(), node=node, tier=tier.value, done=True, ttl_s=req.ttl_s)


@router.post("/api/v1/unpin", response_model=BlockRefResult,
             responses=problem_responses(*_COMMON))
def unpin(state: State, ref: BlockRef) -> BlockRefResult:
    """Release one pin taken with ``/api/v1/pin``; 404 if the block is not there."""
    key, node, tier = _target(state, ref)
    here = state.backend.tier_call(node, tier, Contains(keys=[key]))
    if not here or not here[0]:
        raise ApiProblem(404, f"block {key.hex()} is not in {tier.value} of node {node}")
    state.backend.tier_call(node, tier, Unpin(leases=[key]))
    return BlockRefResult(key=key.hex(), node=node, tier=tier.value, done=True)


@router.post("/api/v1/evict", response_model=EvictResult,
             responses=problem_responses(*_COMMON))
def evict(state: State, req: EvictRequest) -> EvictResult:
    """Evict blocks from one tier or all, on one node or all. Pinned blocks stay."""
    keys = [parse_key(k) for k in dict.fromkeys(k.lower() for k in req.keys)]
    all_nodes = state.backend.nodes()
    nodes = [resolve_node(req.node, all_nodes)] if req.node else all_nodes
    tiers = [req.tier] if req.tier else list(NodeTier)
    results, unavailable = [], []
    for node in nodes:
        for tier in tiers:
            try:
                n = int(state.backend.tier_call(node, Tier(tier.value), Evict(keys=keys)))
            except UnavailableError:
                unavailable.append(f"cmx:{tier.value}:{node}")
                continue
            results.append(EvictedAt(node=node, tier=tier.value, evicted=n))
    return EvictResult(requested=len(keys), evicted=sum(r.evicted for r in results),
                       results=results, unavailable=unavailable)


@router.delete("/api/v1/namespaces/{namespace_id}", response_model=DropResult,
               responses=problem_responses(*_COMMON, 501))
def drop_namespace(
    state: State,
    namespace_id: Annotated[str, Path(
        pattern=NAMESPACE_PATTERN,
        description="Namespace id: 16 hex digits (as lookups report it) or the full digest")],
) -> DropResult:
    """Evict every copy of every block of a namespace from every tier that holds one (HBM,
    DRAM, NVMe, pool); pinned copies stay. 501 if the running service cannot."""
    ns_id = short_namespace_id(namespace_id)  # blocks carry the 16-hex id, not the digest
    try:
        dropped = state.backend.drop_namespace(ns_id)
    except NotSupportedError as exc:
        raise ApiProblem(501, str(exc)) from exc
    return DropResult(namespace_id=ns_id, dropped=dropped)
