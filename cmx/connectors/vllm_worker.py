"""The worker side of ``CMXConnector``: moves blocks between vLLM's paged cache and the service.

One step, in vLLM's call order:

1. ``begin_step`` (``bind_connector_metadata``): the step's loads and saves.
2. ``start_load`` (``start_load_kv``, before the forward): a loader thread looks the prefix up
   afresh (``vllm_loads.Fetcher``) and loads what is still there in ``load_layer_groups``
   groups of layers (``cmx.client.layer_loads``), writing each group into the paged cache as
   it arrives, marking each layer ready.
3. ``wait_layer`` (``wait_for_layer_load``, at each attention layer): waits for that layer
   only, so attention over the first layers runs while the last are being written. Past the
   load bound the step's loads are cancelled (the loader writes nothing more) and failed.
4. ``save_layer`` (``save_kv_layer``, after each attention layer): copies the blocks completed
   this step out of the paged cache, one indexed copy per layer.
5. ``end_step`` (``wait_for_save``): waits for the loader (bounded), hands the copied blocks to
   a store thread and returns: the engine never waits for a store.

Every hook above runs in the Python between the model's layers, so with CUDA graphs vLLM must
capture piecewise graphs (``CMXConnector.requires_piecewise_for_cudagraph``): a full graph
replays the layers without them, and attention would read blocks before they land.

A store counts as stored only for the blocks the service committed: the store thread reports
how each store ended (``StoreResult``) in a later step's report, and what was refused, raised
or timed out is counted as failed, never as stored.

Blocks that were promised but not loaded (the prefix vanished between lookup and load, the
service failed or was late) are returned by ``take_failed``; vLLM recomputes them. Blocks
written by the loader are the only cache contents this side ever changes.

With ``load_mode`` "async" the step's ``async_loads`` are for requests vLLM does not run
meanwhile: ``start_load`` hands them to ``AsyncLoads`` (``vllm_loads``) and ``finished``
(``get_finished``) reports each one over in the receiving set. With ``save_mode`` "async"
``save_layer`` copies nothing: ``end_step`` queues the saves to a ``Gatherer``
(``vllm_gather``), which copies them after the step; ``finished`` names in the sending set the
finished requests whose blocks vLLM kept for it once their copies are done, and ``preempted``
(``handle_preemptions``) waits for a preempted request's copies before its blocks are reused.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from cmx.client.layer_loads import layer_groups
from cmx.connectors.paged import (
    PagedLayout,
    PagedSink,
    WriteGate,
    block_view,
    gather_layer,
    scatter_layer,
)
from cmx.connectors.settings import ConnectorSettings, Namespaces
from cmx.connectors.shards import HeadPlan
from cmx.connectors.vllm_loads import AsyncLoads, Fetcher, Loaded
from cmx.connectors.vllm_meta import (
    CMXStepMetadata,
    CMXWorkerReport,
    LoadResult,
    LoadSpec,
)
from cmx.connectors.vllm_stats import CMXConnectorStats, Counters
from cmx.connectors.vllm_stores import StorePipeline
from cmx.errors import LayoutMismatchError

__all__ = ["WorkerSide"]

log = logging.getLogger(__name__)


@dataclass
class _Step:
    meta: CMXStepMetadata
    layers: int
    started: float = field(default_factory=time.monotonic)
    ready: list[threading.Event] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)
    cancelled: bool = False  # set under lock: the loader writes no layer after it
    gate: WriteGate = field(default_factory=WriteGate)  # direct writes pass it; closed at cancel
    loader: Future[list[Loaded]] | None = None
    async_started: bool = False
    staged: dict[int, Any] = field(default_factory=dict)  # save index -> host KV
    layers_saved: int = 0

    def __post_init__(self) -> None:
        self.ready = [threading.Event() for _ in range(self.layers)]


class WorkerSide:
    def __init__(self, settings: ConnectorSettings, namespaces: Namespaces,
                 layer_names: list[str], paged_layout: PagedLayout,
                 plan: HeadPlan | None = None) -> None:
        self.settings = settings
        self.plan = plan or HeadPlan.everything(namespaces.layout.num_kv_heads)
        self.fetcher = Fetcher(namespaces)  # holds the namespaces: see ``namespaces``
        self.layout = namespaces.layout
        self.index = {name: i for i, name in enumerate(layer_names)}
        self.paged = paged_layout
        self.caches: list[Any] = []
        self._step: _Step | None = None
        self._failed: set[int] = set()
        self._report = CMXWorkerReport()
        self._loader = ThreadPoolExecutor(1, thread_name_prefix="cmx-load")
        self.counters = Counters()
        self.loads = AsyncLoads(self.fetcher.fetch, self._write_layer, len(layer_names),
                                settings.load_bound_s, settings.load_threads)
        self.stores = StorePipeline(settings, lambda: self.namespaces, paged_layout,
                                    self.counters, drops_end=not self.plan.whole,
                                    rank=self.plan.rank)
        self._held: set[str] = set()  # finished requests whose blocks vLLM keeps for us

    @property
    def namespaces(self) -> Namespaces:
        """The namespaces of every load and store (one object, the fetcher's: replaced here,
        it is replaced for both)."""
        return self.fetcher.namespaces

    @namespaces.setter
    def namespaces(self, namespaces: Namespaces) -> None:
        self.fetcher.namespaces = namespaces

    def register(self, kv_caches: Mapping[str, Any]) -> None:
        """The engine's per-layer caches; each must be the layout's shape."""
        missing = sorted(set(self.index) - set(kv_caches))
        if missing:
            raise LayoutMismatchError(f"no KV cache for layers {missing[:3]}...")
        caches = [kv_caches[name] for name in sorted(self.index, key=self.index.__getitem__)]
        for cache in caches:
            view = block_view(cache, self.paged, self.layout.head_dim)
            if (view.shape[1], view.shape[3]) != (self.layout.num_kv_heads,
                                                  self.layout.block_tokens):
                raise LayoutMismatchError(
                    f"a paged cache of shape {tuple(cache.shape)} does not hold "
                    f"{self.layout.num_kv_heads} heads x {self.layout.block_tokens} tokens")
        self.caches = caches
        # Host caches take each block straight from the service's shared memory, and give
        # each saved block straight to a DRAM slot.
        on_host = all(getattr(c, "device", None) is not None and c.device.type == "cpu"
                      for c in caches)
        self.loads.direct = self._load_direct if on_host else None
        # A rank of a tensor-parallel engine stores each of its heads apart (shards): from a
        # host tensor, gathered after the step.
        self.stores.direct(on_host and self.plan.whole)

    # -- a step --------------------------------------------------------------------------------

    def begin_step(self, meta: CMXStepMetadata) -> None:
        if not self.plan.stores:  # another rank holds these heads too, and stores them
            meta = dataclasses.replace(meta, saves=[])
        self._step = _Step(meta, len(self.caches))
        self._held.update(meta.held)

    def start_load(self) -> None:
        step = self._step
        if step is None:
            return
        if not step.async_started:
            step.async_started = True
            for spec in step.meta.async_loads:
                self.loads.submit(spec)
        if step.meta.loads and step.loader is None:
            step.loader = self._loader.submit(self._load, step)

    def wait_layer(self, layer_name: str) -> None:
        step = self._step
        if step is None or step.loader is None:
            return
        remaining = step.started + self.settings.load_bound_s - time.monotonic()
        if not step.ready[self.index[layer_name]].wait(max(0.0, remaining)):
            self._cancel(step, "late")

    def save_layer(self, layer_name: str, kv_layer: Any) -> None:
        step = self._step
        if step is None or not step.meta.saves or self.settings.async_saves:
            return
        import torch

        layer = self.index[layer_name]
        for i, save in enumerate(step.meta.saves):
            kv = step.staged.get(i)
            if kv is None:
                kv = step.staged[i] = torch.empty(self.layout.shape(save.end - save.start),
                                                  dtype=kv_layer.dtype)
            gather_layer(kv_layer, self.paged, save.block_ids, kv[layer])
        step.layers_saved += 1

    def end_step(self) -> None:
        step, self._step = self._step, None
        if step is None:
            return
        if step.loader is not None:
            remaining = step.started + self.settings.load_bound_s - time.monotonic()
            try:
                loaded = step.loader.result(timeout=max(0.0, remaining))
            except Exception as exc:  # noqa: BLE001 - a late or failed load: recompute
                self._cancel(step, f"{type(exc).__name__}: {exc}")
                loaded = []
            self._report_loads(step, loaded)
        if step.meta.saves and self.settings.async_saves:
            self.stores.queue(step.meta.saves, self.caches)
        elif step.meta.saves:
            self.stores.hand([(save, step.staged.get(i)) for i, save in
                              enumerate(step.meta.saves)],
                             complete=step.layers_saved == len(self.caches))
        self._report.step_s = time.monotonic() - step.started
        self._report.computed = list(step.meta.computed)

    def finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """``get_finished``: requests whose kept blocks vLLM may free now (sending), and
        requests whose asynchronous loads are over (receiving), their failed blocks already in
        ``take_failed``."""
        sending = self.stores.gatherer.idle(self._held)
        self._held -= sending
        receiving = set()
        for ended in self.loads.poll(finished_req_ids):
            self._account_load(ended.spec, ended.blocks, ended.sources, ended.seconds)
            receiving.add(ended.spec.req_id)
        return sending or None, receiving or None

    def preempted(self, meta: CMXStepMetadata) -> None:
        """``handle_preemptions``: vLLM freed these requests' blocks; no copy reads them now."""
        if meta.preempted:
            self.stores.gatherer.flush(meta.preempted, self.settings.load_bound_s)

    def take_failed(self) -> set[int]:
        failed, self._failed = self._failed, set()
        return failed

    def take_report(self) -> CMXWorkerReport | None:
        report, self._report = self._report, CMXWorkerReport()
        report.handed, report.dropped, report.stores = self.stores.take()
        if not (report.loads or report.handed or report.stores or report.dropped
                or report.computed):
            return None
        return report

    def take_stats(self) -> CMXConnectorStats | None:
        stats = self.counters.take()
        # vLLM sums its workers' counters: ranks load and store the same blocks, so one
        # rank's stand for the engine's.
        return stats if self.plan.rank == 0 else None

    def shutdown(self) -> None:
        self.loads.shutdown()
        self._loader.shutdown(wait=True, cancel_futures=True)
        self.stores.shutdown()

    # -- loads ---------------------------------------------------------------------------------

    def _load(self, step: _Step) -> list[Loaded]:
        """On the loader thread: fetch the step's loads and write them layer by layer, one
        group of layers at a time (``load_layer_groups``; one group: the whole prefix first)."""
        try:
            groups = layer_groups(len(self.caches), self.settings.load_layer_groups)
            if len(groups) == 1 and self.loads.direct is not None:
                return [self.loads.direct(spec, step.gate) for spec in step.meta.loads]
            if len(groups) == 1:
                loaded = [self.fetcher.fetch(spec) for spec in step.meta.loads]
                self._write_group(step, groups[0], loaded)
                return loaded
            loads = [self.fetcher.in_groups(spec) for spec in step.meta.loads]
            try:
                for layers in groups:
                    if not self._write_group(step, layers, [g.next(layers) for g in loads]):
                        break
            finally:
                loaded = [g.finish() for g in loads]
            return loaded
        finally:
            for event in step.ready:
                event.set()

    def _load_direct(self, spec: LoadSpec, gate: WriteGate) -> Loaded:
        """One load into the paged cache, each block straight from the service's memory."""
        try:
            sink = PagedSink(self.caches, self.paged, self.layout.head_dim, spec.block_ids, gate)
        except LayoutMismatchError as exc:
            log.warning("load of %d tokens refused: %s", spec.end - spec.start, exc)
            return Loaded(spec, None, 0)
        return self.fetcher.fetch_to(spec, sink)

    def _write_group(self, step: _Step, layers: range, loaded: list[Loaded]) -> bool:
        """Write ``layers`` of every arrived load (each ``kv`` holds those layers), marking each
        layer ready as it lands; False once the step's loads are cancelled."""
        for layer in layers:
            with step.lock:
                if step.cancelled:
                    return False
                self._write_layer(layer, loaded, layers.start)
            step.ready[layer].set()  # its attention may run; later layers still land
        return True

    def _write_layer(self, layer: int, loaded: list[Loaded], first: int = 0) -> None:
        """Write one layer of every arrived load into the engine's paged cache (each load's
        ``kv`` holds the layers from ``first``)."""
        for item in loaded:
            if item.blocks:
                scatter_layer(self.caches[layer], self.paged, item.spec.block_ids[:item.blocks],
                              item.kv[layer - first])

    def _cancel(self, step: _Step, why: str) -> None:
        with step.lock:
            if step.cancelled:
                return
            step.cancelled = True
        step.gate.close()  # a direct load's block being written lands; none after it
        log.warning("loads of this step cancelled (%s); vLLM recomputes their blocks", why)
        for spec in step.meta.loads:
            self._failed.update(spec.block_ids)
        for event in step.ready:
            event.set()

    def _report_loads(self, step: _Step, loaded: list[Loaded]) -> None:
        seconds = time.monotonic() - step.started
        for i, spec in enumerate(step.meta.loads):
            item = loaded[i] if i < len(loaded) else None
            got = 0 if step.cancelled or item is None else item.blocks
            self._account_load(spec, got, item.sources if item else (), seconds)

    def _account_load(self, spec: LoadSpec, got: int, sources: tuple[str, ...],
                      seconds: float) -> None:
        """One load over, ``got`` of its blocks landed: the rest failed, all of it counted."""
        T, nbytes = self.layout.block_tokens, self.layout.block_bytes
        self._failed.update(spec.block_ids[got:])
        found = tuple((c, nbytes) for c in sources[:got])
        self._report.loads.append(LoadResult(spec.req_id, spec.end - spec.start, got * T,
                                             got * nbytes, seconds, found, spec.start,
                                             self.plan.rank))
        self.counters.add(loads=1, loaded_tokens=got * T, load_s=seconds,
                          load_failed_tokens=spec.end - spec.start - got * T)
