"""A prefix of Llama-3-8B KV cache in an NvmeStore, as the peer suites store, load and reopen it.

The geometry is the one LMCache is given in the same suites (32 layers, 8 KV heads, head_dim
128, bfloat16), in head-major blocks, so that one KV head of a block is one contiguous run.
Stores are ``put_many`` (256 MiB of blocks per call) then ``flush``; loads are one
``get_many_into`` of the prefix, each block straight into its own page-aligned slot of a
destination faulted in beforehand (what an arena slot is), 16 reads of 4 MiB in flight.
"""

from __future__ import annotations

import multiprocessing
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from cmx.keys import BlockHash, Namespace, chain_keys
from cmx.layout import KVLayout, PayloadOrder

if TYPE_CHECKING:
    from cmx.storage import NvmeStore

__all__ = [
    "GEOMETRY",
    "MODEL",
    "head_runs",
    "hits_after_restart",
    "llama_layout",
    "load_into",
    "open_store",
    "prefix_keys",
    "put_prefix",
    "store_capacity",
]

MODEL = "meta-llama/Meta-Llama-3-8B"
GEOMETRY = {"num_layers": 32, "num_kv_heads": 8, "head_dim": 128, "dtype": "bfloat16"}
PUT_BATCH_BYTES = 256 << 20  # of blocks per put_many call


def llama_layout(block_tokens: int, order: PayloadOrder = PayloadOrder.HEAD_MAJOR) -> KVLayout:
    # The ignore below: GEOMETRY's values are typed as one union
    return KVLayout(**GEOMETRY, block_tokens=block_tokens, order=order)  # type: ignore[arg-type]


def prefix_keys(layout: KVLayout, blocks: int, seed: int) -> list[BlockHash]:
    """Keys of ``blocks`` full blocks of random token ids, chained in ``layout``'s namespace."""
    tokens = np.random.default_rng(seed).integers(0, 128_256, size=blocks * layout.block_tokens)
    return chain_keys(Namespace(MODEL, layout).digest, tokens, layout.block_tokens)


def store_capacity(blocks: int, block_bytes: int) -> int:
    return blocks * block_bytes + blocks * block_bytes // 4 + block_bytes


def open_store(root: Path | str, blocks: int, block_bytes: int) -> NvmeStore:
    from cmx.storage import NvmeStore

    return NvmeStore(root, capacity_bytes=store_capacity(blocks, block_bytes),
                     block_bytes=block_bytes)


def put_prefix(store: NvmeStore, keys: list[BlockHash], pool: list[np.ndarray]) -> None:
    """Put every block in prefix order (payloads cycle through ``pool``), then flush."""
    batch = max(1, PUT_BATCH_BYTES // pool[0].nbytes)
    for start in range(0, len(keys), batch):
        items = [(keys[i], pool[i % len(pool)], keys[i - 1] if i else None)
                 for i in range(start, min(len(keys), start + batch))]
        for i, stored in enumerate(store.put_many(items), start):
            if not stored:
                raise AssertionError(f"NvmeStore refused block {i} ({keys[i].hex()[:12]})")
    store.flush()


def load_into(store: NvmeStore, keys: list[BlockHash], dest: np.ndarray) -> None:
    """Read block ``i`` into ``dest[i * block : (i + 1) * block]``; AssertionError on a miss."""
    block = dest.nbytes // len(keys)
    slots = [dest[i * block:(i + 1) * block] for i in range(len(keys))]
    for i, hit in enumerate(store.get_many_into(keys, slots)):
        if not hit:
            raise AssertionError(f"NvmeStore lost block {i} ({keys[i].hex()[:12]})")


def head_runs(layout: KVLayout, keys: list[BlockHash],
              head: int) -> list[tuple[BlockHash, int, int]]:
    """One KV head, every layer and token, of every block: ``read_runs`` requests."""
    runs = layout.slice_runs(heads=range(head, head + 1))
    return [(key, off, length) for key in keys for off, length in runs]


def _reopen_hits(root: str, blocks: int, block_bytes: int,
                 keys: list[bytes]) -> tuple[int, float]:
    """In a fresh process: reopen the store; how many of ``keys`` it finds, seconds to open."""
    t0 = time.perf_counter()
    store = open_store(root, blocks, block_bytes)
    seconds = time.perf_counter() - t0
    try:
        return sum(1 for k in keys if k in store), seconds
    finally:
        store.close()


def hits_after_restart(root: Path, blocks: int, block_bytes: int, keys: list[BlockHash],
                       timeout: float = 300.0) -> tuple[int, float]:
    """Hits among ``keys`` of the closed store at ``root`` reopened by a new process."""
    ctx = multiprocessing.get_context("spawn")  # a new interpreter: nothing inherited
    with ProcessPoolExecutor(1, mp_context=ctx) as pool:
        future = pool.submit(_reopen_hits, str(root), blocks, block_bytes, list(keys))
        return future.result(timeout=timeout)
