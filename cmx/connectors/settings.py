"""What an engine connector is told, and how it reaches the service.

vLLM passes ``kv_transfer_config["kv_connector_extra_config"]`` to the connector as a plain
dict; ``ConnectorSettings.from_extra`` turns it into a typed, frozen value and refuses unknown
keys, so a misspelt setting is an error at engine start, not a silent default.

At start the connector asks the running service its slot size (``adopt_service_slots``): the
service may have been started by someone else, with another ``block_bytes`` than this engine's
``service`` setting, and an engine whose blocks do not fit its slots is refused then, with the
number to set, rather than failing every store later.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

from cmx.config import ServiceConfig
from cmx.errors import CmxError, LayoutMismatchError
from cmx.layout import KVLayout

if TYPE_CHECKING:
    from cmx.connectors.shards import HeadPlan

__all__ = ["ConnectorSettings", "LoadMode", "Namespaces", "SaveMode", "SettingError",
           "adopt_service_slots", "connect", "quiet_driver", "namespace_salt"]

log = logging.getLogger(__name__)


class LoadMode(str, enum.Enum):
    """When a step's loads land; given by its value ("sync", "async") in the engine's config."""

    SYNC = "sync"  # before the step's attention reads them (vLLM holds the step)
    ASYNC = "async"  # while the request waits in vLLM's WAITING_FOR_REMOTE_KVS, others run


class SaveMode(str, enum.Enum):
    """When a step's blocks are copied out; given by its value ("sync", "async")."""

    SYNC = "sync"  # each layer's blocks inside the forward
    ASYNC = "async"  # after it, on a thread, the request's blocks kept from reuse until then


class SettingError(CmxError, ValueError):
    """A connector setting given a value it cannot take (the message names the choices)."""


_Mode = TypeVar("_Mode", LoadMode, SaveMode)


def _mode(kind: type[_Mode], name: str, value: object) -> _Mode:
    """``value`` as a member of ``kind``: a member already, or its value as given ("async")."""
    try:
        return kind(value)
    except ValueError:
        choices = ", ".join(repr(m.value) for m in kind)
        raise SettingError(f"{name} is one of {choices}, not {value!r}") from None


@dataclass(frozen=True)
class ConnectorSettings:
    model: str = ""  # namespace model id; "" means the engine's served model name
    weights: str = ""  # weights fingerprint; "" means the one cmx.models recorded, if any
    salt: str = ""  # tenant salt of every request; a request's cache_salt is added to it
    ray_address: str = ""  # Ray cluster of the service; "" means the one this process is in;
    #                        "auto" the one `ray start` last started on this host (logged)
    node_id: str = ""  # the Ray node whose agent and tiers this engine uses; "" means the node
    #                    this process joined (a driver on a host with several raylets joins
    #                    the head's, so a replica names its own node for its engine's process)
    service: ServiceConfig = field(default_factory=ServiceConfig.from_env)  # the service's
    start_service: bool = True  # start the service's actors if they are not running
    gate: bool = True  # break-even gating: load only what is faster to load than to compute
    margin: float = 0.05  # a load must beat recomputing by this fraction
    lookup_wait_s: float = 0.005  # the scheduler waits this long for a lookup, then polls
    load_timeout_s: float = 0.0  # bound on one step's loads; 0 means service.load_timeout_s
    max_pending_stores: int = 64  # stores in flight before new ones are dropped (and logged)
    load_mode: LoadMode = LoadMode.ASYNC  # when a step's loads land (LoadMode)
    load_threads: int = 2  # async mode: loads that run at once; more wait their turn
    load_layer_groups: int = 4  # sync mode: a step's loads are fetched and written in this
    #                            many groups of layers, so attention over the first layers
    #                            waits for their bytes only (1: the whole prefix first)
    save_mode: SaveMode = SaveMode.ASYNC  # when a step's blocks are copied out (SaveMode;
    #                                      ASYNC: vllm_gather)
    staging_bytes: int = 256 << 20  # async saves: bytes of copied blocks not yet stored;
    #                                 a save that does not fit is dropped and counted
    prefetch: bool = True  # a lookup finding blocks away from this node's memory (NVMe, a
    #                        peer, the pool) starts moving them here at once; the load that
    #                        follows waits for a move of its blocks still under way and pins
    #                        its result (the agent's ``InFlight``), never coming back short
    store_wait_s: float = 5.0  # a request told of a producer's store (its kv_transfer_params'
    #                            expect_tokens: vllm_requests) waits this long for its commit
    share_tp: bool = True  # an engine at TP=1 also loads the prefixes engines of other
    #                        tensor-parallel degrees stored (a KV head a namespace:
    #                        cmx.connectors.shards); a miss then asks one more namespace
    block_tokens: int = 0  # if set, must equal the engine's block size (a check, no more)
    paged_layout: str = ""  # the engine's KV layout (cmx.connectors.paged); "" means detect

    @classmethod
    def from_extra(cls, extra: Mapping[str, Any] | None) -> ConnectorSettings:
        """Settings from ``kv_connector_extra_config``; ValueError on unknown keys."""
        values = dict(extra or {})
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"unknown CMXConnector settings {unknown}; known: {sorted(known)}")
        service = values.pop("service", None)
        if isinstance(service, Mapping):
            values["service"] = ServiceConfig.from_env(**service)
        elif service is not None and not isinstance(service, ServiceConfig):
            raise ValueError("'service' must be a dict of ServiceConfig fields")
        return cls(**values)

    def __post_init__(self) -> None:
        if min(self.lookup_wait_s, self.load_timeout_s, self.store_wait_s) < 0 or \
                self.max_pending_stores < 1:
            raise ValueError("lookup_wait_s, load_timeout_s and store_wait_s must be >= 0, "
                             "max_pending_stores >= 1")
        # The engine's config gives the modes as strings (JSON): each becomes its member here.
        object.__setattr__(self, "load_mode", _mode(LoadMode, "load_mode", self.load_mode))
        object.__setattr__(self, "save_mode", _mode(SaveMode, "save_mode", self.save_mode))
        if self.load_threads < 1 or self.staging_bytes < 1 or self.load_layer_groups < 1:
            raise ValueError("load_threads, load_layer_groups and staging_bytes must be >= 1")

    @property
    def load_bound_s(self) -> float:
        return self.load_timeout_s or self.service.load_timeout_s

    @property
    def async_loads(self) -> bool:
        return self.load_mode is LoadMode.ASYNC

    @property
    def async_saves(self) -> bool:
        return self.save_mode is SaveMode.ASYNC


def namespace_salt(base: str, cache_salt: str | None) -> str:
    """The namespace salt of a request: the connector's salt and the request's ``cache_salt``.

    A request without a cache_salt uses the connector's salt, one without a connector salt
    uses its cache_salt alone; both together are encoded so no two pairs give one salt.
    """
    if not cache_salt:
        return base
    if not base:
        return cache_salt
    return json.dumps([base, cache_salt])


def connect(settings: ConnectorSettings) -> Any:
    """A ``ContextMemory`` on the service's cluster, joining the Ray cluster if need be."""
    import ray

    from cmx.client import ContextMemory

    if not ray.is_initialized() and not settings.ray_address:
        # Without an address each engine process (scheduler, workers) would start a cluster of
        # its own, and what one stores the other would never see.
        raise CmxError("CMXConnector needs a Ray cluster: run the engine inside one, or set "
                       "kv_connector_extra_config['ray_address'] (e.g. 'auto')")
    joined = ray.is_initialized()
    # Not every Ray worker's log lines in the engine's output.
    cm = ContextMemory.connect(address=settings.ray_address or None, config=settings.service,
                               start_service=settings.start_service, log_to_driver=False)
    if not joined:
        quiet_driver()
    if settings.ray_address == "auto" and not joined:
        # "auto" follows the current-cluster file `ray start` leaves on this host, which can
        # name another user's cluster: say which one it was.
        log.warning("CMXConnector: ray_address 'auto' joined the Ray cluster at %s (the last "
                    "one `ray start` started on this host); set that address to be sure",
                    ray.get_runtime_context().gcs_address)
    if settings.node_id:
        cm.node_id = settings.node_id
    return cm


def quiet_driver() -> bool:
    """Stop the threads Ray starts in every driver it joins to print other workers' errors
    and log lines (``listen_error_messages``, ``print_logs``), as ``ray.shutdown`` does: the
    flag they loop on set, their subscribers closed. True if there were any.

    An engine process prints neither, and in vLLM's worker processes under an OpenAI server
    the error subscriber's poll went round inside Ray without returning: the GCS answered
    about 2,900 polls a second and spent half a core on them (2 servers, 2 cores). Ray clears
    the flag when it is joined again."""
    from ray._private import worker as ray_worker

    driver = ray_worker.global_worker
    stopped = getattr(driver, "threads_stopped", None)
    if stopped is None:
        return False
    stopped.set()
    for name in ("gcs_error_subscriber", "gcs_log_subscriber"):
        subscriber = getattr(driver, name, None)
        if subscriber is not None:
            subscriber.close()  # its poll returns; the thread sees the flag and ends
    return True


def adopt_service_slots(cm: Any) -> None:
    """Take the running service's slot size as ``cm.config.block_bytes``.

    The service keeps the config of whoever started it; the engine's ``service`` setting is
    only the one it would start. If the node's DRAM tier does not answer, the setting stays
    (a warning): stores then fail, counted as failed, until it does.
    """
    from cmx.doors import ArenaInfoOf
    from cmx.protocol import actor_name

    try:
        slot_bytes = int(cm.link.call(actor_name("dram", cm.node_id), ArenaInfoOf()).slot_bytes)
    except Exception as exc:  # noqa: BLE001 - a service not up yet: checked against the setting
        log.warning("CMXConnector could not ask the service its slot size (%s); checking blocks "
                    "against ServiceConfig.block_bytes=%d", exc, cm.config.block_bytes)
        return
    if slot_bytes != cm.config.block_bytes:
        cm.config = cm.config.replace(block_bytes=slot_bytes)


class Namespaces:
    """The namespace of each salt, for one model and layout, opened once.

    With a ``plan`` (``cmx.connectors.shards``) each salt's is a ``HeadShards``: the model's
    whole blocks and each KV head's, so engines of any tensor-parallel degree share them;
    ``layout`` is then this process's, its own heads only."""

    def __init__(self, cm: Any, model: str, layout: KVLayout, weights: str,
                 plan: HeadPlan | None = None) -> None:
        whole = layout if plan is None else dataclasses.replace(layout, num_kv_heads=plan.total)
        if whole.block_bytes > cm.config.block_bytes:
            fits = cm.config.block_bytes // whole.token_bytes
            raise LayoutMismatchError(
                f"a block of {model} ({whole.block_tokens} tokens x {whole.token_bytes} "
                f"bytes) is {whole.block_bytes} bytes; the service's slots hold "
                f"{cm.config.block_bytes}: start the service with "
                f"CMX_BLOCK_BYTES={whole.block_bytes} (ServiceConfig.block_bytes), or set the "
                f"engine's block_size to at most {fits}")
        if plan is not None and len(plan.local) not in (plan.total, layout.num_kv_heads):
            raise LayoutMismatchError(f"this process holds {layout.num_kv_heads} KV heads, "
                                      f"its plan {len(plan.local)}")
        self.cm = cm
        self.model = model
        self.layout = layout
        self.whole = whole
        self.weights = weights
        self.plan = plan
        self._open: dict[str, Any] = {}

    def get(self, salt: str) -> Any:
        ns = self._open.get(salt)
        if ns is None:
            ns = self._open[salt] = self._opened(salt)
        return ns

    def opened(self) -> list[Any]:
        """Every namespace opened so far, one per salt."""
        return list(self._open.values())

    def forget(self) -> list[Any]:
        """Every namespace client opened so far (each head's too), no longer held open here."""
        opened, self._open = list(self._open.values()), {}
        return [c for ns in opened for c in (ns.clients() if self.plan else [ns])]

    @property
    def node_id(self) -> str:
        return str(self.cm.node_id)

    def _opened(self, salt: str) -> Any:
        whole = self.cm.namespace(self.model, self.whole, salt, self.weights)
        if self.plan is None:
            return whole
        from cmx.connectors.shards import HeadShards, head_model

        one = dataclasses.replace(self.whole, num_kv_heads=1)
        heads = [self.cm.namespace(head_model(self.model, h), one, salt, self.weights)
                 for h in range(self.plan.total)]
        return HeadShards(whole, heads, self.plan, self.layout)
