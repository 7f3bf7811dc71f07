"""Helpers shared by the DramStore tests: keys, payloads, a snapshot of what a store shows."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from cmx.storage.dram import DramStore

MakeStore = Callable[..., DramStore]


def key(i: int) -> bytes:
    return i.to_bytes(32, "little")


def payload(i: int, size: int = 5000) -> np.ndarray:
    return np.random.default_rng(i).integers(0, 256, size, dtype=np.uint8)


def snapshot(store: DramStore) -> tuple[object, ...]:
    return (store.stats(), sorted(store.keys()), store.seq)
