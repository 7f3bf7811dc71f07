"""The stores of ``CMXConnector``'s worker: each step's saves handed to the service off the
forward pass, at most ``max_pending_stores`` at once, and how each ended said once.

Per save, in vLLM's call order:

1. ``hand`` (sync saves, ``wait_for_save``): the save's KV was copied out of the paged cache
   layer by layer during the forward (``save_kv_layer``); it goes to the store thread, or is
   dropped (and counted) when too many stores are in flight or a layer is missing.
   ``queue`` (async saves): the save waits for the ``Gatherer`` to copy it after the step, or
   is dropped when stores or staging are full.
2. The store thread stores (``NamespaceClient.store``) and waits, bounded, for the commit; a
   direct copy (host caches: ``Gatherer.direct``) has already put the blocks in DRAM slots on
   the gather thread, and only its commit is waited for here.
3. ``take`` hands over, once, what was handed and dropped since the last report and how each
   finished store ended (``StoreResult``: what the service committed; what it refused, what
   raised or timed out counts as failed, never as stored).
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from cmx.connectors.paged import PagedLayout, PagedSource
from cmx.connectors.settings import ConnectorSettings, Namespaces
from cmx.connectors.vllm_gather import Gatherer
from cmx.connectors.vllm_meta import SaveSpec, StoreResult
from cmx.connectors.vllm_stats import Counters
from cmx.errors import UnavailableError

__all__ = ["DIRECT_GRANT_S", "StorePipeline"]

log = logging.getLogger(__name__)

# A direct save waits this long for its DRAM slots (a grant takes milliseconds, its victims'
# demotion some more): past it, its blocks are copied to a host tensor and vLLM has them back.
DIRECT_GRANT_S = 1.0


class StorePipeline:
    def __init__(self, settings: ConnectorSettings, namespaces: Callable[[], Namespaces],
                 paged: PagedLayout, counters: Counters, drops_end: bool = False,
                 rank: int = 0) -> None:
        self.settings = settings
        # A rank of a tensor-parallel engine says a dropped save ended (nothing stored): the
        # scheduler joins each save's ends from every rank that stores (``RankReports``).
        self.drops_end = drops_end
        self.rank = rank
        self._namespaces = namespaces  # the worker's, looked up at each store
        self.layout = namespaces().layout
        self.counters = counters
        self.gatherer = Gatherer(self.layout, paged, settings.staging_bytes, self._gathered)
        self._storer = ThreadPoolExecutor(1, thread_name_prefix="cmx-store")
        self._lock = threading.Lock()  # guards what follows
        self._pending = 0  # stores handed to the store thread and not finished
        self._ended: list[StoreResult] = []  # stores finished since the last take
        self._handed: dict[str, int] = {}  # req_id -> tokens handed since the last take
        self._dropped: dict[str, int] = {}  # req_id -> tokens dropped since the last take

    def direct(self, on: bool) -> None:
        """Host caches: the gather thread copies each save straight into DRAM slots."""
        self.gatherer.direct = self._save_direct if on else None

    def hand(self, saves: list[tuple[SaveSpec, Any]], complete: bool) -> None:
        """Sync saves: each (save, its host KV, None if not copied) to the store thread;
        none if ``complete`` is False (a layer was not copied)."""
        for save, kv in saves:
            tokens = save.end - save.start
            with self._lock:
                take = complete and kv is not None and \
                    self._pending < self.settings.max_pending_stores
                if take:
                    self._pending += 1
            if not take:
                self._drop(save, tokens, "")
                continue
            self._storer.submit(self._store, save, kv)
            _add(self._handed, save.req_id, tokens)

    def queue(self, saves: list[SaveSpec], caches: list[Any]) -> None:
        """Async saves: each queued for its copy after the step, or dropped."""
        for save in saves:
            tokens = save.end - save.start
            with self._lock:
                room = self._pending < self.settings.max_pending_stores
                if room:
                    self._pending += 1
            if room and not self.gatherer.queue(save, caches):
                with self._lock:
                    self._pending -= 1
                room = False
            if not room:
                self._drop(save, tokens, f", {self.gatherer.used_bytes} bytes staged")
                continue
            _add(self._handed, save.req_id, tokens)

    @property
    def pending(self) -> int:
        """Stores handed over (or queued for their copy) and not yet ended."""
        with self._lock:
            return self._pending

    def take(self) -> tuple[dict[str, int], dict[str, int], list[StoreResult]]:
        """(tokens handed, tokens dropped, stores ended) since the last take."""
        with self._lock:
            out = self._handed, self._dropped, self._ended
            self._handed, self._dropped, self._ended = {}, {}, []
        return out

    def shutdown(self) -> None:
        self.gatherer.shutdown()
        self._storer.shutdown(wait=True)

    def _drop(self, save: SaveSpec, tokens: int, staged: str) -> None:
        log.warning("store of %d tokens dropped: %d stores in flight%s", tokens,
                    self._pending, staged)
        with self._lock:
            _add(self._dropped, save.req_id, tokens)
            if self.drops_end:  # handed nothing: ends nothing the scheduler counts as handed
                self._ended.append(StoreResult(save.req_id, 0, 0, 0, save.start, self.rank))
        self.counters.add(store_dropped_tokens=tokens)

    # -- on the gather thread ------------------------------------------------------------------

    def _gathered(self, save: SaveSpec, kv: Any) -> None:
        """The copy of ``save`` is done (None: it was cancelled)."""
        nbytes = len(save.block_ids) * self.layout.block_bytes
        if kv is None:
            tokens = save.end - save.start
            self.counters.add(store_failed_tokens=tokens)
            self._ended_one(StoreResult(save.req_id, tokens, 0, tokens, save.start))
            self.gatherer.release(nbytes)
            return
        self._storer.submit(self._store_staged, save, kv, None, None)

    def _save_direct(self, save: SaveSpec, source: PagedSource) -> bool:
        """The save's blocks copied from the paged cache into DRAM slots now (vLLM may reuse
        them once this returns); the commit waited for on the store thread. False if the
        service did not grant slots within ``DIRECT_GRANT_S``: the caller copies the blocks
        into a host tensor instead, so vLLM's blocks never wait on a slow service. A copy
        that fails or is cancelled is counted as the store's failure."""
        handle, error = None, None
        try:
            handle = self._namespaces().get(save.salt).store(
                list(save.token_ids), source, start=save.start, grant_timeout_s=DIRECT_GRANT_S)
        except UnavailableError as exc:
            log.info("no DRAM slots within %.1f s for a save (%s): copied to a host tensor",
                     DIRECT_GRANT_S, exc)
            return False
        except Exception as exc:  # noqa: BLE001 - counted as the store's failure
            error = exc

        self._storer.submit(self._store_staged, save, None, handle, error)
        return True

    # -- on the store thread -------------------------------------------------------------------

    def _store_staged(self, save: SaveSpec, kv: Any, handle: Any,
                      error: Exception | None) -> None:
        """``_store`` of a save the gatherer handed over; its staging bytes go back after."""
        try:
            self._store(save, kv, handle, error)
        finally:
            self.gatherer.release(len(save.block_ids) * self.layout.block_bytes)

    def _store(self, save: SaveSpec, kv: Any, handle: Any = None,
               error: Exception | None = None) -> None:
        """Store (unless ``handle`` says it was started, or ``error`` that it failed), wait
        (bounded) for the commit, and say how it ended."""
        T, tokens = self.layout.block_tokens, save.end - save.start
        committed = failed = 0
        try:
            if error is not None:
                raise error
            if handle is None:
                ns = self._namespaces().get(save.salt)
                handle = ns.store(list(save.token_ids), kv, start=save.start)
            committed = handle.wait() * T
            failed = len(handle.refused) * T
            if failed:
                log.warning("store of %d tokens: the service refused %d", tokens, failed)
        except Exception as exc:  # noqa: BLE001 - a lost store is a later miss, never an error
            log.warning("store of %d tokens failed: %s", tokens, exc)
            committed, failed = 0, tokens  # what it may have committed before is not known
        finally:
            self.counters.add(stored_tokens=committed, store_failed_tokens=failed)
            self._ended_one(StoreResult(save.req_id, tokens, committed, failed, save.start))

    def _ended_one(self, result: StoreResult) -> None:
        result = dataclasses.replace(result, rank=self.rank)
        with self._lock:
            self._pending -= 1
            self._ended.append(result)


def _add(figures: dict[str, int], req_id: str, tokens: int) -> None:
    figures[req_id] = figures.get(req_id, 0) + tokens
