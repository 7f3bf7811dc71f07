"""What the scheduler side of ``CMXConnector`` tells its workers each step, and what they tell
it back. Plain picklable data: with vLLM's multiprocessing on, the two sides live in different
processes and these objects are all that crosses between them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorMetadata,
    KVConnectorWorkerMetadata,
)

__all__ = ["CMXStepMetadata", "CMXWorkerReport", "LoadSpec", "LoadResult", "RankReports",
           "SaveSpec", "StoreResult"]


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
    start: int = field(default=0, compare=False)  # the load's first token: which load
    rank: int = field(default=0, compare=False)  # the tensor-parallel rank that loaded


@dataclass(frozen=True)
class StoreResult:
    """How one store handed to the store thread ended: only committed blocks count as stored."""

    req_id: str
    tokens: int  # handed to the store
    committed_tokens: int  # in blocks the service committed (visible to lookups) for this store
    failed_tokens: int  # in blocks refused, or of a store that raised or timed out
    # The rest (tokens - committed - failed) were already held, or found no room: not stored.
    start: int = field(default=0, compare=False)  # the save's first token: which blocks
    rank: int = field(default=0, compare=False)  # the tensor-parallel rank that stored


@dataclass
class CMXWorkerReport(KVConnectorWorkerMetadata):
    loads: list[LoadResult] = field(default_factory=list)
    handed: dict[str, int] = field(default_factory=dict)  # req_id -> tokens handed to the store
    stores: list[StoreResult] = field(default_factory=list)  # stores that ended since last step
    dropped: dict[str, int] = field(default_factory=dict)  # req_id -> tokens never handed
    step_s: float = 0.0  # the step's time, with ``computed`` from its metadata
    computed: list[tuple[int, int]] = field(default_factory=list)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        """vLLM joins a step's reports of all its workers here, the first as ``self``. Each
        tensor-parallel rank loads and stores its own heads of the same blocks: their loads
        and stores ended are all kept (``RankReports`` joins each one's ends from every
        rank), what they handed or dropped is the same save seen by each, counted once."""
        if not isinstance(other, CMXWorkerReport):
            return self
        self.loads.extend(other.loads)
        self.stores.extend(other.stores)
        for mine, theirs in ((self.handed, other.handed), (self.dropped, other.dropped)):
            for req_id, tokens in theirs.items():
                mine[req_id] = max(mine.get(req_id, 0), tokens)
        self.step_s = max(self.step_s, other.step_s)
        self.computed = self.computed or other.computed
        return self


class RankReports:
    """The ends of each load and store from every rank of a tensor-parallel engine, joined:
    a load or store is over once each rank that runs it said so, and counts what all of them
    did (the fewest tokens loaded or committed). One rank: each end passes as it is."""

    def __init__(self, loading: int, storing: int) -> None:
        self.loading = loading  # ranks that run each load
        self.storing = storing  # ranks that run each store (each head stored once)
        # (request, first token) -> rank -> its ends not yet joined
        self._loads: dict[tuple[str, int], dict[int, list[Any]]] = {}
        self._stores: dict[tuple[str, int], dict[int, list[Any]]] = {}

    def loads(self, ended: list[LoadResult]) -> list[LoadResult]:
        if self.loading == 1:
            return ended
        return [_join_loads(ends) for ends in _gather(self._loads, ended, self.loading)]

    def stores(self, ended: list[StoreResult]) -> list[StoreResult]:
        if self.storing == 1:
            return ended
        return [_join_stores(ends) for ends in _gather(self._stores, ended, self.storing)]


def _gather(waiting: dict[tuple[str, int], dict[int, list[Any]]], ended: list[Any],
            ranks: int) -> list[list[Any]]:
    """Each (request, first token) once an end from each of ``ranks`` ranks is in: the first
    of each rank's (vLLM may use a request id again: a later one waits its turn)."""
    over = []
    for end in ended:
        key = (end.req_id, end.start)
        by_rank = waiting.setdefault(key, {})
        by_rank.setdefault(end.rank, []).append(end)
        if len(by_rank) == ranks:
            over.append([ends.pop(0) for ends in by_rank.values()])
            left = {rank: ends for rank, ends in by_rank.items() if ends}
            if left:
                waiting[key] = left
            else:
                del waiting[key]
    return over


def _join_loads(ends: list[LoadResult]) -> LoadResult:
    least = min(ends, key=lambda e: e.loaded_tokens)
    return LoadResult(least.req_id, least.asked_tokens, least.loaded_tokens,
                      sum(e.nbytes for e in ends), max(e.seconds for e in ends),
                      least.sources, least.start)


def _join_stores(ends: list[StoreResult]) -> StoreResult:
    """Committed what every rank committed; handed what any rank handed (a rank that dropped
    the save ends it with none: ``StorePipeline.drops_end``)."""
    least = min(ends, key=lambda e: e.committed_tokens)
    return StoreResult(least.req_id, max(e.tokens for e in ends), least.committed_tokens,
                       max(e.failed_tokens for e in ends), least.start)
