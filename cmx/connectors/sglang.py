"""The context memory as SGLang's HiCache storage (L3) backend: ``CMXHiCacheStorage``.

SGLang (0.5.x) plugs a storage backend in by module path::

    --enable-hierarchical-cache --hicache-storage-backend dynamic
    --hicache-storage-backend-extra-config '{"backend_name": "cmx",
        "module_path": "cmx.connectors.sglang", "class_name": "CMXHiCacheStorage",
        "ray_address": "10.0.0.5:6379"}'     # the service's GCS address

SGLang hands the backend pages of its host KV pool, each named by SGLang's own chained page
hash (a string). The service keys blocks by token ids, so a page is stored as one block whose
"tokens" are the 32-byte BLAKE2b digest of SGLang's key (eight uint32 words) in a namespace of
its own: the model (with the tensor-parallel rank for non-MLA models, whose ranks hold
different heads), a layout of one block per page (``page_layout``) and the tenant salt. The
bytes are SGLang's, moved unchanged.

Tested against SGLang's own ``HiCacheStorage`` class, imported from the installed package; the
SGLang engine itself does not run on these machines.
"""

from __future__ import annotations

import hashlib
import logging
import threading
from typing import Any

import numpy as np
import torch
from sglang.srt.mem_cache.hicache_storage import (
    HiCacheStorage,
    HiCacheStorageConfig,
    HiCacheStorageExtraInfo,
)

from cmx.connectors.settings import ConnectorSettings, connect
from cmx.errors import LayoutMismatchError
from cmx.layout import KVLayout

__all__ = ["CMXHiCacheStorage", "page_layout"]

log = logging.getLogger(__name__)

KEY_TOKENS = 8  # SGLang's key, hashed to 32 bytes, as eight uint32 "tokens"
# The keys of extra_config that SGLang itself reads, passed through to us.
SGLANG_KEYS = ("backend_name", "module_path", "class_name", "interface_v1")
OURS = ("ray_address", "service", "start_service", "salt", "model", "page_bytes")


def page_layout(page_bytes: int) -> KVLayout:
    """One page as one block: 8 tokens x 2 (K, V) x ``page_bytes / 16`` bytes, opaque bytes."""
    if page_bytes <= 0 or page_bytes % (2 * KEY_TOKENS):
        raise LayoutMismatchError(f"a page of {page_bytes} bytes is not a multiple of 16")
    return KVLayout(num_layers=1, num_kv_heads=1, head_dim=page_bytes // (2 * KEY_TOKENS),
                    dtype="float8_e4m3fn", block_tokens=KEY_TOKENS)


def key_tokens(key: str) -> np.ndarray:
    digest = hashlib.blake2b(key.encode(), digest_size=4 * KEY_TOKENS,
                             person=b"cmx-sglang-v1").digest()
    return np.frombuffer(digest, dtype="<u4")


class CMXHiCacheStorage(HiCacheStorage):
    def __init__(self, storage_config: HiCacheStorageConfig,
                 kwargs: dict[str, Any] | None = None, memory: Any = None) -> None:
        extra = dict(storage_config.extra_config or {})
        unknown = sorted(set(extra) - set(SGLANG_KEYS) - set(OURS))
        if unknown:
            raise ValueError(f"unknown CMXHiCacheStorage settings {unknown}; known: "
                             f"{sorted(OURS)}")
        mine = {k: extra[k] for k in OURS if k in extra and k not in ("model", "page_bytes")}
        settings = ConnectorSettings.from_extra(mine)
        self._cm = memory if memory is not None else connect(settings)
        model = str(extra.get("model") or storage_config.model_name or "sglang")
        if not storage_config.is_mla_model:
            model = f"{model}@tp{storage_config.tp_rank}/{storage_config.tp_size}"
        self._model = model
        self._salt = settings.salt
        self._page_bytes = int(extra.get("page_bytes", 0))
        self._ns: Any = None
        self._lock = threading.Lock()
        if self._page_bytes:
            self._namespace(self._page_bytes)

    # -- the interface -------------------------------------------------------------------------

    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        super().register_mem_pool_host(mem_pool_host)
        size = mem_pool_host.get_size_per_token() * mem_pool_host.page_size
        self._namespace(int(size))

    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    def batch_exists(self, keys: list[str],
                     extra_info: HiCacheStorageExtraInfo | None = None) -> int:
        """How many of ``keys``, from the first, the service holds."""
        ns = self._ns
        if ns is None or not keys:
            return 0  # no page size known yet: nothing can have been stored under it
        hashes = [ns.keys(key_tokens(k))[0] for k in keys]
        found = 0
        for copies in self._cm.copies(hashes):
            if not copies:
                break
            found += 1
        return found

    def get(self, key: str, target_location: Any = None,
            target_sizes: Any = None) -> torch.Tensor | None:
        """The page into ``target_location`` (a tensor of the page's size), or None on a miss."""
        from cmx.client import Match

        ns = self._ns
        if ns is None and target_location is not None:
            ns = self._namespace(target_location.numel() * target_location.element_size())
        if ns is None:
            return None
        tokens = key_tokens(key)
        match: Match = ns.lookup(tokens, here_first=True)
        if match.num_blocks != 1:
            return None
        kv = ns.load(tokens, match)
        if kv.shape[3] != KEY_TOKENS:
            return None  # vanished between lookup and load: a miss
        page = kv.contiguous().view(torch.uint8).reshape(-1)
        if target_location is None:
            return page
        dst = target_location.view(-1).view(torch.uint8)
        if dst.numel() != page.numel():
            raise LayoutMismatchError(f"target holds {dst.numel()} bytes, a page is "
                                      f"{page.numel()}")
        dst.copy_(page)
        return target_location

    def batch_get(self, keys: list[str], target_locations: Any = None,
                  target_sizes: Any = None) -> list[torch.Tensor | None]:
        targets = target_locations or [None] * len(keys)
        return [self.get(k, t) for k, t in zip(keys, targets)]

    def set(self, key: str, value: Any = None, target_location: Any = None,
            target_sizes: Any = None) -> bool:
        """Store one page (a tensor); True once the service holds it: committed now, or stored
        before. A commit the service refused (a lease that ended, a DRAM tier that restarted)
        or a page it found no room for is False: SGLang then keeps no record of it in L3."""
        if value is None:
            value = target_location
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"a page is a torch.Tensor, got {type(value).__name__}")
        page = value.detach().contiguous().view(torch.uint8).reshape(-1).cpu()
        try:
            ns = self._namespace(page.numel())
            kv = page.view(torch.float8_e4m3fn).reshape(ns.layout.shape(KEY_TOKENS))
            tokens = key_tokens(key)
            handle = ns.store(tokens, kv)
            committed = handle.wait()
            if handle.refused:
                log.warning("page %s not stored: the service refused its commit", key[:16])
                return False
            # Nothing committed and nothing refused: the page was there already, or no slot
            # was granted for it; the directory tells which.
            return committed == 1 or bool(self._cm.copies(ns.keys(tokens))[0])
        except Exception as exc:  # noqa: BLE001 - SGLang takes False as "not stored"
            log.warning("page %s not stored: %s", key[:16], exc)
            return False

    def batch_set(self, keys: list[str], values: Any = None, target_locations: Any = None,
                  target_sizes: Any = None) -> bool:
        """Each page stored as ``set`` stores it; True only if every one is held."""
        pages = values if values is not None else target_locations
        return all([self.set(k, v) for k, v in zip(keys, pages)])

    # -- helpers -------------------------------------------------------------------------------

    def _namespace(self, page_bytes: int) -> Any:
        with self._lock:
            if self._ns is None:
                if self._page_bytes and page_bytes != self._page_bytes:
                    raise LayoutMismatchError(f"page of {page_bytes} bytes, configured "
                                              f"{self._page_bytes}")
                self._page_bytes = page_bytes
                self._ns = self._cm.namespace(self._model, page_layout(page_bytes), self._salt)
            elif page_bytes != self._page_bytes:
                raise LayoutMismatchError(f"page of {page_bytes} bytes, this storage's pages "
                                          f"are {self._page_bytes}")
            return self._ns
