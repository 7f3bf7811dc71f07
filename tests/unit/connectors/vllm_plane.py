"""A real ``CMXConnector``, built from a minimal vLLM config, that reaches an in-process service
(tests/unit/actors/plane.py: tiers, agent and directory wired by LocalLink) instead of Ray."""

from __future__ import annotations

import threading
import time
import uuid
from pathlib import Path
from types import SimpleNamespace
from typing import Any, TypeVar

import torch
from plane import Plane, make_plane
from vllm.config import KVTransferConfig, VllmConfig
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.v1.core.sched.output import CachedRequestData
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec

from cmx.client import ContextMemory
from cmx.client.node_plane import NodePlane
from cmx.config import ServiceConfig
from cmx.connectors.paged import PagedLayout, block_view
from cmx.connectors.settings import ConnectorSettings
from cmx.connectors.vllm import CMXConnector
from cmx.doors import Request
from cmx.errors import UnavailableError
from cmx.layout import KVLayout
from cmx.links import LocalLink

R = TypeVar("R")
T, LAYERS, HEADS, DIM, BLOCKS = 8, 3, 2, 16, 8
LAYOUT = KVLayout(num_layers=LAYERS, num_kv_heads=HEADS, head_dim=DIM, block_tokens=T,
                  dtype="float32")  # 6,144 bytes a block
NAMES = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]
NODE = f"engine-{uuid.uuid4().hex[:6]}"  # arenas named apart from other runs'
BOUND_S = 30.0  # a liveness bound only
LEASE_S = 60.0  # the plane's clock moves only when a test moves it


def plane_of(root: Path, block_bytes: int = 8192,
             link_type: type[LocalLink] = LocalLink, **extra: Any) -> Plane:
    """A one-node service whose slots are ``block_bytes`` (``extra``: more of its config)."""
    config = ServiceConfig(block_bytes=block_bytes, hbm_bytes=16 * block_bytes,
                           dram_bytes=32 * block_bytes, nvme_bytes=64 * block_bytes,
                           nvme_dir=str(root), nvme_segment_bytes=16 * block_bytes,
                           directory_shards=2, call_timeout_s=5.0, load_timeout_s=BOUND_S,
                           lease_s=LEASE_S, **extra)
    return make_plane(config, nodes=(NODE,), link_type=link_type)


def client_of(plane: Plane, config: ServiceConfig) -> ContextMemory:
    """A ``ContextMemory`` of the plane's node, with ``config`` as its own view."""
    cm = ContextMemory(config, NODE, owns_ray=False)
    cm.link = plane.link  # type: ignore[assignment]
    cm.plane = NodePlane(plane.link, NODE, 5.0)
    return cm


def connector(plane: Plane, role: KVConnectorRole, **extra: Any) -> CMXConnector:
    """The real connector, joined to ``plane`` rather than to a Ray cluster."""

    class PlaneConnector(CMXConnector):
        def _connect(self, settings: ConnectorSettings) -> Any:
            return client_of(plane, settings.service)

    # The suites of the sync paths name their modes here; those of the fast paths (the
    # defaults) set them in ``extra``.
    settings = {"model": "m", "weights": "w", "paged_layout": "vllm_cpu",
                "load_timeout_s": BOUND_S, "service": {"call_timeout_s": 5.0},
                "load_mode": "sync", "save_mode": "sync", "prefetch": False, **extra}
    vllm_config = VllmConfig(kv_transfer_config=KVTransferConfig(
        kv_connector="CMXConnector", kv_connector_module_path="cmx.connectors.vllm",
        kv_role="kv_both", kv_load_failure_policy="recompute",
        kv_connector_extra_config=settings))
    spec = FullAttentionSpec(block_size=T, num_kv_heads=HEADS, head_size=DIM,
                             dtype=torch.float32)
    kv_cache_config = KVCacheConfig(num_blocks=BLOCKS, kv_cache_tensors=[],
                                    kv_cache_groups=[KVCacheGroupSpec(NAMES, spec)])
    return PlaneConnector(vllm_config, role, kv_cache_config)


def paged_caches() -> list[torch.Tensor]:
    """One vLLM CPU-layout cache per layer, zeroed."""
    return [torch.zeros(BLOCKS, HEADS, T, 2 * DIM) for _ in range(LAYERS)]


def blocks_of(cache: torch.Tensor, ids: list[int]) -> torch.Tensor:
    """[2, heads, len(ids) * T, dim] of the paged cache's blocks ``ids``, in order."""
    view = block_view(cache, PagedLayout.VLLM_CPU, DIM)  # [blocks, heads, 2, T, dim]
    return view[ids].permute(2, 1, 0, 3, 4).reshape(2, HEADS, len(ids) * T, DIM)


class GatedLink(LocalLink):
    """The plane's link, whose calls from the async loader's threads (``cmx-aload``) can be
    held (they wait for ``opened``, as calls to a service that stopped answering) or failed
    (``dead``: as calls to a service that is gone)."""

    def __init__(self, targets: Any) -> None:
        super().__init__(targets)
        self.held = False
        self.dead = False
        self.entered = threading.Event()  # a held call is waiting
        self.opened = threading.Event()

    def call(self, name: str, request: Request[R], timeout_s: float | None = None) -> R:
        if threading.current_thread().name.startswith("cmx-aload"):
            if self.dead:
                raise UnavailableError(f"{name} is not running")
            if self.held:
                self.entered.set()
                assert self.opened.wait(BOUND_S)
        return super().call(name, request, timeout_s=timeout_s)


def request(req_id: str, prompt: tuple[int, ...]) -> Any:
    """What the connector reads of a vLLM ``Request``."""
    return SimpleNamespace(request_id=req_id, prompt_token_ids=list(prompt), cache_salt=None,
                           kv_transfer_params=None, block_hashes=[])


def allocated(block_ids: list[int]) -> Any:
    """vLLM's ``KVCacheBlocks`` of a request, as the connector reads them."""
    return SimpleNamespace(get_block_ids=lambda: (list(block_ids),))


def step_output(new: tuple[tuple[str, list[int], int, int], ...] = (),
                finished: tuple[str, ...] = (), preempted: tuple[str, ...] = ()) -> Any:
    """vLLM's ``SchedulerOutput`` as the connector reads it; ``new``: (req_id, block ids,
    computed tokens, tokens scheduled) of each newly scheduled request."""
    return SimpleNamespace(
        scheduled_new_reqs=[SimpleNamespace(req_id=r, block_ids=(ids,), num_computed_tokens=c)
                            for r, ids, c, _ in new],
        scheduled_cached_reqs=CachedRequestData.make_empty(),
        num_scheduled_tokens={r: n for r, _, _, n in new},
        finished_req_ids=set(finished), preempted_req_ids=set(preempted))


def poll_finished(conn: CMXConnector, finished: set[str] | None = None,
                  sending: bool = False) -> set[str]:
    """Call ``get_finished`` as vLLM does each step until it names a request (bounded)."""
    deadline = time.monotonic() + BOUND_S
    while True:
        got = conn.get_finished(finished or set())[0 if sending else 1]
        if got:
            return got
        assert time.monotonic() < deadline, "get_finished never named the request"
        time.sleep(0.01)
