"""What the scheduler side of ``CMXConnector`` tells its workers each step, and what they tell
it back. Plain picklable data: with vLLM's multiprocessing on, the two sides live in different
processes and these objects are all that crosses between them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorMetadata,
    KVConnectorWorkerMetadata,
)

__all__ = ["CMXStepMetadata", "CMXWorkerReport", "LoadSpec", "LoadResult", "SaveSpec",
           "StoreResult"]


@dataclass(frozen=True)
class LoadSpec:
    """Load tokens ``[start, end)`` of a request's prompt into the engine's blocks ``block_ids``
    (one per block of that range, in order); ``token_ids`` is the prompt up to ``end``."""

    req_id: str
    salt: str  # the request's namespace salt
    token_ids: tuple[int, ...]
    start: int  # block-aligned: the tokens before it are already in the engine's cache
    end: int  # block-aligned
    block_ids: tuple[int, ...]


@dataclass(frozen=True)
class SaveSpec:
    """Store tokens ``[start, end)`` of a request, held in the engine's blocks ``block_ids``;
    ``token_ids`` is the prompt up to ``end`` (the keys chain from its first token)."""

    req_id: str
    salt: str
    token_ids: tuple[int, ...]
    start: int
    end: int
    block_ids: tuple[int, ...]


@dataclass
class CMXStepMetadata(KVConnectorMetadata):
    loads: list[LoadSpec] = field(default_factory=list)
    saves: list[SaveSpec] = field(default_factory=list)
    # Positions [start, end) computed this step, per request: the worker times the step and
    # reports it, so the break-even model learns this engine's prefill speed.
    computed: list[tuple[int, int]] = field(default_factory=list)
    # ``load_mode`` "async": loads of requests that wait (not scheduled) until each lands;
    # each ends in ``get_finished``'s receiving set, its blocks loaded or reported failed.
    async_loads: list[LoadSpec] = field(default_factory=list)
    # ``save_mode`` "async": finished requests whose blocks vLLM keeps until the worker names
    # them in ``get_finished``'s sending set (their queued copies are done).
    held: list[str] = field(default_factory=list)
    # Requests preempted this step: their queued copies finish before their blocks are reused.
    preempted: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class LoadResult:
    req_id: str
    asked_tokens: int
    loaded_tokens: int  # a prefix of what was asked; the rest was reported as failed blocks
    nbytes: int
    seconds: float
    sources: tuple[tuple[str, int], ...]  # (source class, bytes) of what was loaded


@dataclass(frozen=True)
class StoreResult:
    """How one store handed to the store thread ended: only committed blocks count as stored."""

    req_id: str
    tokens: int  # handed to the store
    committed_tokens: int  # in blocks the service committed (visible to lookups) for this store
    failed_tokens: int  # in blocks refused, or of a store that raised or timed out
    # The rest (tokens - committed - failed) were already held, or found no room: not stored.
    start: int = field(default=0, compare=False)  # the save's first token: which blocks


@dataclass
class CMXWorkerReport(KVConnectorWorkerMetadata):
    loads: list[LoadResult] = field(default_factory=list)
    handed: dict[str, int] = field(default_factory=dict)  # req_id -> tokens handed to the store
    stores: list[StoreResult] = field(default_factory=list)  # stores that ended since last step
    dropped: dict[str, int] = field(default_factory=dict)  # req_id -> tokens never handed
    step_s: float = 0.0  # the step's time, with ``computed`` from its metadata
    computed: list[tuple[int, int]] = field(default_factory=list)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        # vLLM joins a step's reports of all its workers here, the first as ``self``. The
        # connector refuses tensor parallelism (CMXConnector.__init__): with one worker there
        # is nothing to join; with more (pipeline stages) the first's report stands, alone.
        return self
