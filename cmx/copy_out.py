"""The client's copy out: blocks from shared-memory slots into the caller's KV tensor, each
checked against its checksum on the way, in the same pass.

A block's payload is copied in pieces of about ``PIECE_BYTES`` (whole layers, or whole heads
for head-major payloads), and each piece is fed to the block's checksum right after it was
copied, while it is still in the CPU's cache: verifying costs the hash, not a second read of
the block from memory. A block whose checksum fails is not used: its place in the tensor is
zeroed (its bytes landed before the check could fail), the copy stops there and reports how
many blocks before it were whole, and the caller returns only those.

``empty_kv`` allocates the tensor a load fills on transparent huge pages where the kernel
offers them (``madvise``): here a fresh 64 MiB tensor took 18-20 ms to fill on 4 KiB pages
(each page faulted in on first touch) and 4-6 ms on 2 MiB pages.
"""

from __future__ import annotations

import logging
import mmap
from collections.abc import Sequence
from typing import Any

import numpy as np

from cmx.checksum import ChecksumStream
from cmx.keys import BlockHash
from cmx.layout import KVLayout, PayloadOrder
from cmx.protocol import Loaded
from cmx.storage.arena import SharedArena

__all__ = ["PIECE_BYTES", "copy_block", "copy_payloads", "copy_verified", "empty_kv"]

log = logging.getLogger(__name__)

PIECE_BYTES = 512 << 10  # half of one core's L2 here: the piece is hashed before it leaves it
HUGE_MIN_BYTES = 4 << 20  # smaller tensors come from torch's own allocator


def empty_kv(layout: KVLayout, tokens: int) -> Any:
    """An uninitialised [layers, 2, kv_heads, tokens, head_dim] tensor; a large one on
    transparent huge pages where the kernel allows it (freed with the tensor)."""
    import torch

    nbytes = tokens * layout.token_bytes
    if nbytes < HUGE_MIN_BYTES or not hasattr(mmap, "MADV_HUGEPAGE"):
        return torch.empty(layout.shape(tokens), dtype=layout.torch_dtype())
    mm = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        mm.madvise(mmap.MADV_HUGEPAGE)
    except OSError:  # THP off ("never"): 4 KiB pages, as torch.empty would give
        pass
    raw = torch.from_numpy(np.frombuffer(mm, dtype=np.uint8))
    return raw.view(layout.torch_dtype()).reshape(layout.shape(tokens))


def copy_block(layout: KVLayout, payload: np.ndarray, dst: Any, want: int | None) -> bool:
    """Copy one block's payload into ``dst`` (its [L, 2, H, T, D] place in a KV tensor), piece
    by piece, each hashed right after it was copied; whether its checksum is ``want``
    (``None``: not checked, True)."""
    src = layout.from_payload(payload)
    # The payload's outermost dimension, as it appears in the [L, 2, H, T, D] view.
    outer, count = (0, layout.num_layers) if layout.order is PayloadOrder.LAYER_MAJOR \
        else (2, layout.num_kv_heads)
    unit = layout.block_bytes // count
    step = max(1, PIECE_BYTES // unit)
    stream = ChecksumStream() if want is not None else None
    for a in range(0, count, step):
        n = min(step, count - a)
        dst.narrow(outer, a, n).copy_(src.narrow(outer, a, n))
        if stream is not None:
            stream.feed(payload[a * unit : (a + n) * unit])
    return stream is None or stream.value() == want


def copy_payloads(layout: KVLayout, payloads: Sequence[tuple[BlockHash, np.ndarray, int]],
                  out: Any, first: int, verify: bool = True) -> int:
    """Copy block payloads (key, bytes, checksum) into ``out`` from block ``first``, each
    checked as it is copied; stops at the first that fails. How many were copied whole.
    ``verify=False`` skips the checks: only to measure what they cost."""
    T = layout.block_tokens
    for i, (key, payload, want) in enumerate(payloads):
        dst = out[:, :, :, (first + i) * T : (first + i + 1) * T]
        if not copy_block(layout, payload, dst, want if verify else None):
            dst.zero_()  # its bytes landed before the check failed: none of them stay
            log.warning("block %s failed its checksum where it was used", key.hex()[:12])
            return i
    return len(payloads)


def copy_verified(layout: KVLayout, arena: SharedArena, blocks: Sequence[Loaded], out: Any,
                  first: int, verify: bool = True) -> tuple[int, list[Loaded]]:
    """Copy the blocks of a load out of ``arena`` into ``out`` (from block ``first``), each
    checked as it is copied; stops at the first that fails. Returns (blocks copied whole,
    the corrupt one if any)."""
    payloads = [(b.key, arena.slot_view(b.slot)[: b.size], b.checksum) for b in blocks]
    n = copy_payloads(layout, payloads, out, first, verify)
    return n, list(blocks[n : n + 1])
