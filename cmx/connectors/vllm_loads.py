"""Asynchronous loads of ``CMXConnector`` (``load_mode`` "async"): a request's blocks land on a
bounded pool of threads while vLLM keeps the request in WAITING_FOR_REMOTE_KVS and runs others.

Per load, in vLLM's call order:

1. ``submit`` (``start_load_kv``): the load runs on the pool: ``fetch`` looks the prefix up
   afresh and brings what is still there to the host, then ``write`` puts it into the paged
   cache one layer at a time, each layer under the job's lock (a layer's write returns once
   its bytes are in the cache: ``paged.scatter_layer``). A load cut before a thread took it
   fetches nothing.
2. ``poll`` (``get_finished``, every step): each load that ended, or was cancelled, is returned
   once with the blocks that landed (a prefix of its blocks; none unless every layer was
   written); the worker puts its request in the receiving set and its other blocks in the
   failed set in that same pass, as vLLM requires. A load past ``bound_s`` is cancelled; so is
   one whose request vLLM names finished (an abort): vLLM frees an aborted request's blocks
   only once it is reported, so it is reported at once.
3. ``cancel`` takes the job's lock: once it returns the thread writes nothing more, so blocks
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

from cmx.connectors.vllm_meta import LoadSpec

__all__ = ["AsyncLoads", "Ended", "Loaded"]

log = logging.getLogger(__name__)


@dataclass
class Loaded:
    """What a fetch brought to the host for one load."""

    spec: LoadSpec
    kv: Any  # [layers, 2, heads, blocks * T, dim] on the host, or None
    blocks: int  # how many of spec's blocks arrived (a prefix)
    sources: tuple[str, ...] = ()  # source class of each block asked for, where it was found


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


class AsyncLoads:
    def __init__(self, fetch: Callable[[LoadSpec], Loaded],
                 write: Callable[[int, list[Loaded]], None], layers: int, bound_s: float,
                 threads: int, clock: Callable[[], float] = time.monotonic) -> None:
        self._fetch = fetch
        self._write = write
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
            if not job.cancelled and not job.written:
                job.cancelled = why

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
