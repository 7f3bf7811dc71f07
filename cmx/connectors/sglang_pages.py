"""Pages of SGLang's host KV pool as the service's blocks, moved where they lie.

A page is one block (``cmx.connectors.sglang``); its bytes are SGLang's flat data page, in the
order ``HostKVCache.get_data_page(index, flat=True)`` gives them for the pool's layout, so a
pool's pages read the same through the batch interface and through ``get``/``set``. That
order is the pool's own (``FLAT_ORDERS``): token-major for ``page_first``, layer-major for
``layer_first`` and ``page_first_direct``, head-major for ``page_head``; the namespace of a
pool's pages names it, so a pool never reads a page written in another order.

``HostPages`` checks a pool once, when SGLang registers it, and then sees each page as the
runs of bytes it is made of in the pool's buffer (views, never copies: a page of a
``layer_first`` pool is 2 x layers runs of ``page_size`` tokens). ``PageSource`` copies
pages from those runs straight into the DRAM slots a store was granted, hashing each piece
right after it is copied; ``PageSink`` writes a load's blocks straight from the service's
shared memory into them. Each byte crosses SGLang's process once, either way.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from cmx.checksum import Checksum, ChecksumStream
from cmx.client import copy_out
from cmx.client.copy_out import kv_bytes
from cmx.errors import LayoutMismatchError

__all__ = ["FLAT_ORDERS", "HostPages", "HostPoolError", "PageSink", "PageSource", "Runs",
           "byte_runs", "tensor_runs"]

# The pools whose pages move, by kind, and the byte order of a flat page of each layout they
# offer on a host; the others (page_unified, the NPU's page_first_kv_split) are refused.
FLAT_ORDERS = {
    "mha": {"layer_first": "layer-major", "page_first": "token-major",
            "page_first_direct": "layer-major", "page_head": "head-major"},
    "mla": {"layer_first": "layer-major", "page_first": "token-major",
            "page_first_direct": "layer-major"},
}

Runs = list[np.ndarray]  # a page as the 1-D byte views it is made of, in flat-page order


class HostPoolError(LayoutMismatchError):
    """A host pool whose pages this backend cannot move: another class of pool, a layout
    outside ``FLAT_ORDERS``, pages not on the host, or pages that are not views of its
    buffer. Raised when SGLang registers the pool, so the storage is never attached."""


@dataclass(frozen=True)
class HostPages:
    """A registered host pool: its kind (``mha``/``mla``), page geometry and byte order."""

    pool: Any  # SGLang's HostKVCache
    kind: str
    page_tokens: int
    page_bytes: int
    order: str  # of its flat pages: FLAT_ORDERS

    @classmethod
    def of(cls, pool: Any) -> HostPages:
        """The pool's pages, or HostPoolError saying why they cannot be moved."""
        kind = _kind(pool)
        layout = getattr(pool, "layout", None)
        orders = FLAT_ORDERS[kind]
        if layout not in orders:
            raise HostPoolError(f"{type(pool).__name__} with layout {layout!r}: supported "
                                f"layouts are {sorted(orders)}")
        if getattr(pool, "dcp_size", 1) != 1:
            raise HostPoolError(f"a pool of a decode context-parallel rank (dcp_size "
                                f"{pool.dcp_size}) holds a shard of each page")
        buffer = getattr(pool, "kv_buffer", None)
        if buffer is None or buffer.device.type != "cpu":
            raise HostPoolError(f"{type(pool).__name__} has no KV buffer in host memory")
        page_bytes = int(pool.get_size_per_token()) * int(pool.page_size)
        first = pool.get_data_page(0, flat=False)
        if first.untyped_storage().data_ptr() != buffer.untyped_storage().data_ptr():
            raise HostPoolError(f"{type(pool).__name__}'s pages are not views of its buffer")
        if first.numel() * first.element_size() != page_bytes:
            raise HostPoolError(f"a page of {type(pool).__name__} is "
                                f"{first.numel() * first.element_size()} bytes, its geometry "
                                f"says {page_bytes}")
        return cls(pool, kind, int(pool.page_size), page_bytes, orders[layout])

    def starts(self, pages: int, host_indices: Any) -> list[int]:
        """The first slot of each of ``pages`` pages whose slots are ``host_indices``
        (``pages * page_tokens`` of them, a page's consecutive, as SGLang allocates them)."""
        n = 0 if host_indices is None else int(host_indices.numel())
        if n != pages * self.page_tokens:
            raise LayoutMismatchError(f"{pages} pages of {self.page_tokens} tokens, got {n} "
                                      f"host indices")
        return [int(i) for i in host_indices[:: self.page_tokens].tolist()]

    def runs(self, start: int) -> Runs:
        """The page whose first slot is ``start``, as views of the pool's buffer."""
        return byte_runs(kv_bytes(self.pool.get_data_page(start, flat=False)))


def byte_runs(page: np.ndarray) -> Runs:
    """``page`` (a strided view) as its contiguous runs of bytes, in its index order: the
    sub-arrays over its leading dimensions up to the first whose sub-arrays are contiguous
    (strides are uniform, so the first sub-array tells)."""
    lead = 0
    while not page[(0,) * lead].flags.c_contiguous:
        lead += 1
    return [page[index].reshape(-1) for index in np.ndindex(*page.shape[:lead])]


def tensor_runs(page: Any, page_bytes: int, target: bool = False) -> Runs:
    """A page handed over as a tensor of its own (SGLang's generic path), as one run; a
    LayoutMismatchError for one of another size. A page to store may lie anywhere (it is
    brought here whole); one to load into (``target``) must be contiguous in host memory."""
    if target and (page.device.type != "cpu" or not page.is_contiguous()):
        raise LayoutMismatchError(f"a page is loaded into a contiguous host tensor, got one on "
                                  f"{page.device}, strides {page.stride()}")
    flat = kv_bytes(page.detach().contiguous().cpu()).reshape(-1)
    if flat.size != page_bytes:
        raise LayoutMismatchError(f"a page is {page_bytes} bytes, got {flat.size}")
    return [flat]


class PageSource:
    """Pages as a store's blocks (``cmx.client.stores.Source``): block ``i`` is ``pages[i]``,
    copied from where it lies into its slot a piece of at most ``PIECE_BYTES`` at a time,
    each piece hashed right after it is copied (the hash is the source's, never the slot's)."""

    def __init__(self, pages: Sequence[Runs]) -> None:
        self.pages = pages
        self.blocks = len(pages)

    def copy_block(self, i: int, slot: np.ndarray) -> Checksum:
        stream = ChecksumStream()
        at = 0
        for run in self.pages[i]:
            for a in range(0, run.size, copy_out.PIECE_BYTES):
                piece = run[a : a + copy_out.PIECE_BYTES]
                np.copyto(slot[at : at + piece.size], piece)
                stream.feed(piece)
                at += piece.size
        return stream.value()


class PageSink:
    """Pages as where a load's blocks land (``cmx.client.copy_out.Sink``): block ``i`` into
    ``pages[i]``. A page's layout is one layer, so each block comes whole, from the service's
    shared memory; one that fails its checksum is zeroed, never left half written."""

    itemsize = 1

    def __init__(self, pages: Sequence[Runs]) -> None:
        self.pages = pages
        self.blocks = len(pages)

    def put(self, i: int, index: tuple[slice, ...], src: np.ndarray) -> None:
        self._write(i, src.reshape(-1))

    def put_run(self, i: int, rows: np.ndarray) -> None:
        for j, row in enumerate(rows):
            self._write(i + j, row)

    def clear(self, i: int) -> None:
        for run in self.pages[i]:
            run.fill(0)

    def _write(self, i: int, block: np.ndarray) -> None:
        runs = self.pages[i]
        if block.size != sum(run.size for run in runs):
            raise LayoutMismatchError(f"a block of {block.size} bytes for a page of "
                                      f"{sum(run.size for run in runs)}")
        at = 0
        for run in runs:
            np.copyto(run, block[at : at + run.size])
            at += run.size


def _kind(pool: Any) -> str:
    """``mha`` or ``mla`` for SGLang's two KV host pools (exactly those classes: a subclass
    may keep its pages otherwise); HostPoolError for any other."""
    from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
    from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost

    kinds = {MHATokenToKVPoolHost: "mha", MLATokenToKVPoolHost: "mla"}
    if type(pool) not in kinds:
        raise HostPoolError(f"{type(pool).__name__}: the pages this backend moves are those "
                            f"of {sorted(k.__name__ for k in kinds)}")
    return kinds[type(pool)]
