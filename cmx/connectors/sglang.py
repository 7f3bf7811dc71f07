"""The context memory as SGLang's HiCache storage (L3) backend: ``CMXHiCacheStorage``.

SGLang (0.5.x) plugs a storage backend in by module path::

    --enable-hierarchical-cache --hicache-storage-backend dynamic
    --hicache-storage-backend-extra-config '{"backend_name": "cmx",
        "module_path": "cmx.connectors.sglang", "class_name": "CMXHiCacheStorage",
        "interface_v1": 1, "ray_address": "10.0.0.5:6379"}'     # the service's GCS address

SGLang hands the backend pages of its host KV pool, each named by SGLang's own chained page
hash (a string). The service keys blocks by token ids, so a page is stored as one block whose
"tokens" are the 32-byte BLAKE2b digest of SGLang's key (eight uint32 words) in a namespace of
its own: the model (with the tensor-parallel rank where ranks hold different heads, the
pipeline stage and the context-parallel rank where there are several), the host pool's page
byte order (``cmx.connectors.sglang_pages``), a layout of one block per page
(``page_layout``) and the tenant salt. The bytes are SGLang's, moved unchanged.

Every batch is one directory lookup and one load, or one store, of its run of blocks; with
``"interface_v1": 1`` SGLang calls ``batch_get_v1``/``batch_set_v1`` and the pages move
straight between the service's shared memory and SGLang's host pool; without it SGLang's
generic path hands over a tensor per page, batched the same way. A hybrid model's other host
pools (``register_mem_host_pool_v2``) move through ``batch_*_v2``, each in a namespace of its
own. A page that fails its checksum is a miss, and so is each page after it in its batch.
"""

from __future__ import annotations

import hashlib
import logging
import threading
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from sglang.srt.mem_cache.hicache_storage import (
    HiCacheStorage,
    HiCacheStorageConfig,
    HiCacheStorageExtraInfo,
    PoolHitPolicy,
    PoolName,
    PoolTransfer,
    PoolTransferResult,
)

from cmx.client.matches import Blocks, Match
from cmx.client.stores import store_into_dram
from cmx.connectors.settings import ConnectorSettings, connect
from cmx.connectors.sglang_pages import HostPages, PageSink, PageSource, Runs, tensor_runs
from cmx.errors import BlockStateError, LayoutMismatchError
from cmx.keys import BlockHash
from cmx.layout import KVLayout

__all__ = ["CMXHiCacheStorage", "key_tokens", "page_layout", "prefix_hits"]

log = logging.getLogger(__name__)

KEY_TOKENS = 8  # SGLang's key, hashed to 32 bytes, as eight uint32 "tokens"
KV = str(PoolName.KV)  # the anchor pool's name, as SGLang's transfers name it
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


@dataclass(frozen=True)
class _Pool:
    """A registered host pool and the namespace its pages live in."""

    pages: HostPages
    ns: Any  # NamespaceClient

    def runs(self, keys: Sequence[str], host_indices: Any) -> list[Runs]:
        return [self.pages.runs(s) for s in self.pages.starts(len(keys), host_indices)]


class CMXHiCacheStorage(HiCacheStorage):
    """SGLang's L3 storage on the service (the module says how pages become blocks)."""

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
        self._config = storage_config
        self._model = str(extra.get("model") or storage_config.model_name or "sglang")
        self._salt = settings.salt
        self._page_bytes = int(extra.get("page_bytes", 0))
        self._pools: dict[str, _Pool] = {}  # by SGLang's pool name
        self._tensors: Any = None  # the namespace of pages handed over as tensors, no pool yet
        self._lock = threading.Lock()
        if self._page_bytes:
            self._tensor_namespace(self._page_bytes)

    # -- registration ----------------------------------------------------------------------------

    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        """The anchor (KV) pool: its pages move through ``batch_*_v1``, ``get``/``set`` and
        ``batch_*_v2`` transfers named ``kv``. HostPoolError for a pool this cannot move."""
        super().register_mem_pool_host(mem_pool_host)
        self._bind(KV, mem_pool_host)

    def register_mem_host_pool_v2(self, host_pool: Any, host_pool_name: Any) -> None:
        """Another host pool of a hybrid model, moved by ``batch_*_v2`` transfers of its name."""
        super().register_mem_host_pool_v2(host_pool, host_pool_name)
        self._bind(str(host_pool_name), host_pool)

    # -- the per-page and generic interface ------------------------------------------------------

    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    def batch_exists(self, keys: list[str],
                     extra_info: HiCacheStorageExtraInfo | None = None) -> int:
        """How many of ``keys``, from the first, the service holds."""
        ns = self._kv_namespace()
        if ns is None or not keys:
            return 0  # no page size known yet: nothing can have been stored under it
        return int(self._cm.copy_table(_hashes(ns, keys)).prefix())

    def get(self, key: str, target_location: Any = None,
            target_sizes: Any = None) -> torch.Tensor | None:
        """The page into ``target_location`` (a host tensor of the page's size), or None."""
        return self.batch_get([key], [target_location])[0]

    def batch_get(self, keys: list[str], target_locations: Any = None,
                  target_sizes: Any = None) -> list[torch.Tensor | None]:
        """Each page into its target (a new tensor where it is None): the target, or None for
        a page not loaded. LayoutMismatchError, and nothing loaded, for a target of another
        size than the pages."""
        targets = list(target_locations) if target_locations is not None else [None] * len(keys)
        given = next((t for t in targets if t is not None), None)
        ns = self._kv_namespace(_nbytes(given) if given is not None else None)
        if ns is None or not keys:
            return [None] * len(keys)
        size = ns.layout.block_bytes
        pages = [t if t is not None else torch.empty(size, dtype=torch.uint8) for t in targets]
        loaded = self._load(ns, keys, [tensor_runs(p, size, target=True) for p in pages])
        return [p if ok else None for p, ok in zip(pages, loaded)]

    def set(self, key: str, value: Any = None, target_location: Any = None,
            target_sizes: Any = None) -> bool:
        """Store one page (a tensor); True once the service holds it: committed now, or stored
        before. A commit the service refused (a lease that ended, a DRAM tier that restarted)
        or a page it found no room for is False: SGLang then keeps no record of it in L3."""
        return self.batch_set([key], [value if value is not None else target_location])

    def batch_set(self, keys: list[str], values: Any = None, target_locations: Any = None,
                  target_sizes: Any = None) -> bool:
        """Store the pages (tensors) as one run; True only if every one is held. A page of
        another size than the others stores none of them."""
        pages = list(values if values is not None else target_locations)
        for page in pages:
            if not isinstance(page, torch.Tensor):
                raise TypeError(f"a page is a torch.Tensor, got {type(page).__name__}")
        if not pages:
            return True
        try:
            ns = self._kv_namespace(_nbytes(pages[0]))
            runs = [tensor_runs(p, ns.layout.block_bytes) for p in pages]
        except LayoutMismatchError as exc:
            log.warning("pages not stored: %s", exc)
            return False
        return all(self._store(ns, keys, runs, None))

    # -- the zero-copy interface -----------------------------------------------------------------

    def batch_get_v1(self, keys: list[str], host_indices: torch.Tensor,
                     extra_info: HiCacheStorageExtraInfo | None = None) -> list[bool]:
        """Pages into the anchor pool's slots ``host_indices``: per page, whether it is there
        now. The loaded pages are a prefix: a miss, or a page that failed its checksum, ends
        it. LayoutMismatchError for indices that are not ``len(keys)`` whole pages."""
        pool = self._pool(KV)
        return self._load(pool.ns, keys, pool.runs(keys, host_indices))

    def batch_set_v1(self, keys: list[str], host_indices: torch.Tensor,
                     extra_info: HiCacheStorageExtraInfo | None = None) -> list[bool]:
        """The anchor pool's pages at ``host_indices`` stored as one run: per page, whether the
        service holds it (as ``set`` answers)."""
        pool = self._pool(KV)
        return self._store(pool.ns, keys, pool.runs(keys, host_indices), _last(extra_info))

    def batch_exists_v2(self, keys: list[str], pool_transfers: list[PoolTransfer] | None = None,
                        extra_info: HiCacheStorageExtraInfo | None = None) -> PoolTransferResult:
        """The KV prefix held, cut to what each other pool can restore (``prefix_hits``)."""
        kv = self.batch_exists(keys, extra_info)

        def present(transfer: PoolTransfer) -> list[bool]:
            ns = self._pool(str(transfer.name)).ns
            return _present(self._cm, ns, keys[:kv])

        return prefix_hits(kv, pool_transfers or [], present)

    def batch_get_v2(self, transfers: list[PoolTransfer],
                     extra_info: HiCacheStorageExtraInfo | None = None) -> dict[Any, list[bool]]:
        """Each transfer's pages into its pool's slots, as ``batch_get_v1`` does."""
        out = {}
        for t in transfers:
            pool, keys = self._pool(str(t.name)), list(t.keys or [])
            out[t.name] = self._load(pool.ns, keys, pool.runs(keys, t.host_indices))
        return out

    def batch_set_v2(self, transfers: list[PoolTransfer],
                     extra_info: HiCacheStorageExtraInfo | None = None) -> dict[Any, list[bool]]:
        """Each transfer's pages stored from its pool's slots, as ``batch_set_v1`` does."""
        out = {}
        for t in transfers:
            pool, keys = self._pool(str(t.name)), list(t.keys or [])
            out[t.name] = self._store(pool.ns, keys, pool.runs(keys, t.host_indices),
                                      _last(extra_info))
        return out

    # -- moving runs of pages --------------------------------------------------------------------

    def _load(self, ns: Any, keys: Sequence[str], pages: list[Runs]) -> list[bool]:
        """One lookup, then one load of the prefix held into ``pages``; per page, whether it
        came whole and verified. A load that fails is a miss (SGLang asks again later)."""
        if not keys:
            return []
        loaded = 0
        try:
            hashes = _hashes(ns, keys)
            table = self._cm.copy_table(hashes)
            held = table.prefix()
            if held:
                match = Match(held * KEY_TOKENS,
                              Blocks(hashes[:held], table.head(held), self._cm.node_id))
                loaded = ns.load_to(PageSink(pages[:held]), None, match)
        except Exception as exc:  # noqa: BLE001 - SGLang takes False as a miss
            log.warning("%d pages not loaded: %s", len(keys), exc)
        return [i < loaded for i in range(len(keys))]

    def _store(self, ns: Any, keys: Sequence[str], pages: list[Runs],
               parent: str | None) -> list[bool]:
        """One store of ``pages`` (each block's parent the page before it, the first's
        ``parent``, SGLang's key of the page before the run); per page, whether the service
        holds it now."""
        if not keys:
            return []
        hashes = _hashes(ns, keys)
        parents: list[BlockHash | None] = [
            _hashes(ns, [parent])[0] if parent is not None else None, *hashes[:-1]]
        refused: set[bytes] = set()
        try:
            handle = store_into_dram(self._cm, ns.layout, hashes, parents, PageSource(pages),
                                     ns.namespace.id, f"sglang:{uuid.uuid4().hex}",
                                     ns.replication)
            committed = handle.wait()
            refused = set(handle.refused)
            if refused:
                log.warning("%d of %d pages not stored: the service refused their commit",
                            len(refused), len(keys))
            elif committed == len(keys):
                return [True] * len(keys)
        except Exception as exc:  # noqa: BLE001 - SGLang takes False as "not stored"
            log.warning("%d pages not stored whole: %s", len(keys), exc)
        # Some were not committed now: held before, given no slot, refused; the directory tells.
        try:
            held = _present(self._cm, ns, keys)
        except Exception as exc:  # noqa: BLE001
            log.warning("the directory did not answer: %s", exc)
            return [False] * len(keys)
        return [h and key not in refused for h, key in zip(held, hashes)]

    # -- namespaces ------------------------------------------------------------------------------

    def _bind(self, name: str, pool: Any) -> None:
        pages = HostPages.of(pool)
        with self._lock:
            if name == KV and self._page_bytes and pages.page_bytes != self._page_bytes:
                raise LayoutMismatchError(f"the host pool's pages are {pages.page_bytes} bytes, "
                                          f"configured {self._page_bytes}")
            model = self._identity(pages.kind, name, pages.order, getattr(pool, "dtype", None))
            ns = self._cm.namespace(model, page_layout(pages.page_bytes), self._salt)
            self._pools[name] = _Pool(pages, ns)
            if name == KV:
                self._page_bytes = pages.page_bytes

    def _pool(self, name: str) -> _Pool:
        with self._lock:
            pool = self._pools.get(name)
        if pool is None:
            raise BlockStateError(f"no host pool {name!r} was registered with this storage")
        return pool

    def _kv_namespace(self, page_bytes: int | None = None) -> Any:
        """The namespace of the anchor pool's pages: the registered pool's, else the one of
        pages handed over as tensors (made for ``page_bytes``; None: only if made already)."""
        with self._lock:
            pool = self._pools.get(KV)
        if pool is None:
            return self._tensor_namespace(page_bytes) if page_bytes else self._tensors
        if page_bytes is not None and page_bytes != pool.pages.page_bytes:
            raise LayoutMismatchError(f"page of {page_bytes} bytes, the host pool's are "
                                      f"{pool.pages.page_bytes}")
        return pool.ns

    def _tensor_namespace(self, page_bytes: int) -> Any:
        with self._lock:
            if self._tensors is None:
                if self._page_bytes and page_bytes != self._page_bytes:
                    raise LayoutMismatchError(f"page of {page_bytes} bytes, configured "
                                              f"{self._page_bytes}")
                self._page_bytes = page_bytes
                self._tensors = self._cm.namespace(self._identity(None), page_layout(page_bytes),
                                                   self._salt)
            elif page_bytes != self._page_bytes:
                raise LayoutMismatchError(f"page of {page_bytes} bytes, this storage's pages "
                                          f"are {self._page_bytes}")
            return self._tensors

    def _identity(self, kind: str | None, pool: str = KV, order: str = "",
                  dtype: Any = None) -> str:
        """Who may read a pool's pages: the model, and each rank of it whose pages differ (the
        tensor-parallel rank unless an MLA model's MLA pool, which every rank holds whole; the
        pipeline stage; the context-parallel rank), the pool, its pages' byte order and their
        element type (pages of bfloat16 and float16, or of two fp8 kinds, are the same size)."""
        c = self._config
        name = self._model
        if not (c.is_mla_model and kind != "mha"):
            name += f"@tp{c.tp_rank}/{c.tp_size}"
        if c.pp_size > 1:
            name += f"@pp{c.pp_rank}/{c.pp_size}"
        if c.attn_cp_size > 1:
            name += f"@cp{c.attn_cp_rank}/{c.attn_cp_size}"
        if pool != KV:
            name += f"@{pool}"
        if dtype is not None:
            name += f"@{str(dtype).removeprefix('torch.')}"
        return f"{name}@{order}" if order else name


def prefix_hits(kv_pages: int, transfers: Sequence[PoolTransfer],
                present: Callable[[PoolTransfer], list[bool]]) -> PoolTransferResult:
    """``batch_exists_v2``'s answer: of the first ``kv_pages`` pages (the KV prefix held),
    the prefix lengths every pool can restore, and the longest. ``present(t)`` says which of
    those pages pool ``t.name`` holds. ALL_PAGES: a prefix needs each of its pages in the
    pool; TRAILING_PAGES: only its last ``len(t.keys)`` (at least one)."""
    hits: dict[Any, int] = {PoolName.KV: kv_pages} if kv_pages else {}
    usable = set(range(1, kv_pages + 1))
    for t in transfers:
        if not usable:
            break
        have = present(t)
        if t.hit_policy == PoolHitPolicy.ALL_PAGES:
            window = kv_pages
        elif t.hit_policy == PoolHitPolicy.TRAILING_PAGES:
            window = max(1, len(t.keys or []))
        else:
            raise ValueError(f"pool {t.name}: hit policy {t.hit_policy} is not supported")
        ok = {p for p in usable if all(have[max(0, p - window) : p])}
        if ok:
            hits[t.name] = max(ok)
        usable &= ok
    return PoolTransferResult(max(usable, default=0), hits, sorted(usable))


def _hashes(ns: Any, keys: Sequence[str]) -> list[BlockHash]:
    """Each page's block key: its own one-block sequence, chained from the namespace alone."""
    return [ns.keys(key_tokens(k))[0] for k in keys]


def _present(cm: Any, ns: Any, keys: Sequence[str]) -> list[bool]:
    """Which of ``keys`` the directory holds a copy of (one lookup)."""
    if not keys:
        return []
    return [bool(n) for n in cm.copy_table(_hashes(ns, keys)).counts.tolist()]


def _last(extra_info: HiCacheStorageExtraInfo | None) -> str | None:
    """SGLang's key of the page before a run, where it names it."""
    prefix = extra_info.prefix_keys if extra_info is not None else None
    return prefix[-1] if prefix else None


def _nbytes(page: Any) -> int:
    return int(page.numel() * page.element_size())
