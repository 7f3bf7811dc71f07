"""CMXHiCacheStorage under SGLang's own failure injector (``HiCacheStorageFailureInjector``,
what SGLang wraps a backend in when ``SGLANG_TEST_HICACHE_BACKEND_RANDOM_FAILURE`` is set), on
the in-process service plane: half the calls fail before they reach the backend, seeded so the
run is the same each time. A failed call answers a miss or "not stored", never a page's wrong
bytes, and leaves nothing behind that a later call trips on."""

from __future__ import annotations

import random
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from plane import Plane
from sglang.srt.mem_cache.hicache_storage import HiCacheStorageFailureInjector
from test_sglang_host import config, mha_pool
from test_sglang_pages import client, every_page, service_plane, slots

from cmx.connectors.sglang import CMXHiCacheStorage

NODE = f"sgl-inject-{uuid.uuid4().hex[:6]}"


@pytest.fixture
def plane(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Plane]:
    yield from service_plane(tmp_path, monkeypatch, NODE)


def injected(plane: Plane, pool: Any) -> tuple[HiCacheStorageFailureInjector, CMXHiCacheStorage]:
    backend = CMXHiCacheStorage(config(), memory=client(plane, NODE))
    proxy = HiCacheStorageFailureInjector(backend, 0.0, 0.5)
    proxy.register_mem_pool_host(pool)
    return proxy, backend


def test_injected_failures_are_misses_never_wrong_bytes(
    plane: Plane, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(HiCacheStorageFailureInjector._thread_local, "random", random.Random(7),
                        raising=False)
    a, b = mha_pool(seed=1), mha_pool(seed=2)
    (writer, _), (reader, backend) = injected(plane, a), injected(plane, b)
    stored: list[str] = []
    outcomes: set[tuple[str, bool]] = set()
    for r in range(10):
        keys = [f"r{r}-{i}" for i in range(3)]
        said = writer.batch_set_v1(keys, slots(a, 3 * r, 3))
        assert said in ([True] * 3, [False] * 3)  # a whole call fails, or none of it
        outcomes.add(("set", said[0]))
        stored += keys if said[0] else []
        held = 3 if said[0] else 0
        assert reader.batch_exists(keys) in (0, held)
        before = every_page(b)
        got = reader.batch_get_v1(keys, slots(b, 3 * r, 3))
        assert got in ([False] * 3, [True] * held + [False] * (3 - held))
        outcomes.add(("get", got[0]))
        after, source = every_page(b), every_page(a)
        for i in range(3):
            want = source[3 * r + i] if got[i] else before[3 * r + i]
            assert torch.equal(after[3 * r + i], want)
    assert outcomes == {("set", True), ("set", False), ("get", True), ("get", False)}
    # Without the injector, every page the writer was told is stored is there.
    assert backend.batch_exists(stored) == len(stored)
    assert backend.batch_get_v1(stored, slots(b, 0, len(stored))) == [True] * len(stored)
    source, after = every_page(a), every_page(b)
    for j, key in enumerate(stored):
        r, i = (int(n) for n in key[1:].split("-"))
        assert torch.equal(after[j], source[3 * r + i])
