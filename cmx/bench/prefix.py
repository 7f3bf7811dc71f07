"""A prefix of Llama-3-8B KV cache in an NvmeStore, as the peer suites store, load and reopen it.

The geometry is the one LMCache is given in the same suites (32 layers, 8 KV heads, head_dim
128, bfloat16), in head-major blocks, so that one KV head of a block is one contiguous run.
Loads read each block with ``get_into`` straight into its own page-aligned slot of a
destination faulted in beforehand (what an arena slot is), several blocks in flight.
"""

from __future__ import annotations

import multiprocessing
import time
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from cmx.keys import BlockHash, Namespace, chain_keys
from cmx.layout import KVLayout, PayloadOrder

if TYPE_CHECKING:
    from cmx.storage import NvmeStore

__all__ = [
    "GEOMETRY",
    "LOAD_THREADS",
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
LOAD_THREADS = 4  # blocks in flight during a load (LMCache's disk reads use 4 threads too)


def llama_layout(block_tokens: int, order: PayloadOrder = PayloadOrder.HEAD_MAJOR) -> KVLayout:
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
    parent = None
    for i, key in enumerate(keys):
        if not store.put(key, pool[i % len(pool)], parent=parent):
            raise AssertionError(f"NvmeStore refused block {i} ({key.hex()[:12]})")
        parent = key
    store.flush()


def load_into(store: NvmeStore, keys: list[BlockHash], dest: np.ndarray,
              threads: int = LOAD_THREADS) -> None:
    """Read block ``i`` into ``dest[i * block : (i + 1) * block]``; AssertionError on a miss."""
    block = dest.nbytes // len(keys)

    def one(i: int) -> None:
        if not store.get_into(keys[i], dest[i * block:(i + 1) * block]):
            raise AssertionError(f"NvmeStore lost block {i} ({keys[i].hex()[:12]})")

    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(one, range(len(keys))))


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
