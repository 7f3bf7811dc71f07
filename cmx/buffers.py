"""Byte buffers: views over numpy arrays, torch tensors and bytes, and page-aligned allocation.

O_DIRECT needs buffers aligned to the logical block size; we align everything we allocate to
the 4 KiB page so the same buffer can go to disk, to NIXL and to a shared-memory arena.
"""

from __future__ import annotations

import mmap
from typing import Any, Union

import numpy as np

__all__ = ["ALIGN", "Buffer", "align_up", "aligned_empty", "as_bytes_view", "is_aligned"]

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
