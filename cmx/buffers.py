"""Byte buffers: views over numpy arrays, torch tensors and bytes, page-aligned allocation, and
the copy that moves a block between host buffers.

O_DIRECT needs buffers aligned to the logical block size; we align everything we allocate to
the 4 KiB page so the same buffer can go to disk, to NIXL and to a shared-memory arena.
"""

from __future__ import annotations

import functools
import mmap
import os
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Union

import numpy as np

__all__ = [
    "ALIGN",
    "Buffer",
    "align_up",
    "aligned_empty",
    "as_bytes_view",
    "copy_bytes",
    "is_aligned",
]

ALIGN = 4096

Buffer = Union[bytes, bytearray, memoryview, np.ndarray, Any]  # noqa: UP007 - a runtime alias


def align_up(n: int, align: int = ALIGN) -> int:
    return (n + align - 1) // align * align


def as_bytes_view(data: Buffer) -> np.ndarray:
    """A flat uint8 numpy view of ``data`` without copying (torch CPU tensors included)."""
    if isinstance(data, np.ndarray):
        arr = data
    elif hasattr(data, "__dlpack__") and not isinstance(data, (bytes, bytearray, memoryview)):
        import torch

        if not isinstance(data, torch.Tensor):
            raise TypeError(f"unsupported buffer type {type(data).__name__}")
        if data.device.type != "cpu":
            raise TypeError("a CPU buffer is required here; move device tensors through the agent")
        t = data.detach()
        if not t.is_contiguous():
            raise ValueError("tensor must be contiguous")
        arr = t.reshape(-1).view(torch.uint8).numpy() if t.numel() else np.empty(0, np.uint8)
    else:
        arr = np.frombuffer(data, dtype=np.uint8)
    if not arr.flags.c_contiguous:
        raise ValueError("buffer must be C-contiguous")
    return arr.reshape(-1).view(np.uint8)


def aligned_empty(nbytes: int) -> np.ndarray:
    """A page-aligned uint8 array of ``nbytes`` (anonymous mmap; freed with the array)."""
    size = max(align_up(nbytes), ALIGN)
    mm = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return np.frombuffer(mm, dtype=np.uint8, count=nbytes)


def is_aligned(arr: np.ndarray, align: int = ALIGN) -> bool:
    return arr.ctypes.data % align == 0


# One core's memcpy does not reach the memory's bandwidth: here numpy copies 32 MiB blocks at
# 11-12 GB/s on one thread and 15-16 GB/s split over two. Below PARALLEL_MIN_BYTES the hand-off
# to another thread costs more than it saves.
PARALLEL_MIN_BYTES = 8 << 20
_PIECE_MIN_BYTES = 4 << 20


@functools.cache
def _copy_pool() -> tuple[ThreadPoolExecutor, int] | None:
    """Threads to copy beside the caller (one fewer than its cores), and how many; None on
    one core."""
    helpers = len(os.sched_getaffinity(0)) - 1
    if helpers == 0:
        return None
    return ThreadPoolExecutor(helpers, thread_name_prefix="cmx-copy"), helpers


def copy_bytes(dst: np.ndarray, src: np.ndarray) -> None:
    """``dst[:] = src`` for flat uint8 arrays of one size; a large copy is split over the
    cores this process may run on (numpy releases the GIL while it copies)."""
    if dst.shape != src.shape:
        raise ValueError(f"copy of {src.nbytes} bytes into {dst.nbytes}")
    n = src.nbytes
    helpers = _copy_pool() if n >= PARALLEL_MIN_BYTES else None
    if helpers is None:
        np.copyto(dst, src)
        return
    pool, count = helpers
    parts = min(count + 1, n // _PIECE_MIN_BYTES)
    piece = align_up(-(-n // parts))
    futures = [pool.submit(np.copyto, dst[i:i + piece], src[i:i + piece])
               for i in range(piece, n, piece)]
    np.copyto(dst[:piece], src[:piece])
    for future in futures:
        future.result()
