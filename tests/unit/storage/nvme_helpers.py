"""Helpers shared by the NvmeStore tests: deterministic keys and payloads, small stores."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import numpy as np

from cmx.buffers import aligned_empty
from cmx.storage.nvme import NvmeStore

KiB = 1024
BLOCK = 256 * KiB  # two 128 KiB checksum chunks per block


def key(i: int, salt: bytes = b"") -> bytes:
    return hashlib.blake2b(salt + i.to_bytes(8, "little"), digest_size=32).digest()


def payload(k: bytes, n: int) -> np.ndarray:
    """The bytes a test stores under ``k``: derived from the key alone."""
    rng = np.random.default_rng(int.from_bytes(k[:8], "little"))
    return rng.integers(0, 256, n, dtype=np.uint8)


def aligned_payload(k: bytes, n: int) -> np.ndarray:
    """``payload(k, n)`` in a page-aligned buffer (the zero-copy write path)."""
    buf = aligned_empty(n)
    buf[:] = payload(k, n)
    return buf


def open_store(root: Path | str, **kwargs: object) -> NvmeStore:
    """A small store that splits blocks into several I/Os, so tests exercise batching."""
    opts: dict[str, object] = dict(
        capacity_bytes=16 * BLOCK, block_bytes=BLOCK, io_engine="threads", queue_depth=4,
        io_bytes=64 * KiB,
    )
    opts.update(kwargs)
    return NvmeStore(root, **opts)  # type: ignore[arg-type]


def segment_files(root: Path | str) -> list[str]:
    return sorted(n for n in os.listdir(root) if n.startswith("seg-") and n.endswith(".dat"))


def disk_bytes(root: Path | str) -> int:
    return sum(os.path.getsize(os.path.join(root, n)) for n in segment_files(root))
