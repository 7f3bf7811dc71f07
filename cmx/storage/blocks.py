"""Values and input checks shared by the block stores: reservations, block metadata.

Every check runs before a store changes anything, so bad input raises and leaves no trace.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from cmx.buffers import Buffer, as_bytes_view
from cmx.errors import BlockTooLargeError, InvalidKeyError
from cmx.keys import BlockHash, check_key

__all__ = [
    "BlockMeta",
    "OnEvict",
    "Reservation",
    "block_source",
    "check_block_keys",
    "check_checksum",
    "check_size",
]


@dataclass(frozen=True)
class BlockMeta:
    """What a tier above needs to demote an evicted block."""

    size: int  # payload bytes
    checksum: int | None  # XXH3-64 if it was given or computed, else None
    parent: BlockHash | None  # previous block of the same prefix


OnEvict = Callable[[BlockHash, np.ndarray, BlockMeta], None]


@dataclass(frozen=True, eq=False)
class Reservation:
    """Space held for one block: write ``buffer``, then the store's ``commit`` or ``abort``."""

    key: BlockHash
    parent: BlockHash | None
    slot: int
    buffer: np.ndarray  # writable view of the slot, block_bytes long
    id: int  # tells this reservation from an earlier one of the same key


def check_block_keys(key: object, parent: object) -> tuple[BlockHash, BlockHash | None]:
    """``key`` and ``parent`` as BlockHash; InvalidKeyError for a bad or self-referring key."""
    key = check_key(key)
    if parent is None:
        return key, None
    parent = check_key(parent)
    if parent == key:
        raise InvalidKeyError(f"block {key.hex()[:12]} cannot be its own parent")
    return key, parent


def block_source(data: Buffer, block_bytes: int) -> np.ndarray:
    """``data`` as a flat uint8 view (no copy); raise unless it is one buffer that fits."""
    try:
        src = as_bytes_view(data)
    except (ValueError, BufferError) as exc:
        raise ValueError(f"block data must be one C-contiguous buffer: {exc}") from exc
    if src.nbytes > block_bytes:
        raise BlockTooLargeError(f"block of {src.nbytes} bytes > block_bytes {block_bytes}")
    return src


def check_size(size: object, block_bytes: int) -> None:
    """Raise unless ``size`` is a payload size a block of ``block_bytes`` can hold."""
    if not isinstance(size, int) or isinstance(size, bool) or size < 0:
        raise ValueError(f"size must be an int >= 0, got {size!r}")
    if size > block_bytes:
        raise BlockTooLargeError(f"size {size} > block_bytes {block_bytes}")


def check_checksum(value: object) -> None:
    """Raise unless ``value`` is None or an XXH3-64 value (unsigned 64-bit int)."""
    if value is not None and (not isinstance(value, int) or not 0 <= value < 2**64):
        raise ValueError(f"checksum must be an unsigned 64-bit int or None, got {value!r}")
