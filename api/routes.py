"""Read endpoints: health, tiers, nodes, pool, blocks, prefix lookups, history, metrics.

Handlers are plain functions: FastAPI runs them in its thread pool, where blocking actor
calls are fine.
"""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends, Path, Query, Request
from fastapi.responses import JSONResponse, Response

from cmx import __version__
from cmx.api.figures import figures
from cmx.api.lookup import copy_info, lookup_prefix, parse_key, resolve_node
from cmx.api.models import (
    HEX_KEY_PATTERN,
    NODE_PATTERN,
    BlockCopies,
    Health,
    History,
    LookupRequest,
    LookupResult,
    NodesView,
    NodeView,
    PoolStatus,
    Readiness,
    TiersView,
)
from cmx.api.problems import ApiProblem, problem_responses
from cmx.api.prometheus import CONTENT_TYPE_LATEST, render
from cmx.api.security import require_query, require_read
from cmx.api.state import ApiState
from cmx.api.views import degradations, history_view, nodes_view, pool_view

__all__ = ["router"]

router = APIRouter(dependencies=[Depends(require_read)])

_AUTH = (401, 403)
_UNAVAILABLE = (503,)


def api_state(request: Request) -> ApiState:
    return request.app.state.cmx


State = Annotated[ApiState, Depends(api_state)]


@router.get("/healthz", tags=["health"], response_model=Health,
            responses=problem_responses(*_AUTH))
def health() -> Health:
    """The server is up (it says nothing of the service behind it)."""
    return Health(version=__version__)


@router.get("/readyz", tags=["health"], response_model=Readiness,
            responses={**problem_responses(*_AUTH),
                       503: {"model": Readiness, "description": "Not ready"}})
def readiness(state: State) -> Readiness | JSONResponse:
    """Ready when the service's controller answers and lists at least one node."""
    try:
        nodes = state.backend.nodes()
    except Exception as exc:  # noqa: BLE001 - not ready, whatever the reason
        body = Readiness(ready=False, nodes=0, detail=str(exc))
        return JSONResponse(body.model_dump(), status_code=503)
    if not nodes:
        body = Readiness(ready=False, nodes=0, detail="the service runs on no node yet")
        return JSONResponse(body.model_dump(), status_code=503)
    try:  # ready, but a fallback in force is said
        fallbacks = degradations(state.view()[1])
    except Exception:  # noqa: BLE001 - no figures yet: nothing to say
        fallbacks = []
    detail = "; ".join(f"{node[:12]} {part}: {kind} ({why})"
                       for node, part, kind, why in fallbacks) or None
    return Readiness(ready=True, nodes=len(nodes), detail=detail)


@router.get("/api/v1/tiers", tags=["tiers"], response_model=TiersView,
            responses=problem_responses(*_AUTH, *_UNAVAILABLE))
def tiers(state: State) -> TiersView:
    """Every tier of every node: capacity, use, hits, bytes and recent bandwidth; the agents'
    queues and transports; the directory's shards."""
    return state.view()[1]


@router.get("/api/v1/nodes", tags=["nodes"], response_model=NodesView,
            responses=problem_responses(*_AUTH, *_UNAVAILABLE))
def nodes(state: State) -> NodesView:
    """The nodes, where each node's offload agent is placed (its host or its DPU)."""
    return nodes_view(state.view()[1])


@router.get("/api/v1/nodes/{node}", tags=["nodes"], response_model=NodeView,
            responses=problem_responses(*_AUTH, 404, 422, *_UNAVAILABLE))
def node(
    state: State,
    node: Annotated[str, Path(pattern=NODE_PATTERN, description="Node id or a unique prefix")],
) -> NodeView:
    """One node's tiers and agent."""
    view = state.view()[1]
    wanted = resolve_node(node, [n.node for n in view.nodes])
    return next(n for n in view.nodes if n.node == wanted)


@router.get("/api/v1/pool", tags=["tiers"], response_model=PoolStatus,
            responses=problem_responses(*_AUTH, *_UNAVAILABLE))
def pool(state: State) -> PoolStatus:
    """The pooled NVMe tier; ``enabled: false`` where the service runs none."""
    return pool_view(state.view()[0].stats.pool)


@router.get("/api/v1/blocks/{key}", tags=["blocks"], response_model=BlockCopies,
            dependencies=[Depends(require_query)],
            responses=problem_responses(*_AUTH, 404, 422, *_UNAVAILABLE))
def block(
    state: State,
    key: Annotated[str, Path(pattern=HEX_KEY_PATTERN, description="Block key, 64 hex digits")],
) -> BlockCopies:
    """Where a block's committed copies are; 404 if the directory knows none. Needs the token
    unless the server opens queries (``CMX_ADMIN_OPEN_QUERIES``)."""
    raw = parse_key(key)
    copies = state.backend.copies([raw])[0]
    if not copies:
        raise ApiProblem(404, f"no committed copy of block {key.lower()}")
    return BlockCopies(key=raw.hex(), copies=[copy_info(c) for c in copies])


@router.post("/api/v1/lookup", tags=["blocks"], response_model=LookupResult,
             dependencies=[Depends(require_query)],
             responses=problem_responses(*_AUTH, 413, 422, *_UNAVAILABLE))
def lookup(state: State, req: LookupRequest) -> LookupResult:
    """The longest cached prefix of ``token_ids`` in a namespace (model, layout, salt), and
    where each of its blocks is. Only full blocks have keys. Needs the token unless the server
    opens queries (``CMX_ADMIN_OPEN_QUERIES``)."""
    return lookup_prefix(state.backend, req)


@router.get("/api/v1/history", tags=["tiers"], response_model=History,
            responses=problem_responses(*_AUTH, 422))
def history(
    state: State,
    window_s: Annotated[float, Query(gt=0, le=86400, description="Seconds back")] = 600.0,
) -> History:
    """Per node and tier: occupancy, hit ratio and bandwidth of the recent samples."""
    window = min(window_s, state.config.history_s)
    return history_view(state.sampler.window(window), window, state.config.sample_s)


@router.get("/metrics", tags=["metrics"], response_class=Response,
            responses={200: {"content": {CONTENT_TYPE_LATEST: {}},
                             "description": "Prometheus text format"},
                       **problem_responses(*_AUTH, *_UNAVAILABLE)})
def metrics(state: State) -> Response:
    """Prometheus text format; every name starts with ``cmx_``."""
    latest, view = state.view()
    body = render(figures(view, pool_view(latest.stats.pool)))
    return Response(body, media_type=CONTENT_TYPE_LATEST)
