"""A hybrid model's other host pools through CMXHiCacheStorage's ``batch_*_v2``, on the
in-process service plane: a sliding-window pool registered beside the KV pool keeps its pages
in a namespace of its own, and ``batch_exists_v2`` cuts the KV prefix to what that pool can
restore, under SGLang's hit policies."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from plane import Plane
from sglang.srt.mem_cache.hicache_storage import PoolHitPolicy, PoolName, PoolTransfer
from test_sglang_host import config, mha_pool, page_bytes
from test_sglang_pages import client, service_plane, slots

from cmx.connectors.sglang import CMXHiCacheStorage
from cmx.errors import BlockStateError

NODE = f"sgl-hybrid-{uuid.uuid4().hex[:6]}"
KEYS = ["h0", "h1", "h2", "h3"]
TRAILING = PoolHitPolicy.TRAILING_PAGES


@pytest.fixture
def plane(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Plane]:
    yield from service_plane(tmp_path, monkeypatch, NODE)


def hybrid(plane: Plane, seed: int) -> tuple[CMXHiCacheStorage, Any, Any]:
    """A storage with SGLang's KV pool and a one-layer sliding-window pool, as a hybrid
    model's cache controller registers them."""
    kv, swa = mha_pool(seed=seed), mha_pool(layers=1, heads=1, seed=seed + 1)
    storage = CMXHiCacheStorage(config(), memory=client(plane, NODE))
    storage.register_mem_pool_host(kv)
    storage.register_mem_host_pool_v2(swa, PoolName.SWA)
    return storage, kv, swa


def swa(pool: Any, first_page: int, keys: list[str], **more: Any) -> PoolTransfer:
    return PoolTransfer(name=PoolName.SWA, host_indices=slots(pool, first_page, len(keys)),
                        keys=keys, **more)


def test_a_trailing_window_restores_the_prefix_it_ends(plane: Plane) -> None:
    writer, kv, window = hybrid(plane, seed=1)
    assert writer.batch_set_v1(KEYS, slots(kv, 0, 4)) == [True] * 4
    assert writer.batch_set_v2([swa(window, 0, KEYS[2:])]) == {PoolName.SWA: [True, True]}
    found = writer.batch_exists_v2(KEYS, [swa(window, 0, KEYS[2:], hit_policy=TRAILING)])
    # Only the prefix of all 4 pages ends on the window the pool holds (pages 2 and 3).
    assert found.kv_hit_pages == 4 and found.restorable_prefix_pages == [4]
    assert found.extra_pool_hit_pages == {PoolName.KV: 4, PoolName.SWA: 4}
    every = writer.batch_exists_v2(KEYS, [swa(window, 0, KEYS)])  # ALL_PAGES: 0 and 1 missing
    assert every.kv_hit_pages == 0 and every.restorable_prefix_pages == []
    assert every.extra_pool_hit_pages == {PoolName.KV: 4}
    reader, _, other = hybrid(plane, seed=5)
    assert reader.batch_get_v2([swa(other, 3, KEYS[2:])]) == {PoolName.SWA: [True, True]}
    for i in range(2):
        assert torch.equal(page_bytes(other, (3 + i) * other.page_size),
                           page_bytes(window, i * window.page_size))


def test_each_pool_keeps_its_pages_apart(plane: Plane) -> None:
    writer, kv, window = hybrid(plane, seed=1)
    assert writer.batch_set_v1(KEYS[:2], slots(kv, 0, 2)) == [True, True]
    # The KV pool's pages of h0, h1 are no sliding-window pages of theirs.
    assert writer.batch_get_v2([swa(window, 5, KEYS[:2])]) == {PoolName.SWA: [False, False]}
    short = writer.batch_exists_v2(KEYS[:2], [swa(window, 0, KEYS[1:2], hit_policy=TRAILING)])
    assert short.kv_hit_pages == 0 and short.extra_pool_hit_pages == {PoolName.KV: 2}


def test_a_pool_never_registered_and_a_policy_unknown_here_are_refused(plane: Plane) -> None:
    writer, kv, window = hybrid(plane, seed=1)
    stray = PoolTransfer(name=PoolName.MAMBA, host_indices=slots(window, 0, 1), keys=["x"])
    with pytest.raises(BlockStateError, match="mamba"):
        writer.batch_set_v2([stray])
    assert writer.batch_set_v1(["x"], slots(kv, 0, 1)) == [True]
    groups = swa(window, 0, ["x"], hit_policy=PoolHitPolicy.BLOCK_GROUPS)
    with pytest.raises(ValueError, match="not supported"):
        writer.batch_exists_v2(["x"], [groups])
