"""CMXHiCacheStorage against SGLang's own HiCacheStorage interface, on the package's service.

SGLang's storage factory loads the backend by module path, as ``--hicache-storage-backend
dynamic`` does; the SGLang engine itself is not run.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from sglang.srt.mem_cache.hicache_storage import HiCacheStorage, HiCacheStorageConfig
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

from cmx.connectors.sglang import CMXHiCacheStorage
from cmx.errors import LayoutMismatchError

PAGE = 64 * 1024  # bytes of one page of SGLang's host pool


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
