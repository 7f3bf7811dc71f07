"""Gather and scatter between an engine's paged KV cache and the service's KV tensors.

An engine keeps each layer's KV in fixed-size pages ("blocks") addressed by block id. The
service speaks ``[layers, 2, kv_heads, tokens, head_dim]`` (``cmx.layout``): the tensor form of
consecutive block payloads, layer-major, then K/V, then head, token and dim. This module moves
whole blocks between the two, one layer at a time (so loads can run layer by layer), with one
indexed copy per layer for a whole batch of blocks, never one per block.

The engines' layouts of one layer's cache, each seen through ``block_view`` as
``[blocks, kv_heads, 2, block_size, head_dim]`` without a copy:

- ``VLLM_CPU``: vLLM's CPU backend, ``[blocks, kv_heads, block_size, 2 * head_dim]``; within a
  block and head the memory holds K for all of the block's tokens, then V.
- ``VLLM_FLASH``: vLLM 0.2x's GPU FlashAttention view, logically ``[blocks, kv_heads,
  block_size, 2 * head_dim]`` with any strides; each token's row is its K, then its V.
- ``FLASH``: FlashAttention's classic ``[2, blocks, block_size, kv_heads, head_dim]``.

Plain torch on whatever device the cache lives on: the same code runs on CPU and CUDA.
"""

from __future__ import annotations

import enum
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING

import numpy as np

from cmx.checksum import Checksum, ChecksumStream
from cmx.errors import LayoutMismatchError

if TYPE_CHECKING:
    import torch

    from cmx.layout import KVLayout

__all__ = ["LoadCancelled", "PagedLayout", "PagedSink", "PagedSource", "WriteGate",
           "block_view", "gather_layer", "scatter_layer"]


class PagedLayout(str, enum.Enum):
    VLLM_CPU = "vllm_cpu"
    VLLM_FLASH = "vllm_flash"
    FLASH = "flash"


def block_view(cache: torch.Tensor, layout: PagedLayout, head_dim: int) -> torch.Tensor:
    """One layer's paged cache as ``[blocks, kv_heads, 2, block_size, head_dim]``, a view."""
    layout = PagedLayout(layout)
    if layout is PagedLayout.FLASH:
        if cache.dim() != 5 or cache.shape[0] != 2 or cache.shape[-1] != head_dim:
            raise LayoutMismatchError(
                f"a FLASH cache is [2, blocks, block_size, kv_heads, {head_dim}], "
                f"got {tuple(cache.shape)}")
        return cache.permute(1, 3, 0, 2, 4)
    if cache.dim() != 4 or cache.shape[-1] != 2 * head_dim:
        raise LayoutMismatchError(
            f"a {layout.value} cache is [blocks, kv_heads, block_size, {2 * head_dim}], "
            f"got {tuple(cache.shape)}")
    blocks, heads, size, _ = cache.shape
    if layout is PagedLayout.VLLM_FLASH:
        return cache.unflatten(-1, (2, head_dim)).permute(0, 1, 3, 2, 4)
    # VLLM_CPU: the [block_size, 2 * head_dim] rows of a block and head are one [2, block_size,
    # head_dim] run in memory; only a cache whose rows are contiguous can be read that way.
    if cache.stride(3) != 1 or cache.stride(2) != 2 * head_dim:
        raise LayoutMismatchError(f"a vllm_cpu cache needs contiguous rows, strides "
                                  f"{cache.stride()}")
    return cache.as_strided((blocks, heads, 2, size, head_dim),
                            (cache.stride(0), cache.stride(1), size * head_dim, head_dim, 1),
                            cache.storage_offset())


def gather_layer(
    cache: torch.Tensor, layout: PagedLayout, block_ids: torch.Tensor | Sequence[int],
    out: torch.Tensor,
) -> None:
    """Copy blocks ``block_ids`` of one layer into ``out`` ``[2, kv_heads, n * block_size,
    head_dim]`` (one layer of the service's tensor form), in the order given."""
    head_dim = out.shape[-1]
    view = block_view(cache, layout, head_dim)
    ids = _ids(block_ids, view.shape[0], cache.device)
    n, size = len(ids), view.shape[3]
    _check_out(out, view, n)
    picked = view.index_select(0, ids)  # [n, heads, 2, size, dim]: the one indexed read
    dst = out.view(2, view.shape[1], n, size, head_dim)
    # Synchronous even from a GPU: the blocks may be reused once the engine's step ends.
    dst.copy_(picked.permute(2, 1, 0, 3, 4))


def scatter_layer(
    cache: torch.Tensor, layout: PagedLayout, block_ids: torch.Tensor | Sequence[int],
    src: torch.Tensor,
) -> None:
    """Write ``src`` ``[2, kv_heads, n * block_size, head_dim]`` (one layer of the service's
    tensor form) into blocks ``block_ids`` of one layer; the inverse of ``gather_layer``.

    Returns once the bytes are in the cache. On a GPU the copy is queued on the calling
    thread's stream, which the forward's stream does not wait for, so the stream is waited for
    here: a loader that says "written" (and lets attention read the blocks, or vLLM reuse
    them after a cancel) is then right."""
    head_dim = src.shape[-1]
    view = block_view(cache, layout, head_dim)
    ids = _ids(block_ids, view.shape[0], cache.device)
    n, size = len(ids), view.shape[3]
    _check_out(src, view, n)
    blocks = src.reshape(2, view.shape[1], n, size, head_dim).permute(2, 1, 0, 3, 4)
    view.index_copy_(0, ids, blocks.to(cache.device, non_blocking=True))  # one indexed write
    if cache.is_cuda:
        import torch

        torch.cuda.current_stream(cache.device).synchronize()


def _ids(
    block_ids: torch.Tensor | Sequence[int], blocks: int, device: torch.device
) -> torch.Tensor:
    import torch

    ids = torch.as_tensor(block_ids, dtype=torch.long, device="cpu")
    if ids.dim() != 1:
        raise LayoutMismatchError(f"block ids must be 1-D, got shape {tuple(ids.shape)}")
    # Checked here, on the host: an index out of range on a GPU is a device-side assert.
    if len(ids) and (int(ids.min()) < 0 or int(ids.max()) >= blocks):
        raise LayoutMismatchError(f"block ids must lie in [0, {blocks}), got "
                                  f"{int(ids.min())}..{int(ids.max())}")
    return ids.to(device, non_blocking=True)


def _check_out(kv: torch.Tensor, view: torch.Tensor, n: int) -> None:
    heads, size, dim = view.shape[1], view.shape[3], view.shape[4]
    expected = (2, heads, n * size, dim)
    if tuple(kv.shape) != expected:
        raise LayoutMismatchError(
            f"KV of {n} blocks is [2, kv_heads, tokens, head_dim] {expected}, "
            f"got {tuple(kv.shape)}")
    if kv.dtype != view.dtype:
        raise LayoutMismatchError(f"KV dtype {kv.dtype} != cache dtype {view.dtype}")
    if not kv.is_contiguous():
        raise LayoutMismatchError("KV of a layer must be contiguous")


class LoadCancelled(Exception):  # noqa: N818 - a state the loader ends in, not a fault
    """A load into the paged cache was cancelled: its blocks may belong to another request."""


class WriteGate:
    """Writers into blocks an engine may take back: each write enters and leaves; once
    ``close`` returns no write is inside and none enters again (it raises ``LoadCancelled``).
    Writes run side by side: only ``close`` waits, for those inside."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._inside = 0
        self.closed = False

    @contextmanager
    def enter(self) -> Iterator[None]:
        with self._cond:
            if self.closed:
                raise LoadCancelled("the load was cancelled")
            self._inside += 1
        try:
            yield
        finally:
            with self._cond:
                self._inside -= 1
                self._cond.notify_all()

    def close(self) -> None:
        with self._cond:
            self.closed = True
            self._cond.wait_for(lambda: self._inside == 0)


class PagedSink:
    """The blocks of one load written straight into an engine's paged cache on the host
    (``cmx.client.copy_out.Sink``): block ``i`` of the load to block ``block_ids[i]`` of every
    layer, from the shared-memory slots where the service holds it, checked in the same pass
    (each byte crosses the engine's process once; no host tensor between them). Every write
    goes through ``gate``: once it is closed, nothing more is written. CPU caches only; a GPU
    cache is written layer by layer from a host tensor (``scatter_layer``)."""

    def __init__(self, caches: Sequence[torch.Tensor], layout: PagedLayout, head_dim: int,
                 block_ids: Sequence[int], gate: WriteGate) -> None:
        from cmx.client.copy_out import kv_bytes

        if any(c.device.type != "cpu" for c in caches):
            raise LayoutMismatchError("a PagedSink writes host caches only")
        self.views = [kv_bytes(block_view(c, layout, head_dim)) for c in caches]
        self.ids = list(block_ids)
        blocks = self.views[0].shape[0] if self.views else 0
        if any(not 0 <= b < blocks for b in self.ids):
            raise LayoutMismatchError(f"block ids must lie in [0, {blocks}), got {self.ids}")
        self.itemsize = self.views[0].itemsize if self.views else 1
        self.blocks = len(self.ids)
        self.gate = gate

    def put(self, i: int, index: tuple[slice, ...], src: np.ndarray) -> None:
        layers = range(len(self.views))[index[0]]
        with self.gate.enter():
            for j, layer in enumerate(layers):
                # [kv_heads, 2, T, dim] of the paged block, seen as the payload's [2, kv_heads]
                place = self.views[layer][self.ids[i]].transpose(1, 0, 2, 3)
                np.copyto(place[index[1:]], src[j])

    def put_run(self, i: int, rows: np.ndarray) -> None:
        ids = np.asarray(self.ids[i : i + len(rows)])
        _, heads, two, size, dim = self.views[0].shape if self.views else (0, 0, 2, 0, 0)
        blocks = rows.reshape(len(rows), len(self.views), two, heads, size, dim)
        with self.gate.enter():
            for layer, view in enumerate(self.views):
                view[ids] = blocks[:, layer].transpose(0, 2, 1, 3, 4)

    def clear(self, i: int) -> None:
        with self.gate.enter():
            for view in self.views:
                view[self.ids[i]].fill(0)


class PagedSource:
    """The blocks of one save read straight from an engine's paged cache on the host
    (``cmx.client.stores.Source``): block ``i`` of the save is block ``block_ids[i]`` of every
    layer, gathered one layer (or one head) at a time into the slot's payload order and
    hashed as it goes, so each byte crosses the engine's process once on its way to the
    service's DRAM (no host tensor between them). Every read goes through ``gate``: once it
    is closed (vLLM reuses the blocks), nothing more is read."""

    def __init__(self, caches: Sequence[torch.Tensor], paged: PagedLayout,
                 layout: KVLayout, block_ids: Sequence[int], gate: WriteGate) -> None:
        from cmx.client.copy_out import kv_bytes

        if any(c.device.type != "cpu" for c in caches):
            raise LayoutMismatchError("a PagedSource reads host caches only")
        self.layout = layout
        self.views = [kv_bytes(block_view(c, paged, layout.head_dim)) for c in caches]
        self.ids = list(block_ids)
        self.blocks = len(self.ids)
        self.gate = gate

    def copy_block(self, i: int, slot: np.ndarray) -> Checksum:
        from cmx.layout import PayloadOrder

        L = self.layout
        dst = slot[: L.block_bytes].reshape(*L.payload_shape[:-1], -1)
        stream = ChecksumStream()
        with self.gate.enter():
            blocks = [view[self.ids[i]] for view in self.views]  # [kv_heads, 2, T, dim]
            if L.order is PayloadOrder.LAYER_MAJOR:
                pieces = (b.transpose(1, 0, 2, 3) for b in blocks)  # [2, kv_heads, T, dim]
            else:
                pieces = (np.stack([b[h] for b in blocks]) for h in range(L.num_kv_heads))
            for at, piece in enumerate(pieces):
                piece = np.ascontiguousarray(piece)  # gathered once, in the CPU's cache
                np.copyto(dst[at], piece)
                stream.feed(piece)
        return stream.value()
