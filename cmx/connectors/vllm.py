"""``CMXConnector``: the context memory as vLLM's KV connector (vLLM 0.29, ``KVConnectorBase_V1``).

The one setting a vLLM user changes, where LMCache's would be::

    kv_transfer_config={
        "kv_connector": "CMXConnector",
        "kv_connector_module_path": "cmx.connectors.vllm",
        "kv_role": "kv_both",                   # kv_producer: store only; kv_consumer: load only
        "kv_load_failure_policy": "recompute",  # a prefix that vanished is recomputed
        "kv_connector_extra_config": {"ray_address": "10.0.0.5:6379"},  # see .settings
    }

vLLM makes one connector on its scheduler and one in each worker; with multiprocessing on they
live in different processes. The scheduler side (``vllm_scheduler``) finds the cached prefix
and plans loads and stores; the worker side (``vllm_worker``) moves the blocks; the step's
metadata and the workers' reports (``vllm_meta``) are all that passes between them. This class
only wires vLLM's hooks to the two, and answers vLLM's questions about the connector as a
whole: it works in the layer-wise hooks (so CUDA graphs must be piecewise), its counters
(``vllm_stats``), and ``reset_cache`` (every namespace the engine used is dropped).

Under tensor parallelism each rank stores and loads its own KV heads, and engines of every
degree share one prefix (``shards``): the scheduler counts a block only when every head of it
is held, and vLLM's join of the ranks' reports counts a load or store once all have ended.

A request's namespace is (model, KV layout, salt): the salt is the connector's ``salt`` with
the request's ``cache_salt``, so tenants with different cache salts never share a block. A
request keeps out of the cache with ``kv_transfer_params={"cmx": {"skip": True}}`` (or only
``"load": False`` / ``"store": False``), given as ``SamplingParams(extra_args={
"kv_transfer_params": ...})`` or in an OpenAI request's body to vLLM's server.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorWorkerMetadata,
)

from cmx.connectors.paged import PagedLayout
from cmx.connectors.settings import (
    ConnectorSettings,
    Namespaces,
    adopt_service_slots,
    connect,
)
from cmx.connectors.shards import HeadPlan
from cmx.connectors.vllm_meta import CMXStepMetadata, CMXWorkerReport
from cmx.connectors.vllm_scheduler import SchedulerSide
from cmx.connectors.vllm_stats import CMXConnectorStats, CMXPromMetrics
from cmx.connectors.vllm_worker import WorkerSide
from cmx.errors import LayoutMismatchError
from cmx.layout import KVLayout

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.distributed.kv_events import KVCacheEvent
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

__all__ = ["CMXConnector", "check_parallel", "engine_layout"]

log = logging.getLogger(__name__)


def engine_layout(kv_cache_config: KVCacheConfig) -> tuple[KVLayout, list[str]]:
    """The KV layout of an engine's cache, and its attention layers in layer order."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MLAAttentionSpec

    groups = kv_cache_config.kv_cache_groups
    spec = groups[0].kv_cache_spec if len(groups) == 1 else None
    if not isinstance(spec, FullAttentionSpec) or isinstance(spec, MLAAttentionSpec):
        raise LayoutMismatchError(
            "CMXConnector supports models with one group of full-attention layers; this one "
            f"has {[type(g.kv_cache_spec).__name__ for g in groups]}")
    layout = KVLayout(num_layers=len(groups[0].layer_names), num_kv_heads=spec.num_kv_heads,
                      head_dim=spec.head_size, dtype=str(spec.dtype).removeprefix("torch."),
                      block_tokens=spec.block_size)
    return layout, list(groups[0].layer_names)


class CMXConnector(KVConnectorBase_V1):
    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        # Sync loads are written into the paged cache in groups of layers, each layer's
        # attention waiting for its own (``wait_for_layer_load``), and sync saves copy each
        # layer out (``save_kv_layer``): hooks a full CUDA graph would replay without, letting
        # attention read blocks before they land. vLLM then captures piecewise graphs, which
        # run the hooks between the pieces.
        return True

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole,
                 kv_cache_config: KVCacheConfig) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        transfer = self._kv_transfer_config
        settings = ConnectorSettings.from_extra(transfer.kv_connector_extra_config)
        layout, layer_names = engine_layout(kv_cache_config)
        if settings.block_tokens and settings.block_tokens != layout.block_tokens:
            raise LayoutMismatchError(f"block_tokens {settings.block_tokens} != the engine's "
                                      f"block_size {layout.block_tokens}")
        check_parallel(vllm_config.parallel_config)
        model_config = vllm_config.model_config
        plan = _head_plan(vllm_config, role, layout.num_kv_heads)
        model = settings.model or _served_name(model_config)
        weights = settings.weights or _fingerprint(model_config.model)
        self._cm = self._connect(settings)
        adopt_service_slots(self._cm)  # the running service's slots, checked by Namespaces
        shared = plan.tp > 1 or settings.share_tp
        namespaces = Namespaces(self._cm, model, layout, weights, plan if shared else None)
        load, save = transfer.is_kv_consumer, transfer.is_kv_producer
        self._scheduler: SchedulerSide | None = None
        self._worker: WorkerSide | None = None
        if role == KVConnectorRole.SCHEDULER:
            if transfer.kv_load_failure_policy != "recompute":
                log.warning("kv_load_failure_policy is %r: a cached prefix that vanishes "
                            "before it is loaded fails its request; set 'recompute' to "
                            "recompute it instead", transfer.kv_load_failure_policy)
            chunk = vllm_config.scheduler_config.max_num_batched_tokens
            self._scheduler = SchedulerSide(settings, namespaces, layout.block_tokens,
                                            load=load, save=save, chunk_tokens=chunk,
                                            ranks=(plan.tp, plan.storing_ranks))
        else:
            self._worker = WorkerSide(settings, namespaces, layer_names,
                                      _paged_layout(settings.paged_layout), plan)

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a cache: a store lost to a preemption is a later miss

    # -- worker side ---------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        self._side_worker().register(kv_caches)

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        if isinstance(connector_metadata, CMXStepMetadata):
            self._side_worker().begin_step(connector_metadata)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        self._side_worker().start_load()

    def wait_for_layer_load(self, layer_name: str) -> None:
        self._side_worker().wait_layer(layer_name)

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any,
                      **kwargs: Any) -> None:
        self._side_worker().save_layer(layer_name, kv_layer)

    def wait_for_save(self) -> None:
        self._side_worker().end_step()

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        if isinstance(kv_connector_metadata, CMXStepMetadata):
            self._side_worker().preempted(kv_connector_metadata)

    def get_finished(self, finished_req_ids: set[str]
                     ) -> tuple[set[str] | None, set[str] | None]:
        return self._side_worker().finished(finished_req_ids)

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._side_worker().take_failed()

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        return self._side_worker().take_report()

    # -- both sides ----------------------------------------------------------------------------

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        side = self._scheduler or self._worker
        return None if side is None else side.take_stats()

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None
                                 ) -> KVConnectorStats | None:
        return CMXConnectorStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(cls, vllm_config: VllmConfig, metric_types: dict[type, type],
                           labelnames: list[str],
                           per_engine_labelvalues: dict[int, list[object]]) -> Any:
        return CMXPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def reset_cache(self) -> bool | None:
        return None if self._scheduler is None else self._scheduler.reset()

    def take_events(self) -> Iterable[KVCacheEvent]:
        return () if self._scheduler is None else self._scheduler.events.take()

    # -- scheduler side ------------------------------------------------------------------------

    def on_new_request(self, request: Request) -> None:
        self._side_scheduler().track(request.request_id, request.prompt_token_ids,
                                     request.cache_salt, request.kv_transfer_params,
                                     request.block_hashes)

    def get_num_new_matched_tokens(self, request: Request,
                                   num_computed_tokens: int) -> tuple[int | None, bool]:
        side = self._side_scheduler()
        side.track(request.request_id, request.prompt_token_ids, request.cache_salt,
                   request.kv_transfer_params, request.block_hashes)
        tokens = side.matched_tokens(request.request_id, num_computed_tokens)
        return tokens, bool(tokens) and side.settings.async_loads

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks,
                                 num_external_tokens: int) -> None:
        side = self._side_scheduler()
        ids = blocks.get_block_ids()[0] if num_external_tokens > 0 else ()
        side.after_alloc(request.request_id, num_external_tokens, ids)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        return self._side_scheduler().build_step(
            scheduler_output.scheduled_new_reqs, scheduler_output.scheduled_cached_reqs,
            scheduler_output.num_scheduled_tokens, scheduler_output.finished_req_ids,
            scheduler_output.preempted_req_ids or ())

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        report = connector_output.kv_connector_worker_meta
        side = self._side_scheduler()
        if isinstance(report, CMXWorkerReport):
            side.take_report(report)
        side.loads_over(connector_output.finished_recving or ())

    def request_finished(self, request: Request,
                         block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        side = self._side_scheduler()
        hold = side.hold_blocks(request.request_id)  # before ``finished`` forgets it
        report = side.finished(request.request_id)
        return hold, (None if report is None else {"cmx": report})

    def shutdown(self) -> None:
        if self._scheduler is not None:
            self._scheduler.shutdown()
        if self._worker is not None:
            self._worker.shutdown()
        self._cm.shutdown(stop_service=False)

    # -- helpers -------------------------------------------------------------------------------

    def _connect(self, settings: ConnectorSettings) -> Any:
        """The ``ContextMemory`` the connector uses (a test reaches an in-process service)."""
        return connect(settings)

    def _side_worker(self) -> WorkerSide:
        if self._worker is None:
            raise RuntimeError("a worker hook was called on the scheduler's connector")
        return self._worker

    def _side_scheduler(self) -> SchedulerSide:
        if self._scheduler is None:
            raise RuntimeError("a scheduler hook was called on a worker's connector")
        return self._scheduler


def check_parallel(parallel: Any) -> None:
    """Tensor parallelism only: under pipeline or context parallelism each stage or context
    rank holds other layers or tokens of a block, under the same keys, and what one stored
    another would load as its own."""
    sizes = (parallel.pipeline_parallel_size, parallel.decode_context_parallel_size,
             parallel.prefill_context_parallel_size)
    if sizes != (1, 1, 1):
        raise ValueError("CMXConnector supports tensor parallelism only, not pipeline or "
                         f"context parallelism (pipeline, decode, prefill context: {sizes})")


def _head_plan(vllm_config: VllmConfig, role: KVConnectorRole, heads: int) -> HeadPlan:
    """The KV heads this process holds: every one on the scheduler (a block counts as cached
    when each rank can load it), a worker's own under tensor parallelism (``heads`` is the
    number in its cache)."""
    tp = vllm_config.parallel_config.tensor_parallel_size
    if tp == 1:
        return HeadPlan.everything(heads)
    total = vllm_config.model_config.get_total_num_kv_heads()
    if role == KVConnectorRole.SCHEDULER:
        return HeadPlan.everything(total, tp)
    from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

    return HeadPlan.of(total, tp, get_tensor_model_parallel_rank())


def _served_name(model_config: Any) -> str:
    name = model_config.served_model_name
    if isinstance(name, (list, tuple)):
        name = name[0] if name else ""
    return str(name or model_config.model)


def _fingerprint(path: str) -> str:
    from cmx.models import weights_fingerprint

    return weights_fingerprint(path)


def _paged_layout(name: str) -> PagedLayout:
    if name:
        return PagedLayout(name)
    from vllm.platforms import current_platform

    return PagedLayout.VLLM_CPU if current_platform.is_cpu() else PagedLayout.VLLM_FLASH
