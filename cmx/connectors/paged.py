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
from collections.abc import Sequence
from typing import TYPE_CHECKING

from cmx.errors import LayoutMismatchError

if TYPE_CHECKING:
    import torch

__all__ = ["PagedLayout", "block_view", "gather_layer", "scatter_layer"]


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
