"""Asynchronous loads of ``CMXConnector`` (``load_mode`` "async"): a request's blocks land on a
bounded pool of threads while vLLM keeps the request in WAITING_FOR_REMOTE_KVS and runs others.

Per load, in vLLM's call order:

1. ``submit`` (``start_load_kv``): the load runs on the pool: with host caches, ``direct``
   looks the prefix up afresh and copies each block from the service's shared memory straight
   into the paged cache, checked as it lands, every write through the job's gate
   (``paged.PagedSink``); otherwise ``fetch`` brings it to a host tensor and ``write`` puts it
   into the paged cache one layer at a time, each layer under the job's lock (a layer's write
   returns once its bytes are in the cache: ``paged.scatter_layer``). A load cut before a
   thread took it fetches nothing.
2. ``poll`` (``get_finished``, every step): each load that ended, or was cancelled, is returned
   once with the blocks that landed (a prefix of its blocks; none unless every layer was
   written); the worker puts its request in the receiving set and its other blocks in the
   failed set in that same pass, as vLLM requires. A load past ``bound_s`` is cancelled; so is
   one whose request vLLM names finished (an abort): vLLM frees an aborted request's blocks
   only once it is reported, so it is reported at once.
3. ``cancel`` takes the job's lock and closes its gate: once it returns the thread writes
   nothing more, so blocks
   vLLM frees or gives to another request are never written behind its back. A thread stuck in
   a service call holds its pool slot until the call's own timeout; the pool bounds how many.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from cmx.client.copy_out import Sink
from cmx.client.matches import Match
from cmx.connectors.paged import LoadCancelled, WriteGate
from cmx.connectors.settings import Namespaces
from cmx.connectors.shards import cut
from cmx.connectors.vllm_meta import LoadSpec
from cmx.policies.breakeven import source_class

__all__ = ["AsyncLoads", "Ended", "Fetcher", "GroupLoad", "Loaded"]

log = logging.getLogger(__name__)


@dataclass
class Loaded:
    """What a fetch brought to the host for one load."""

    spec: LoadSpec
    kv: Any  # [layers, 2, heads, blocks * T, dim] on the host, or None
    blocks: int  # how many of spec's blocks arrived (a prefix)
    sources: tuple[str, ...] = ()  # source class of each block asked for, where it was found


@dataclass
class GroupLoad:
    """One sync load fetched in groups of layers (``NamespaceClient.load_layers``): each
    ``next`` is the next group's ``Loaded`` (its ``kv`` holds that group's layers), ``finish``
    the load's end, its ``blocks`` the prefix every group brought whole and verified. A load
    that fails brings nothing more, and nothing at its end."""

    spec: LoadSpec
    sources: tuple[str, ...] = ()
    load: Any = None  # a LayerLoad; None: nothing to load, or it failed

    def next(self, layers: range) -> Loaded:
        if self.load is not None:
            try:
                return Loaded(self.spec, self.load.group(layers), self.load.blocks, self.sources)
            except Exception as exc:  # noqa: BLE001 - a failed load is recomputed, never fatal
                self._fail(exc)
        return Loaded(self.spec, None, 0, self.sources)

    def finish(self) -> Loaded:
        blocks = 0
        if self.load is not None:
            try:
                blocks = self.load.finish()
            except Exception as exc:  # noqa: BLE001
                self._fail(exc)
        return Loaded(self.spec, None, blocks, self.sources)

    def _fail(self, exc: Exception) -> None:
        log.warning("load of %d tokens failed: %s", self.spec.end - self.spec.start, exc)
        load, self.load = self.load, None
        try:
            load.close()
        except Exception as err:  # noqa: BLE001 - its pins expire with their lease
            log.debug("pins of a failed load not let go: %s", err)


class Fetcher:
    """A load's blocks from the service, looked up again first: the prefix may have changed
    since the scheduler's lookup. A load that fails is recomputed, never fatal."""

    def __init__(self, namespaces: Namespaces) -> None:
        self.namespaces = namespaces
        self.block_tokens = namespaces.layout.block_tokens

    def fetch(self, spec: LoadSpec) -> Loaded:
        """The whole prefix at once."""
        try:
            match, sources = self.match(spec)
            if not match.blocks:
                return Loaded(spec, None, 0)
            kv = self.namespaces.get(spec.salt).load(spec.token_ids, match)
            return Loaded(spec, kv.contiguous(), kv.shape[3] // self.block_tokens, sources)
        except Exception as exc:  # noqa: BLE001 - a failed load is recomputed, never fatal
            log.warning("load of %d tokens failed: %s", spec.end - spec.start, exc)
            return Loaded(spec, None, 0)

    def fetch_to(self, spec: LoadSpec, sink: Sink) -> Loaded:
        """The whole prefix straight into ``sink`` (the engine's paged cache), each block
        checked as it lands; ``kv`` is None, ``blocks`` the prefix that landed whole."""
        try:
            match, sources = self.match(spec)
            if not match.blocks:
                return Loaded(spec, None, 0)
            blocks = self.namespaces.get(spec.salt).load_to(sink, spec.token_ids, match)
            return Loaded(spec, None, blocks, sources)
        except LoadCancelled:
            return Loaded(spec, None, 0)
        except Exception as exc:  # noqa: BLE001 - a failed load is recomputed, never fatal
            log.warning("load of %d tokens failed: %s", spec.end - spec.start, exc)
            return Loaded(spec, None, 0)

    def in_groups(self, spec: LoadSpec) -> GroupLoad:
        """The prefix one group of layers at a time (``GroupLoad.next``)."""
        try:
            match, sources = self.match(spec)
            if not match.blocks:
                return GroupLoad(spec)
            ns = self.namespaces.get(spec.salt)
            return GroupLoad(spec, sources, ns.load_layers(spec.token_ids, match))
        except Exception as exc:  # noqa: BLE001 - a failed load is recomputed, never fatal
            log.warning("load of %d tokens failed: %s", spec.end - spec.start, exc)
            return GroupLoad(spec)

    def match(self, spec: LoadSpec) -> tuple[Match, tuple[str, ...]]:
        """The blocks of ``spec``'s range the service holds now, and the source class of each."""
        T = self.block_tokens
        match = self.namespaces.get(spec.salt).lookup(spec.token_ids, here_first=True)
        match = cut(match, spec.start // T, spec.end // T)
        here = self.namespaces.node_id
        sources = tuple(source_class(b.tier.value, b.node, here) for b in match.blocks)
        return match, sources


@dataclass(frozen=True)
class Ended:
    """A load that is over: ``blocks`` of its spec's blocks (a prefix) are in the paged cache."""

    spec: LoadSpec
    blocks: int
    sources: tuple[str, ...]
    seconds: float
    why: str  # "" when it ran to its end; else why it was cut short


@dataclass
class _Job:
    spec: LoadSpec
    started: float
    lock: threading.Lock = field(default_factory=threading.Lock)
    cancelled: str = ""  # why, set under lock: the thread writes no layer after it
    written: bool = False  # every layer landed, set under lock
    future: Future[Loaded] | None = None
    gate: WriteGate = field(default_factory=WriteGate)  # a direct load's writes pass it


class AsyncLoads:
    def __init__(self, fetch: Callable[[LoadSpec], Loaded],
                 write: Callable[[int, list[Loaded]], None], layers: int, bound_s: float,
                 threads: int, clock: Callable[[], float] = time.monotonic,
                 direct: Callable[[LoadSpec, WriteGate], Loaded] | None = None) -> None:
        self._fetch = fetch
        self._write = write
        self.direct = direct  # loads straight into the paged cache (host caches), if set
        self._layers = layers
        self._bound_s = bound_s
        self._clock = clock
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="cmx-aload")
        self._jobs: dict[str, _Job] = {}  # req_id -> its running load; touched by vLLM's thread

    def submit(self, spec: LoadSpec) -> None:
        if spec.req_id in self._jobs:  # vLLM asks once per wait: a second is a stale spec
            log.warning("a load for request %s is already running", spec.req_id)
            return
        job = self._jobs[spec.req_id] = _Job(spec, self._clock())
        job.future = self._pool.submit(self._run, job)

    def poll(self, finished: Iterable[str] = ()) -> list[Ended]:
        """Loads that are over, each returned once; ``finished`` requests' loads are cut."""
        for req_id in finished:
            job = self._jobs.get(req_id)
            if job is not None:
                self._cancel(job, "its request finished")
        now = self._clock()
        ended = []
        for req_id, job in list(self._jobs.items()):
            assert job.future is not None
            if not job.future.done() and not job.cancelled:
                if now - job.started <= self._bound_s:
                    continue
                self._cancel(job, f"not done in {self._bound_s:g}s")
            ended.append(self._end(job, now))
            del self._jobs[req_id]
        return ended

    @property
    def running(self) -> int:
        """Loads submitted and not yet returned by ``poll``."""
        return len(self._jobs)

    def shutdown(self) -> None:
        for job in self._jobs.values():
            self._cancel(job, "shutdown")
        self._jobs.clear()
        self._pool.shutdown(wait=False, cancel_futures=True)

    # -- on the pool ---------------------------------------------------------------------------

    def _run(self, job: _Job) -> Loaded:
        with job.lock:
            if job.cancelled:  # cut while it waited for a thread: nothing is fetched for it
                return Loaded(job.spec, None, 0)
        if self.direct is not None:  # written as fetched, through the job's gate
            loaded = self.direct(job.spec, job.gate)
            with job.lock:
                job.written = not job.cancelled
            return loaded
        loaded = self._fetch(job.spec)
        if loaded.blocks:
            for layer in range(self._layers):
                with job.lock:
                    if job.cancelled:
                        return loaded
                    self._write(layer, [loaded])
        with job.lock:
            job.written = not job.cancelled
        return loaded

    # -- on vLLM's thread ----------------------------------------------------------------------

    def _cancel(self, job: _Job, why: str) -> None:
        with job.lock:  # waits out a layer being written: none is written after this
            if job.cancelled or job.written:
                return
            job.cancelled = why
        job.gate.close()  # waits out a direct load's block being written, and stops the rest

    def _end(self, job: _Job, now: float) -> Ended:
        assert job.future is not None
        with job.lock:
            written, why = job.written, job.cancelled
        loaded: Loaded | None = None
        if written:
            loaded = job.future.result()  # done: ``written`` is set last
        elif job.future.done() and not why:
            try:
                loaded = job.future.result()
            except Exception as exc:  # noqa: BLE001 - a failed load is recomputed, never fatal
                why = f"{type(exc).__name__}: {exc}"
        if why:
            log.warning("load of request %s cut short (%s); vLLM recomputes its blocks",
                        job.spec.req_id, why)
        blocks = loaded.blocks if loaded is not None and written else 0
        sources = loaded.sources if loaded is not None else ()
        return Ended(job.spec, blocks, sources, now - job.started, why)
