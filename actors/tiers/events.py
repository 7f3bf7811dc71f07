"""Publishing a tier's store events to the directory shards.

The publisher numbers events per (source, shard) with no gaps, batches them, and sends each
batch to its shard. A shard that answers NEED_RESYNC gets the tier's full holdings for that
shard instead. ``flush()`` returns once every event so far is applied, or the shard is known
unreachable. A copy the tier stores unlisted (``unlist``: a scan's window staged in HBM, evicted
by the same scan moments later) is never sent, neither its storing nor its removal, unless
it is read beyond its scan (``relist_stored``: then published as stored). A batch
whose call failed fast (a connection reset or refused, as right after a
network link comes back) is sent again at once: one dropped call leaves no stored block unlisted.
A batch refused again stays pending, in order, and goes with the next flush (the next commit's
or the heartbeat's); until then its copies are invisible to lookups, never wrong. A batch whose
call timed out, one past ``KEEP_ENTRIES`` entries kept for its shard, and one a failed resync
replaced are dropped: the gap they leave makes the shard ask for the tier's full holdings once
it answers again.

Shards are reached through ``send(shard, request)`` (``cmx.doors``), so the publisher runs unchanged
against plain DirectoryShard objects in unit tests and against Ray actors in the service.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import AbstractContextManager
from typing import Any

from cmx.actors.directory.shard import ApplyResult, Entry, Source, shard_of
from cmx.doors import Apply, Request, Resync
from cmx.keys import BlockHash
from cmx.storage.base import EventKind, StoreEvent

__all__ = ["KEEP_ENTRIES", "RETRY_WITHIN_S", "EventPublisher"]

KEEP_ENTRIES = 1 << 16  # a shard's undelivered entries kept for its next flush, at most
RETRY_WITHIN_S = 1.0  # a call that failed sooner than this was refused, not timed out: again

Send = Callable[[int, Request[Any]], object]


class EventPublisher:
    def __init__(
        self,
        source: Source,
        epoch: str,
        num_shards: int,
        send: Send,
        holdings: Callable[[], Sequence[Entry]],
        atomic: AbstractContextManager[object],
        tag: Callable[[bytes], str] = lambda key: "",
    ) -> None:
        self.source = source
        self.epoch = epoch
        self.num_shards = num_shards
        self._send = send
        self._holdings = holdings
        self._atomic = atomic  # the store's lock: no event is emitted while it is held
        self._tag = tag  # a stored block's namespace id, where the tier knows it
        self._lock = threading.Lock()  # guards pending and seq
        self._send_lock = threading.Lock()  # one batch in flight per publisher keeps order
        self._pending: list[list[Entry]] = [[] for _ in range(num_shards)]
        self._seq = [0] * num_shards
        self._senders: ThreadPoolExecutor | None = None  # one thread per shard, once needed
        self._behind: ThreadPoolExecutor | None = None  # flush_soon's thread, once needed
        self._closed = False  # after close, batches go from the caller's thread, one by one
        self._unlisted: set[bytes] = set()  # keys stored unlisted, until they go
        self.failures = 0
        self.resyncs = 0

    def unlist(self, key: bytes) -> None:
        """The copy of ``key`` stored next is never published, nor its removal. Called under
        the store's lock, with the commit; ``relist`` if the commit fails."""
        with self._lock:
            self._unlisted.add(key)

    def relist(self, key: bytes) -> None:
        with self._lock:
            self._unlisted.discard(key)

    def relist_stored(self, copies: Iterable[tuple[BlockHash, int, int | None]]) -> int:
        """Publish each of these copies (key, size, checksum) held now that was stored
        unlisted: it is read beyond the scan that staged it. How many were."""
        with self._lock:
            if not self._unlisted:
                return 0
            n = 0
            for key, size, checksum in copies:
                if key in self._unlisted:
                    self._unlisted.discard(key)
                    self._queue(Entry(key, True, size, checksum or 0, self._tag(key)))
                    n += 1
            return n

    def on_event(self, event: StoreEvent) -> None:
        stored = event.kind is EventKind.STORED
        entry = Entry(event.key, stored, event.size, event.checksum or 0,
                      self._tag(event.key) if stored else "")
        with self._lock:
            if event.key not in self._unlisted:
                self._queue(entry)
            elif not stored:  # the unlisted copy went, unpublished as it came
                self._unlisted.discard(event.key)

    def _queue(self, entry: Entry) -> None:
        """Add ``entry`` to its shard's next batch, numbered; under ``_lock``."""
        shard = shard_of(entry.key, self.num_shards)
        self._pending[shard].append(entry)
        self._seq[shard] += 1

    def flush(self, heartbeat: bool = False) -> bool:
        """Send every pending batch, to all shards at once; with ``heartbeat``, empty ones too
        (they carry the sequence number a shard checks for gaps). True if all took them."""
        with self._send_lock:
            with self._lock:
                batches = [(s, self._pending[s], self._seq[s]) for s in range(self.num_shards)
                           if heartbeat or self._pending[s]]
                self._pending = [[] for _ in range(self.num_shards)]
            if len(batches) < 2 or self._closed:
                return all([self._deliver(*batch) for batch in batches])
            if self._senders is None:
                self._senders = ThreadPoolExecutor(self.num_shards,
                                                   thread_name_prefix="cmx-publish")
            return all(list(self._senders.map(lambda batch: self._deliver(*batch), batches)))

    def flush_soon(self) -> None:
        """``flush`` from a background thread; returns at once. Batches keep their order."""
        if self._closed:
            self.flush()
            return
        if self._behind is None:
            self._behind = ThreadPoolExecutor(1, thread_name_prefix="cmx-publish-behind")
        self._behind.submit(self.flush)

    def close(self) -> None:
        """Let the sending threads go (each ends after what it is sending, queued flushes run).
        A tier may still publish after it is closed: then from the caller's thread."""
        self._closed = True
        for pool in (self._senders, self._behind):
            if pool is not None:
                pool.shutdown(wait=False)

    def _deliver(self, shard: int, entries: list[Entry], seq: int) -> bool:
        request = Apply(source=self.source, epoch=self.epoch, seq=seq, entries=entries)
        for last in (False, True):
            started = time.monotonic()
            try:
                result = self._send(shard, request)
                break
            except Exception:  # noqa: BLE001 - again, kept, or left to the heartbeat: below
                fast = time.monotonic() - started < RETRY_WITHIN_S  # refused, not timed out
                if last or not fast:
                    self._keep(shard, entries, fast)
                    return False
        if ApplyResult(result) is ApplyResult.NEED_RESYNC:  # else applied, or a duplicate
            try:
                self._resync(shard)
            except Exception:  # noqa: BLE001 - the holdings replaced the batch: never kept
                self._keep(shard, [], fast=False)
                return False
        return True

    def _keep(self, shard: int, entries: list[Entry], fast: bool) -> None:
        """A batch that did not reach its shard: kept in front of what is pending (its seq
        runs on to them) when its calls were refused fast, so the next flush sends it without
        a resync; dropped when a call timed out (the next flush would wait as long again) or
        past ``KEEP_ENTRIES``: the gap then makes the shard ask for the holdings."""
        with self._lock:
            self.failures += 1
            kept = entries + self._pending[shard]
            if fast and len(kept) <= KEEP_ENTRIES:
                self._pending[shard] = kept

    def _resync(self, shard: int) -> None:
        # Holdings and the cursor are read together under the store's lock (events are emitted
        # under it), so that events after the snapshot continue exactly from its number.
        with self._atomic:
            with self._lock:
                entries = [e for e in self._holdings() if e.key not in self._unlisted
                           and shard_of(e.key, self.num_shards) == shard]
                seq = self._seq[shard]
                self._pending[shard] = []
        self._send(shard, Resync(source=self.source, epoch=self.epoch, seq=seq,
                                 entries=entries))
        with self._lock:
            self.resyncs += 1
