"""Shared fixtures of the storage tests: no shared-memory file may outlive a test."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator

import pytest

from cmx.storage.arena import SHM_DIR
from cmx.storage.dram import DramStore

# Every arena these tests create, named or not, starts with this (unnamed ones are cmx-<pid>-).
PREFIX = f"cmx-{os.getpid()}-"


def _ours() -> set[str]:
    return {n for n in os.listdir(SHM_DIR) if n.startswith(PREFIX)}


@pytest.fixture(autouse=True)
def no_shm_leak() -> Iterator[None]:
    before = _ours()
    yield
    leaked = _ours() - before
    for name in leaked:  # clean up so one failure does not cascade
        os.unlink(os.path.join(SHM_DIR, name))
    assert not leaked, f"shared memory left behind: {sorted(leaked)}"


@pytest.fixture
def make_store() -> Iterator[Callable[..., DramStore]]:
    """DramStore factory; every store is integrity-checked and closed after the test."""
    stores: list[DramStore] = []

    def make(slots: int = 4, block_bytes: int = 5000, **kwargs: object) -> DramStore:
        slot = -(-block_bytes // 4096) * 4096
        store = DramStore(capacity_bytes=slots * slot, block_bytes=block_bytes, **kwargs)
        stores.append(store)
        return store

    yield make
    try:
        for store in stores:
            if not store.closed:
                store.check_integrity()
    finally:
        for store in stores:
            store.close()
