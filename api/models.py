"""Typed requests and responses of the admin API (pydantic at the HTTP edge).

Block keys travel as 64 lower- or upper-case hex characters; node ids as the hex Ray node id or
a unique prefix of it (at least 6 characters). Sizes are bytes, rates bytes per second, times
seconds (``sampled_at`` and history points are Unix time).
"""

from __future__ import annotations

import enum
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StringConstraints

from cmx.actors.tiers.leases import ADMIN_PIN_DEFAULT_S, ADMIN_PIN_MAX_S
from cmx.layout import PayloadOrder

__all__ = [
    "AgentInfo", "BlockCopies", "BlockRef", "BlockRefResult", "CopyInfo", "DirectoryShardInfo",
    "DropResult", "EvictRequest", "EvictResult", "EvictedAt", "HexKey", "Health", "History",
    "HistoryPoint", "HistorySeries", "LatencyHistogram", "LayoutSpec", "LookupBlock",
    "LookupRequest", "LookupResult", "NodeId", "NodeInfo", "NodeTier", "NodeView", "NodesView",
    "PinRequest", "PinResult", "PoolNode", "PoolStatus", "Problem", "QueueDepths", "Readiness",
    "TierBandwidth", "TierStats", "TiersView",
]

HEX_KEY_PATTERN = r"^[0-9a-fA-F]{64}$"
NODE_PATTERN = r"^[0-9a-fA-F]{6,128}$"
NAMESPACE_PATTERN = r"^([0-9a-fA-F]{16}|[0-9a-fA-F]{64})$"
MAX_TOKENS = 1 << 20  # token ids in one lookup
MAX_KEYS = 1024  # keys in one evict

HexKey = Annotated[str, StringConstraints(pattern=HEX_KEY_PATTERN)]
NodeId = Annotated[str, StringConstraints(pattern=NODE_PATTERN)]
TokenId = Annotated[int, Field(ge=0, le=0xFFFFFFFF)]
Placement = Literal["host", "dpu", "unknown"]  # where a node's agent runs
Dtype = Literal["bfloat16", "float16", "float32", "float8_e4m3fn", "float8_e5m2"]  # DTYPE_BYTES


class NodeTier(str, enum.Enum):
    """The tiers every node has; the pool is the cluster's and is not addressed per node."""

    HBM = "hbm"
    DRAM = "dram"
    NVME = "nvme"


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid")


# -- tiers and nodes ---------------------------------------------------------------------------


class TierBandwidth(_Model):
    """Bytes per second into and out of a tier between the last two samples."""

    in_bytes_per_s: float | None = None  # None: fewer than two comparable samples
    out_bytes_per_s: float | None = None
    window_s: float | None = None  # the time between those samples


class TierStats(_Model):
    node: str
    tier: str
    available: bool  # False: the tier actor did not answer (``error`` says why)
    error: str | None = None
    emulated: bool = False  # an HBM tier on host memory (no GPU)
    epoch: str | None = None  # changes when the tier restarts
    capacity_bytes: int = 0
    used_bytes: int = 0
    occupancy: float = 0.0  # used / capacity, 0..1
    blocks: int = 0
    pinned: int = 0
    hits: int = 0
    misses: int = 0
    hit_ratio: float | None = None  # hits / (hits + misses) since the tier started
    evictions: int = 0
    bytes_in: int = 0
    bytes_out: int = 0
    bandwidth: TierBandwidth = TierBandwidth()
    extra: dict[str, int | float | str] = {}  # tier-specific figures (NVMe segments, ...)


class QueueDepths(_Model):
    load: int = 0
    prefetch: int = 0
    demote: int = 0
    staging_bytes_in_use: int = 0
    staging_bytes: int = 0


class LatencyHistogram(_Model):
    buckets: list[float]  # upper bounds in seconds; +Inf implied
    counts: list[int]  # per bucket (not cumulative), the last for +Inf
    sum: float
    count: int


class AgentInfo(_Model):
    available: bool
    error: str | None = None
    name: str | None = None
    transport: str | None = None  # "nixl-ucx", "ray", ...
    placed_on: str | None = None  # the Ray node the agent runs on
    dpu: bool = False  # placed on the node's DPU rather than on the host
    degraded: str | None = None  # a fallback in force, "<kind>: <why>" (cmx.operate.degraded)
    queues: QueueDepths = QueueDepths()
    moved_bytes: dict[str, int] = {}  # "src->dst" -> bytes
    moved_via: dict[str, int] = {}  # transport (or "local", "nvme") -> bytes
    latency_s: dict[str, LatencyHistogram] = {}  # op -> histogram


class NodeView(_Model):
    node: str
    agent: AgentInfo
    tiers: list[TierStats]


class DirectoryShardInfo(_Model):
    shard: int
    available: bool
    blocks: int = 0
    copies: int = 0
    sources: int = 0
    lookups: int = 0
    error: str | None = None


class TiersView(_Model):
    sampled_at: float
    nodes: list[NodeView]
    directory: list[DirectoryShardInfo]


class NodeInfo(_Model):
    node: str
    agent_available: bool
    agent_placed_on: str | None = None
    placement: Placement
    transport: str | None = None
    tiers: list[str]  # the tiers that answered


class NodesView(_Model):
    nodes: list[NodeInfo]


class PoolNode(_Model):
    node: str
    capacity_bytes: int = 0
    used_bytes: int = 0
    blocks: int = 0
    available: bool = True


class PoolStatus(_Model):
    enabled: bool  # False: the service runs no pool tier
    capacity_bytes: int = 0
    used_bytes: int = 0
    blocks: int = 0
    replication: int | None = None
    nodes: list[PoolNode] = []
    detail: dict[str, bool | int | float | str] = {}  # its other scalar figures


# -- blocks, lookups and admin actions ---------------------------------------------------------


class CopyInfo(_Model):
    tier: str
    node: str
    size: int
    checksum: int


class BlockCopies(_Model):
    key: str
    copies: list[CopyInfo]


class LayoutSpec(_Model):
    """The KV layout of the namespace (it is part of every key)."""

    num_layers: int = Field(ge=1, le=4096)
    num_kv_heads: int = Field(ge=1, le=4096)
    head_dim: int = Field(ge=1, le=65536)
    dtype: Dtype = "bfloat16"
    block_tokens: int = Field(default=256, ge=1, le=1 << 20)
    order: PayloadOrder = PayloadOrder.LAYER_MAJOR


class LookupRequest(_Model):
    model: str = Field(min_length=1, max_length=512)
    layout: LayoutSpec
    salt: str = Field(default="", max_length=512)
    weights: str = Field(default="", max_length=512)
    token_ids: list[TokenId] = Field(max_length=MAX_TOKENS)


class LookupBlock(_Model):
    index: int
    key: str
    tier: str  # the fastest tier holding a copy
    node: str  # where that copy is
    copies: list[CopyInfo]


class LookupResult(_Model):
    namespace_id: str
    num_tokens: int  # of the longest cached prefix
    num_blocks: int
    full_blocks: int  # full blocks in the request's token ids
    blocks: list[LookupBlock]


class BlockRef(_Model):
    key: HexKey
    node: NodeId
    tier: NodeTier


class BlockRefResult(_Model):
    key: str
    node: str
    tier: str
    done: bool


class PinRequest(BlockRef):
    """An operator's pin: it holds ``ttl_s`` seconds (a number, more than 0 and at most a day),
    unless ``/api/v1/unpin`` of the same key ends it first."""

    ttl_s: Annotated[float, Field(strict=True, gt=0, le=ADMIN_PIN_MAX_S, allow_inf_nan=False)] \
        = ADMIN_PIN_DEFAULT_S


class PinResult(BlockRefResult):
    ttl_s: float  # the pin ends this many seconds after it was taken, unless unpinned first


class EvictRequest(_Model):
    keys: list[HexKey] = Field(min_length=1, max_length=MAX_KEYS)
    tier: NodeTier | None = None  # None: every tier
    node: NodeId | None = None  # None: every node


class EvictedAt(_Model):
    node: str
    tier: str
    evicted: int


class EvictResult(_Model):
    requested: int
    evicted: int  # copies removed (a block on two tiers counts twice); pinned ones stay
    results: list[EvictedAt]
    unavailable: list[str]  # tier actors that did not answer


class DropResult(_Model):
    namespace_id: str
    dropped: int


class Health(_Model):
    status: Literal["ok"] = "ok"
    version: str


class Readiness(_Model):
    ready: bool
    nodes: int
    detail: str | None = None


class HistoryPoint(_Model):
    t: float
    used_bytes: int
    capacity_bytes: int
    hit_ratio: float | None  # over the interval since the previous point
    in_bytes_per_s: float | None
    out_bytes_per_s: float | None


class HistorySeries(_Model):
    node: str
    tier: str
    points: list[HistoryPoint]


class History(_Model):
    window_s: float
    sample_s: float
    series: list[HistorySeries]


class Problem(BaseModel):
    """RFC 7807 problem details (``application/problem+json``)."""

    type: str = "about:blank"
    title: str
    status: int
    detail: str | None = None
    instance: str | None = None
    errors: list[dict[str, Any]] | None = None  # per-field validation errors
