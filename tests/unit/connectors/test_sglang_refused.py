"""SGLang's ``set`` answers True only for a page the service holds: a commit the service
refused (its DRAM tier restarted between the grant and the commit) or a page it found no room
for is False, and ``batch_set_v1`` answers so for each page of its run; on the in-process
service plane (no Ray, no SGLang engine)."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import ray
import torch
from plane import Plane, make_plane, namespace_client
from scenarios import BLOCK, LAYOUT, check, restart_tier, small_config
from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig
from test_sglang_host import config, mha_pool
from test_sglang_pages import slots
from writers import StoreLink, during_copy

from cmx.connectors.sglang import CMXHiCacheStorage, key_tokens
from cmx.tiers import Tier

NODE = f"sglang-{uuid.uuid4().hex[:6]}"  # arenas named apart from other suites' on this host


@pytest.fixture
def plane(tmp_path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Plane]:
    monkeypatch.setattr(ray, "get", lambda ref, timeout=None: ref)  # StoreLink answers itself
    p = make_plane(small_config(tmp_path), nodes=(NODE,), link_type=StoreLink)
    yield p
    p.close()


@pytest.fixture
def cm(plane: Plane) -> Any:
    return namespace_client(plane, NODE, LAYOUT, "t").cm


@pytest.fixture
def storage(cm: Any) -> CMXHiCacheStorage:
    """SGLang's storage backend over this plane, its pages one service slot each."""
    config = HiCacheStorageConfig(
        tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
        is_mla_model=False, enable_storage_metrics=False, is_page_first_layout=True,
        model_name="m", extra_config={"page_bytes": BLOCK})
    return CMXHiCacheStorage(config, memory=cm)


def page(seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (BLOCK,), generator=g, dtype=torch.uint8)


def read(storage: CMXHiCacheStorage, key: str) -> torch.Tensor | None:
    return storage.get(key, torch.zeros(BLOCK, dtype=torch.uint8))


def test_a_refused_commit_is_not_stored(
    plane: Plane, storage: CMXHiCacheStorage, monkeypatch: pytest.MonkeyPatch
) -> None:
    restarted = during_copy(monkeypatch, lambda: restart_tier(plane, NODE, Tier.DRAM))
    assert not storage.set("page-a", page(1))
    assert restarted() and not storage.exists("page-a") and read(storage, "page-a") is None
    assert storage.set("page-a", page(1))  # stored again, into the tier that runs now
    got = read(storage, "page-a")
    assert got is not None and torch.equal(got, page(1))
    assert storage.set("page-a", page(1))  # held already: still True
    check(plane)


def test_a_batch_answers_false_when_its_pages_are_refused(
    plane: Plane, storage: CMXHiCacheStorage, monkeypatch: pytest.MonkeyPatch
) -> None:
    during_copy(monkeypatch, lambda: restart_tier(plane, NODE, Tier.DRAM))  # the first page's
    assert not storage.batch_set(["b0", "b1"], [page(10), page(11)])
    assert not storage.exists("b0") and not storage.exists("b1")  # one run, one window
    assert storage.batch_set(["b0", "b1"], [page(10), page(11)])
    got = read(storage, "b1")
    assert got is not None and torch.equal(got, page(11))
    check(plane)


def test_each_page_of_a_run_answers_for_itself(
    plane: Plane, cm: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A store goes in windows of half the DRAM tier (4 blocks here): the DRAM tier restarts
    while the first window is copied, so its commit is refused; the second window is granted
    by the tier that runs then and stored. Each page's answer is what the service holds."""
    host = mha_pool(seed=1)
    pooled = CMXHiCacheStorage(config(), memory=cm)
    pooled.register_mem_pool_host(host)
    keys = [f"w{i}" for i in range(6)]
    restarted = during_copy(monkeypatch, lambda: restart_tier(plane, NODE, Tier.DRAM))
    assert pooled.batch_set_v1(keys, slots(host, 0, 6)) == [False] * 4 + [True] * 2
    assert restarted() and [pooled.exists(k) for k in keys] == [False] * 4 + [True] * 2
    assert pooled.batch_set_v1(keys, slots(host, 0, 6)) == [True] * 6
    check(plane)


def test_a_page_with_no_room_is_not_stored(plane: Plane, storage: CMXHiCacheStorage) -> None:
    keys = [f"full-{i}" for i in range(8)]  # DRAM holds 8 blocks
    assert storage.batch_set(keys, [page(20 + i) for i in range(8)])
    dram: Any = plane.tiers[(NODE, Tier.DRAM)]
    ns = storage._kv_namespace()  # the pages' namespace, as ``set`` made it
    pins = dram.pin([ns.keys(key_tokens(k))[0] for k in keys], "reader")
    assert all(p is not None for p in pins)  # every slot pinned: nothing can be evicted
    assert not storage.set("one-more", page(30))
    assert not storage.exists("one-more")
    dram.release_owner("reader")
    check(plane)



def test_pages_with_no_room_are_false_and_the_rest_true(plane: Plane, cm: Any) -> None:
    """Six of DRAM's 8 slots pinned: of 4 new pages, 2 find a slot (evicting the unpinned
    pages), 2 do not; each answers for itself."""
    host = mha_pool(seed=2)
    pooled = CMXHiCacheStorage(config(), memory=cm)
    pooled.register_mem_pool_host(host)
    old = [f"old-{i}" for i in range(8)]
    assert pooled.batch_set_v1(old, slots(host, 0, 8)) == [True] * 8
    dram: Any = plane.tiers[(NODE, Tier.DRAM)]
    ns = pooled._kv_namespace()
    pins = dram.pin([ns.keys(key_tokens(k))[0] for k in old[:6]], "reader")
    assert all(p is not None for p in pins)
    new = [f"new-{i}" for i in range(4)]
    stored = pooled.batch_set_v1(new, slots(host, 8, 4))
    assert sum(stored) == 2 and [pooled.exists(k) for k in new] == stored
    dram.release_owner("reader")
    check(plane)
