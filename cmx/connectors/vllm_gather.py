"""Saves off the forward pass (``save_mode`` "async"): the blocks a step completed are copied
out of the paged cache after the step, on a thread, into host staging bounded in bytes.

Per save, in vLLM's call order:

1. ``queue`` (``wait_for_save``, as the forward ends): the save reserves its bytes of the
   staging budget, or is refused (the caller drops it and counts it; the step never waits for
   room), and is queued; the step returns at once.
2. The gather thread copies the save's blocks of every layer into a host tensor and hands it
   to ``hand`` (the store); ``release`` gives its bytes back when that store has ended. With
   host caches and ``direct`` set, the gather thread instead hands ``direct`` a
   ``paged.PagedSource``: the store copies each block from the paged cache straight into its
   DRAM slot there and then (one copy), its commit waited for elsewhere; every read passes
   the copy's gate.
3. vLLM must not reuse the blocks before their copy. It lets a connector keep a finished
   request's blocks: ``request_finished`` returns True and vLLM frees them once the worker
   names the request in ``get_finished``'s sending set, which it does when ``idle`` says no
   copy of the request is queued. A preemption frees the blocks at once, with no such hook, but
   vLLM calls ``handle_preemptions`` before the step that may reuse them: ``flush`` waits there
   for the preempted requests' copies; one not done within the bound is cancelled (under its
   lock, and its gate closed, so none is mid-copy after ``flush`` returns) and handed on as
   None.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from cmx.connectors.paged import PagedLayout, PagedSource, WriteGate, gather_layer
from cmx.connectors.vllm_meta import SaveSpec
from cmx.layout import KVLayout

__all__ = ["Gatherer"]

log = logging.getLogger(__name__)


@dataclass
class _Copy:
    save: SaveSpec
    nbytes: int
    ready: Any  # an event the forward's stream recorded (CUDA), or None
    lock: threading.Lock = field(default_factory=threading.Lock)
    over: threading.Event = field(default_factory=threading.Event)  # copied or cancelled
    cancelled: bool = False  # set under lock before the copy starts: it never reads
    gate: WriteGate = field(default_factory=WriteGate)  # a direct copy's reads pass it


class Gatherer:
    def __init__(self, layout: KVLayout, paged: PagedLayout, budget_bytes: int,
                 hand: Callable[[SaveSpec, Any], None]) -> None:
        self.layout = layout
        self.paged = paged
        self.budget_bytes = budget_bytes
        self._hand = hand  # called with (save, host KV), or (save, None) for a cancelled copy
        self._lock = threading.Lock()  # guards _used and _queued
        self._used = 0  # bytes reserved: queued, copied, or in a store not ended
        self._queued: dict[str, list[_Copy]] = {}  # req_id -> its copies not over
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="cmx-gather")
        # Host caches: (save, source) copied straight into the service on the gather thread.
        self.direct: Callable[[SaveSpec, PagedSource], bool] | None = None

    def queue(self, save: SaveSpec, caches: list[Any]) -> bool:
        """Queue the copy of ``save``'s blocks; False (nothing queued) if the budget is full.

        A save larger than the whole budget is taken when nothing else is staged (one step of
        a long prompt would otherwise never be stored): staging then holds at most the larger
        of the budget and one step's blocks."""
        nbytes = len(save.block_ids) * self.layout.block_bytes
        with self._lock:
            if self._used and self._used + nbytes > self.budget_bytes:
                return False
            self._used += nbytes
            copy = _Copy(save, nbytes, _stream_event(caches))
            self._queued.setdefault(save.req_id, []).append(copy)
        self._pool.submit(self._copy, copy, caches)
        return True

    def release(self, nbytes: int) -> None:
        """A copy's bytes are free again: its store has ended."""
        with self._lock:
            self._used -= nbytes

    def idle(self, req_ids: Iterable[str]) -> set[str]:
        """Those of ``req_ids`` with no copy queued or running: their blocks may be reused."""
        with self._lock:
            return {r for r in req_ids if r not in self._queued}

    def flush(self, req_ids: Iterable[str], bound_s: float) -> None:
        """Once this returns, no copy of ``req_ids`` reads the paged cache any more."""
        with self._lock:
            copies = [c for r in req_ids for c in self._queued.get(r, ())]
        for copy in copies:
            if copy.over.wait(bound_s):
                continue
            with copy.lock:
                if not copy.over.is_set():
                    copy.cancelled = True
            copy.gate.close()  # a direct copy's block being read lands; no read after it
            log.warning("copy of %d tokens of request %s cancelled: its blocks are reused",
                        copy.save.end - copy.save.start, copy.save.req_id)

    @property
    def used_bytes(self) -> int:
        with self._lock:
            return self._used

    def shutdown(self) -> None:
        self._pool.shutdown(wait=True)

    # -- on the gather thread ------------------------------------------------------------------

    def _copy(self, copy: _Copy, caches: list[Any]) -> None:
        if self.direct is not None:
            self._copy_direct(self.direct, copy, caches)
            return
        kv = None
        try:
            if copy.ready is not None:
                copy.ready.synchronize()  # the forward that wrote the blocks is done
            with copy.lock:
                if not copy.cancelled:
                    kv = self._gather(copy.save, caches)
                copy.over.set()
        except Exception as exc:  # noqa: BLE001 - a lost copy is a later miss, never an error
            log.warning("copy of request %s's blocks failed: %s", copy.save.req_id, exc)
            kv = None
        finally:
            self._over(copy)
        self._hand(copy.save, kv)

    def _copy_direct(self, direct: Callable[[SaveSpec, PagedSource], bool], copy: _Copy,
                     caches: list[Any]) -> None:
        """The save's blocks straight from the paged cache into the service, through the
        copy's gate; not under the copy's lock (it waits on the service), so ``flush``
        cancels it by closing the gate. A service that grants no slots in time (``direct``
        says False) gets the save through a host tensor, as from a GPU cache."""
        kv, handed = None, False
        try:
            if copy.ready is not None:
                copy.ready.synchronize()
            with copy.lock:
                go = not copy.cancelled
            if go:
                handed = direct(copy.save, PagedSource(caches, self.paged, self.layout,
                                                       copy.save.block_ids, copy.gate))
                if not handed:
                    with copy.lock:
                        if not copy.cancelled:
                            kv = self._gather(copy.save, caches)
        except Exception as exc:  # noqa: BLE001 - a lost copy is a later miss, never an error
            log.warning("copy of request %s's blocks failed: %s", copy.save.req_id, exc)
            kv = None
        finally:
            self._over(copy)
        if not handed:
            self._hand(copy.save, kv)

    def _over(self, copy: _Copy) -> None:
        copy.over.set()
        with self._lock:
            left = [c for c in self._queued.get(copy.save.req_id, ()) if c is not copy]
            if left:
                self._queued[copy.save.req_id] = left
            else:
                self._queued.pop(copy.save.req_id, None)

    def _gather(self, save: SaveSpec, caches: list[Any]) -> Any:
        import torch

        kv = torch.empty(self.layout.shape(save.end - save.start), dtype=caches[0].dtype,
                         device="cpu")
        for layer, cache in enumerate(caches):
            gather_layer(cache, self.paged, save.block_ids, kv[layer])
        return kv


def _stream_event(caches: list[Any]) -> Any:
    """An event after the work queued so far on the current CUDA stream; None on the CPU."""
    if not caches or not getattr(caches[0], "is_cuda", False):
        return None
    import torch

    event = torch.cuda.Event()
    event.record()
    return event
