"""SGLang's own host KV pools, built on CPU as SGLang builds them, and which of them
CMXHiCacheStorage takes: MHA and MLA pools of the layouts whose pages it moves, each page a view
of the pool's buffer; any other pool or layout is refused when SGLang registers it.

The builders here serve the other SGLang tests too (``test_sglang_pages``, the engine tests).
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.machinery
import os
import sys
import types
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import pytest
import torch
from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig

from cmx.connectors.sglang import CMXHiCacheStorage
from cmx.connectors.sglang_pages import FLAT_ORDERS, HostPages, HostPoolError
from cmx.errors import LayoutMismatchError

MHA_LAYOUTS = sorted(FLAT_ORDERS["mha"])
MLA_LAYOUTS = sorted(FLAT_ORDERS["mla"])


class _Absent(types.ModuleType):
    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return type(name, (), {})


class _StandIn(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Answers imports of ``torchvision`` with empty modules."""

    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        if name.split(".")[0] == "torchvision":
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec: Any) -> types.ModuleType:
        return _Absent(spec.name)

    def exec_module(self, module: types.ModuleType) -> None:
        module.__path__ = []  # type: ignore[attr-defined]


@contextmanager
def _without_torchvision() -> Iterator[None]:
    """SGLang's memory pools import its model configs, and its image and OCR models' configs
    import torchvision at module level; this project's environment has none (``make install``
    removes the one vLLM pulls in, built for another torch). While the pools are imported an
    empty stand-in answers for it, gone afterwards; transformers has recorded by then that
    torchvision is absent, so nothing else takes the stand-in for it."""
    from transformers.utils import import_utils

    import_utils.is_torchvision_available()  # cached: False, before the stand-in exists
    finder = _StandIn()
    sys.meta_path.insert(0, finder)
    try:
        yield
    finally:
        sys.meta_path.remove(finder)
        for name in [n for n in sys.modules if n.split(".")[0] == "torchvision"]:
            del sys.modules[name]


@functools.cache
def sglang_pools() -> types.SimpleNamespace:
    """SGLang's device and host pool classes (importing them takes tens of seconds here).
    The import sets environment variables for SGLang's GPU kernels (and a library path for
    OpenCV); they are taken back, so engines this process starts later never see them."""
    try:
        import torchvision  # noqa: F401
    except ImportError:
        stand_in = _without_torchvision()
    else:
        stand_in = _nothing()
    environ = dict(os.environ)
    try:
        with stand_in:
            from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, MLATokenToKVPool
            from sglang.srt.mem_cache.pool_host.base import host_memory_budget_scope
            from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
            from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost
    finally:
        for name in set(os.environ) - set(environ):
            del os.environ[name]
        os.environ.update(environ)
    return types.SimpleNamespace(MHA=MHATokenToKVPool, MLA=MLATokenToKVPool,
                                 MHAHost=MHATokenToKVPoolHost, MLAHost=MLATokenToKVPoolHost,
                                 budget=host_memory_budget_scope)


# A host pool checks its size against the machine's free memory less SGLang's reserve, which a
# busy test machine need not have: the tests' pools (kilobytes) are booked against this instead.
POOL_BUDGET = 1 << 30


@contextmanager
def _nothing() -> Iterator[None]:
    yield


def mha_pool(layout: str = "page_first", *, layers: int = 2, heads: int = 2, head_dim: int = 8,
             page: int = 4, tokens: int = 64, dtype: torch.dtype = torch.bfloat16,
             seed: int | None = None) -> Any:
    """SGLang's MHA host pool over a CPU device pool of ``tokens`` tokens (the host holds
    twice that, and a page more), its bytes random for ``seed`` (else zero)."""
    p = sglang_pools()
    device = p.MHA(tokens, page, dtype, heads, head_dim, layers, "cpu", False,
                   start_layer=0, end_layer=layers - 1)
    return host_of(p.MHAHost, device, page, layout, seed)


def mla_pool(layout: str = "page_first", *, layers: int = 2, rank: int = 16, rope: int = 8,
             page: int = 4, tokens: int = 64, dtype: torch.dtype = torch.bfloat16,
             seed: int | None = None) -> Any:
    """SGLang's MLA host pool (rows of ``rank + rope`` elements), as ``mha_pool``."""
    p = sglang_pools()
    device = p.MLA(tokens, page, dtype, rank, rope, layers, "cpu", False,
                   start_layer=0, end_layer=layers - 1)
    return host_of(p.MLAHost, device, page, layout, seed, target_layer_num=layers)


def host_of(cls: Any, device: Any, page: int, layout: str, seed: int | None,
            **more: Any) -> Any:
    """SGLang's host pool ``cls`` over ``device``, twice its size, filled as ``fill`` says."""
    with sglang_pools().budget(POOL_BUDGET):
        host = cls(device.get_device_pool_infos()[0].buffer_info, 2.0, 0, page, layout,
                   pin_memory=False, device_capacity_tokens=device.size,
                   start_layer=device.start_layer, end_layer=device.end_layer, **more)
    return fill(host, seed)


def fill(host: Any, seed: int | None) -> Any:
    raw = host.kv_buffer.view(torch.uint8)
    if seed is None:
        raw.zero_()
    else:
        g = torch.Generator().manual_seed(seed)
        raw.copy_(torch.randint(0, 256, raw.shape, generator=g, dtype=torch.uint8))
    return host


def page_bytes(host: Any, slot: int) -> torch.Tensor:
    """The page whose first slot is ``slot``, as bytes in SGLang's flat-page order (a copy)."""
    return host.get_data_page(slot, flat=True).view(torch.uint8).clone()


def config(salt: str = "", mla: bool = False, **changes: Any) -> HiCacheStorageConfig:
    fields: dict[str, Any] = dict(
        tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
        is_mla_model=mla, enable_storage_metrics=False, is_page_first_layout=True,
        model_name="m", extra_config={"salt": salt})
    return HiCacheStorageConfig(**(fields | changes))


class NoNamespaces:
    """A client that opens namespaces and nothing else: registration alone is under test."""

    def namespace(self, model: str, layout: Any, salt: str = "") -> Any:
        return types.SimpleNamespace(model=model, layout=layout, salt=salt)


@pytest.mark.parametrize("layout", MHA_LAYOUTS)
def test_mha_pools_of_each_host_layout_are_taken(layout: str) -> None:
    host = mha_pool(layout)
    pages = HostPages.of(host)
    assert (pages.kind, pages.page_tokens) == ("mha", 4)
    assert pages.page_bytes == 4 * 2 * 2 * (8 + 8) * 2  # tokens x layers x heads x (K+V) x bf16
    assert pages.order == FLAT_ORDERS["mha"][layout]
    # A page's runs are views of the pool's buffer, in SGLang's flat-page order.
    runs = pages.runs(8)
    assert torch.equal(torch.from_numpy(np.concatenate(runs)), page_bytes(host, 8))
    runs[0][0] ^= 0xFF
    assert page_bytes(host, 8)[0] == runs[0][0]


@pytest.mark.parametrize("layout", MLA_LAYOUTS)
def test_mla_pools_of_each_host_layout_are_taken(layout: str) -> None:
    host = mla_pool(layout, seed=1)
    pages = HostPages.of(host)
    assert (pages.kind, pages.page_bytes) == ("mla", 4 * 2 * (16 + 8) * 2)
    assert torch.equal(torch.from_numpy(np.concatenate(pages.runs(4))), page_bytes(host, 4))


def test_other_pools_are_refused_when_registered() -> None:
    storage = CMXHiCacheStorage(config(), memory=NoNamespaces())
    with pytest.raises(HostPoolError, match="page_unified"):
        storage.register_mem_pool_host(mha_pool("page_unified"))
    with pytest.raises(HostPoolError, match="page_unified"):
        storage.register_mem_pool_host(mla_pool("page_unified"))
    with pytest.raises(HostPoolError, match="SimpleNamespace"):
        storage.register_mem_pool_host(types.SimpleNamespace(layout="page_first"))


def test_a_pool_of_another_page_size_than_configured_is_refused() -> None:
    storage = CMXHiCacheStorage(config(extra_config={"page_bytes": 1024}),
                                memory=NoNamespaces())
    with pytest.raises(LayoutMismatchError, match="configured 1024"):
        storage.register_mem_pool_host(mha_pool())
