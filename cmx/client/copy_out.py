"""The client's copy out: blocks from shared-memory slots into the caller's KV tensor, each
checked against its checksum on the way, in the same pass.

A block's payload is copied in pieces of about ``PIECE_BYTES`` (whole layers, or whole heads
for head-major payloads), and each piece is fed to the block's checksum right after it was
copied, while it is still in the CPU's cache: verifying costs the hash, not a second read of
the block from memory. A block whose checksum fails is not used: its place in the tensor is
zeroed (its bytes landed before the check could fail), the copy stops there and reports how
many blocks before it were whole, and the caller returns only those.

``empty_kv`` allocates the tensor a load fills, on 4 KiB pages. Transparent huge pages were
tried and measured here: a 2 GiB tensor was touched in 0.10 s of CPU when the kernel had
freed huge pages at hand, but in 4.9 s when it had to find fresh ones (the client spent
4.8-5.0 s of CPU on each 2 GiB load in ``cmx bench service`` with them), against
0.72-0.77 s on 4 KiB pages every time.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import numpy as np

from cmx.checksum import ChecksumStream
from cmx.keys import BlockHash
from cmx.layout import KVLayout, PayloadOrder
from cmx.protocol import Loaded
from cmx.storage.arena import SharedArena

__all__ = [
    "PIECE_BYTES", "copy_block", "copy_payloads", "copy_verified", "empty_kv", "kv_array",
]

log = logging.getLogger(__name__)

PIECE_BYTES = 512 << 10  # half of one core's L2 here: the piece is hashed before it leaves it


def empty_kv(layout: KVLayout, tokens: int) -> Any:
    """An uninitialised [layers, 2, kv_heads, tokens, head_dim] tensor."""
    import torch

    return torch.empty(layout.shape(tokens), dtype=layout.torch_dtype())


def copy_block(layout: KVLayout, payload: np.ndarray, dst: np.ndarray, want: int | None) -> bool:
    """Copy one block's payload into ``dst`` (its [L, 2, H, T, D] place in a KV tensor, as
    ``kv_array`` gives it), piece by piece, each hashed right after it was copied; whether
    its checksum is ``want`` (``None``: not checked, True)."""
    src = payload.view(dst.dtype).reshape(layout.payload_shape)
    if layout.order is PayloadOrder.LAYER_MAJOR:
        outer, count = 0, layout.num_layers  # the payload's outermost dimension, in dst
    else:
        src, outer, count = src.transpose(1, 2, 0, 3, 4), 2, layout.num_kv_heads
    unit = layout.block_bytes // count
    step = max(1, PIECE_BYTES // unit)
    stream = ChecksumStream() if want is not None else None
    index: list[slice] = [slice(None)] * 5
    for a in range(0, count, step):
        n = min(step, count - a)
        index[outer] = slice(a, a + n)
        np.copyto(dst[tuple(index)], src[tuple(index)])
        if stream is not None:
            stream.feed(payload[a * unit : (a + n) * unit])
    return stream is None or stream.value() == want


def kv_array(kv: Any) -> np.ndarray:
    """A numpy view of a CPU KV tensor, its elements as integers of their size: numpy copies
    them on the calling thread, where torch's ``copy_`` would wake its OpenMP threads for
    every piece (here they spun for 4-50x the CPU time of the copy itself on a busy machine)."""
    import torch

    ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32}[kv.element_size()]
    return kv.view(ints).numpy()


def copy_payloads(layout: KVLayout, payloads: Sequence[tuple[BlockHash, np.ndarray, int]],
                  out: Any, first: int, verify: bool = True) -> int:
    """Copy block payloads (key, bytes, checksum) into ``out`` from block ``first``, each
    checked as it is copied; stops at the first that fails. How many were copied whole.
    ``verify=False`` skips the checks: only to measure what they cost."""
    T = layout.block_tokens
    dst = kv_array(out)
    for i, (key, payload, want) in enumerate(payloads):
        place = dst[:, :, :, (first + i) * T : (first + i + 1) * T]
        if not copy_block(layout, payload, place, want if verify else None):
            place.fill(0)  # its bytes landed before the check failed: none of them stay
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
