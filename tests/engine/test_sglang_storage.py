"""CMXHiCacheStorage against SGLang's own HiCacheStorage interface, on the package's service.

SGLang's storage factory loads the backend by module path, as ``--hicache-storage-backend
dynamic`` does, and SGLang's own host KV pools (built on CPU) are registered with it as its
cache controller registers them; the SGLang engine itself is not run.
"""

from __future__ import annotations

import random
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from sglang.srt.mem_cache.hicache_storage import (
    HiCacheStorage,
    HiCacheStorageConfig,
    HiCacheStorageFailureInjector,
)
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

from cmx.connectors.sglang import CMXHiCacheStorage, key_tokens
from cmx.errors import LayoutMismatchError

# SGLang's host pools, built as the unit tests of the connector build them.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "unit" / "connectors"))
from test_sglang_host import mha_pool, page_bytes  # noqa: E402

PAGE = 64 * 1024  # bytes of one page handed over as a tensor
# Host pools of pages of 128 tokens x 4 layers x 4 heads x (64 + 64) x bf16 = 512 KiB: a block
# larger than half a copy piece, so loads copy and check it block by block.
POOL = dict(layers=4, heads=4, head_dim=64, page=128, tokens=512)


def storage_config(salt: str = "", **extra: Any) -> HiCacheStorageConfig:
    return HiCacheStorageConfig(
        tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
        is_mla_model=False, enable_storage_metrics=False, is_page_first_layout=True,
        model_name="smollm2-135m-instruct",
        extra_config={"backend_name": "cmx", "module_path": "cmx.connectors.sglang",
                      "class_name": "CMXHiCacheStorage", "salt": salt, **extra})


def page(seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (PAGE,), generator=g, dtype=torch.uint8)


@pytest.fixture(scope="module")
def storage(cm: Any) -> HiCacheStorage:
    backend = StorageBackendFactory.create_backend("dynamic", storage_config("sglang-test"),
                                                   None)
    assert isinstance(backend, CMXHiCacheStorage) and isinstance(backend, HiCacheStorage)
    return backend


def test_a_page_comes_back_byte_for_byte(storage: HiCacheStorage) -> None:
    assert storage.set("page-a", page(1))
    target = torch.zeros(PAGE, dtype=torch.uint8)
    assert storage.get("page-a", target) is target
    assert torch.equal(target, page(1))
    assert storage.exists("page-a")


def test_a_missing_page_is_none(storage: HiCacheStorage) -> None:
    assert storage.get("never-stored", torch.zeros(PAGE, dtype=torch.uint8)) is None
    assert not storage.exists("never-stored")


def test_batches_and_the_prefix_that_exists(storage: HiCacheStorage) -> None:
    keys = ["b0", "b1", "b2"]
    assert storage.batch_set(keys, [page(10 + i) for i in range(3)])
    targets = [torch.zeros(PAGE, dtype=torch.uint8) for _ in keys]
    got = storage.batch_get(keys, targets)
    assert all(g is t for g, t in zip(got, targets))
    assert all(torch.equal(t, page(10 + i)) for i, t in enumerate(targets))
    # batch_exists counts consecutive hits from the first key, as SGLang's contract says.
    assert storage.batch_exists(["b0", "b1", "missing", "b2"]) == 2
    assert storage.batch_exists(["missing", "b0"]) == 0


def test_other_salts_see_nothing(storage: HiCacheStorage, cm: Any) -> None:
    assert storage.set("tenant-page", page(3))
    other = CMXHiCacheStorage(storage_config("another-tenant"), memory=cm)
    assert other.get("tenant-page", torch.zeros(PAGE, dtype=torch.uint8)) is None
    assert other.batch_exists(["tenant-page"]) == 0


def test_a_page_of_another_size_is_refused(storage: HiCacheStorage) -> None:
    assert not storage.set("odd", torch.zeros(PAGE // 2, dtype=torch.uint8))
    with pytest.raises(LayoutMismatchError):
        storage.get("page-a", torch.zeros(PAGE // 2, dtype=torch.uint8))


def test_unknown_settings_are_refused(cm: Any) -> None:
    with pytest.raises(ValueError, match="unknown"):
        CMXHiCacheStorage(storage_config(pagebytes=PAGE), memory=cm)


def attached(pool: Any, salt: str, **extra: Any) -> HiCacheStorage:
    """The backend as SGLang's cache controller attaches it: made by the storage factory
    with the zero-copy interface on, then given the host pool."""
    backend = StorageBackendFactory.create_backend(
        "dynamic", storage_config(salt, interface_v1=1, **extra), pool)
    backend.register_mem_pool_host(pool)
    return backend


def slots(pool: Any, first_page: int, pages: int) -> torch.Tensor:
    size = pool.page_size
    return torch.arange(first_page * size, (first_page + pages) * size, dtype=torch.int64)


def every_page(pool: Any) -> list[torch.Tensor]:
    return [page_bytes(pool, p * pool.page_size) for p in range(pool.size // pool.page_size)]


@pytest.mark.parametrize("layout", ["page_first", "layer_first"])
def test_host_pool_pages_come_back_byte_for_byte(cm: Any, layout: str) -> None:
    a, b = mha_pool(layout, seed=1, **POOL), mha_pool(layout, seed=2, **POOL)
    keys = [f"pool-{layout}-{i}" for i in range(4)]
    assert attached(a, "pools").batch_set_v1(keys, slots(a, 1, 4)) == [True] * 4
    reader = attached(b, "pools")
    assert reader.batch_exists(keys + ["missing"] + keys) == 4
    before = every_page(b)
    assert reader.batch_get_v1(keys, slots(b, 3, 4)) == [True] * 4
    want = before[:3] + every_page(a)[1:5] + before[7:]
    assert all(torch.equal(x, y) for x, y in zip(every_page(b), want, strict=True))
    assert attached(b, "other-tenant").batch_exists(keys) == 0


def test_a_corrupt_block_in_the_service_is_a_miss_for_its_page_and_after(cm: Any) -> None:
    """A byte of page 1's block flipped in the service's DRAM: page 0 loads, page 1 is zeroed
    where it landed before its check failed, never left with the corrupt bytes, and pages 2 and
    3 are not loaded; the corrupt copy is quarantined."""
    a, b = mha_pool(seed=3, **POOL), mha_pool(seed=4, **POOL)
    writer, reader = attached(a, "corrupt"), attached(b, "corrupt")
    keys = [f"corrupt-{i}" for i in range(4)]
    assert writer.batch_set_v1(keys, slots(a, 0, 4)) == [True] * 4
    memory: Any = writer._cm  # type: ignore[attr-defined]
    bad = writer._kv_namespace().keys(key_tokens(keys[1]))  # type: ignore[attr-defined]
    before_quarantined = quarantined(memory)
    pins = memory.plane.pin_prefix(bad, "test-corrupt")
    try:
        assert len(pins) == 1
        memory.plane.payload(pins[0])[-1] ^= 0xFF
    finally:
        memory.plane.unpin(pins)
    before = every_page(b)
    assert reader.batch_get_v1(keys, slots(b, 4, 4)) == [True, False, False, False]
    after = every_page(b)
    assert torch.equal(after[4], every_page(a)[0])
    assert not after[5].any()
    assert all(torch.equal(x, y) for x, y in zip(after[6:], before[6:], strict=True))
    deadline = time.monotonic() + 60
    while quarantined(memory) == before_quarantined:
        assert time.monotonic() < deadline, "the corrupt copy was never quarantined"
        time.sleep(0.1)


def test_under_sglangs_failure_injector_no_page_is_ever_wrong(
    cm: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """SGLang's storage factory wraps the backend in its failure injector when
    SGLANG_TEST_HICACHE_BACKEND_RANDOM_FAILURE is set; seeded, half the calls fail."""
    monkeypatch.setenv("SGLANG_TEST_HICACHE_BACKEND_RANDOM_FAILURE", "0.5")
    monkeypatch.setattr(HiCacheStorageFailureInjector._thread_local, "random",
                        random.Random(11), raising=False)
    a, b = mha_pool(seed=5, **POOL), mha_pool(seed=6, **POOL)
    writer, reader = attached(a, "injected"), attached(b, "injected")
    assert isinstance(writer, HiCacheStorageFailureInjector)
    outcomes = set()
    for r in range(6):
        keys = [f"injected-{r}-{i}" for i in range(2)]
        said = writer.batch_set_v1(keys, slots(a, 0, 2))
        assert said in ([True] * 2, [False] * 2)
        before = every_page(b)
        got = reader.batch_get_v1(keys, slots(b, 2, 2))
        assert got in ([False] * 2, [True] * 2 if said[0] else [False] * 2)
        outcomes |= {("set", said[0]), ("get", got[0])}
        for i in range(2):
            want = every_page(a)[i] if got[i] else before[2 + i]
            assert torch.equal(every_page(b)[2 + i], want)
    assert outcomes == {("set", True), ("set", False), ("get", True), ("get", False)}


def quarantined(memory: Any) -> int:
    """Copies this node's DRAM tier dropped as corrupt so far."""
    from cmx.doors import TierStatsOf
    from cmx.links import actor_name

    stats = memory.link.call(actor_name("dram", memory.node_id), TierStatsOf())
    return int(stats.store.quarantined)
