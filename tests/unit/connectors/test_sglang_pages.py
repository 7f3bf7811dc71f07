"""Pages of SGLang's own host pools through CMXHiCacheStorage's batch interface, on the
in-process service plane (no Ray, no SGLang engine): each page back byte for byte in another
pool, the prefix that exists, the namespaces pages stay in, and a corrupt block read as a miss.

Each case runs with blocks copied a run at a time and, with ``PIECE_BYTES`` cut below a page,
block by block (the path of pages larger than half a piece).
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import ray
import torch
from plane import Plane, make_plane, namespace_client
from scenarios import LAYOUT, check, small_config
from test_sglang_host import config, mha_pool, mla_pool, page_bytes
from writers import StoreLink

from cmx.client import copy_out
from cmx.connectors.sglang import CMXHiCacheStorage, key_tokens
from cmx.errors import BlockStateError, LayoutMismatchError

NODE = f"sgl-pages-{uuid.uuid4().hex[:6]}"  # arenas named apart from other suites' on this host
POOLS = [("mha", layout) for layout in ("layer_first", "page_first", "page_first_direct",
                                         "page_head")]
POOLS += [("mla", layout) for layout in ("layer_first", "page_first", "page_first_direct")]


def service_plane(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                  node: str) -> Iterator[Plane]:
    """One node's tiers, agent and directory (DRAM of 8 blocks, HBM of 4, NVMe of 256), for
    a module's ``plane`` fixture: its books checked whole after the test."""
    monkeypatch.setattr(ray, "get", lambda ref, timeout=None: ref)  # StoreLink answers itself
    p = make_plane(small_config(tmp_path), nodes=(node,), link_type=StoreLink)
    yield p
    check(p)
    p.close()


def client(plane: Plane, node: str) -> Any:
    return namespace_client(plane, node, LAYOUT, "t").cm


def slots(pool: Any, first_page: int, pages: int) -> torch.Tensor:
    """The host slots of ``pages`` pages of ``pool`` from page ``first_page``."""
    size = pool.page_size
    return torch.arange(first_page * size, (first_page + pages) * size, dtype=torch.int64)


def every_page(pool: Any) -> list[torch.Tensor]:
    return [page_bytes(pool, p * pool.page_size) for p in range(pool.size // pool.page_size)]


def pool_of(kind: str, layout: str, seed: int | None = None) -> Any:
    return (mha_pool if kind == "mha" else mla_pool)(layout, seed=seed)


@pytest.fixture(params=["runs", "blocks"])
def copies(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    if request.param == "blocks":
        monkeypatch.setattr(copy_out, "PIECE_BYTES", 256)
    return str(request.param)


@pytest.fixture
def plane(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Plane]:
    yield from service_plane(tmp_path, monkeypatch, NODE)


@pytest.fixture
def cm(plane: Plane) -> Any:
    return client(plane, NODE)


def storage(cm: Any, pool: Any = None, salt: str = "", **changes: Any) -> CMXHiCacheStorage:
    """SGLang's storage of one rank, its host pool ``pool`` registered as SGLang does."""
    mla = type(pool).__name__.startswith("MLA")
    s = CMXHiCacheStorage(config(salt, mla=mla, **changes), memory=cm)
    if pool is not None:
        s.register_mem_pool_host(pool)
    return s


@pytest.mark.parametrize(("kind", "layout"), POOLS)
def test_pages_come_back_byte_for_byte_into_another_pool(
    cm: Any, copies: str, kind: str, layout: str
) -> None:
    a, b = pool_of(kind, layout, seed=1), pool_of(kind, layout, seed=2)
    keys = [f"{kind}-{layout}-{i}" for i in range(6)]
    assert storage(cm, a).batch_set_v1(keys, slots(a, 1, 6)) == [True] * 6
    before = every_page(b)
    assert storage(cm, b).batch_get_v1(keys, slots(b, 10, 6)) == [True] * 6
    want = before[:10] + every_page(a)[1:7] + before[16:]
    assert all(torch.equal(got, w) for got, w in zip(every_page(b), want, strict=True))


def test_a_batch_larger_than_the_services_memory(cm: Any, copies: str) -> None:
    """20 pages through a DRAM of 8 blocks: most come back from NVMe, through the agent."""
    a, b = mha_pool(seed=1), mha_pool(seed=2)
    keys = [f"big-{i}" for i in range(20)]
    assert storage(cm, a).batch_set_v1(keys, slots(a, 0, 20)) == [True] * 20
    assert storage(cm, b).batch_get_v1(keys, slots(b, 5, 20)) == [True] * 20
    assert all(torch.equal(x, y)
               for x, y in zip(every_page(b)[5:25], every_page(a)[:20], strict=True))


def test_exists_and_gets_count_the_leading_pages_held(cm: Any) -> None:
    a, b = mha_pool(seed=1), mha_pool(seed=2)
    writer, reader = storage(cm, a), storage(cm, b)
    assert writer.batch_set_v1(["k0", "k1", "k2"], slots(a, 0, 3)) == [True] * 3
    assert reader.batch_exists(["k0", "k1", "missing", "k2"]) == 2
    assert reader.batch_exists(["missing", "k0"]) == 0
    assert reader.exists("k2") and not reader.exists("missing")
    before = every_page(b)
    # The pages after a miss are not loaded: SGLang uses only the leading ones.
    assert reader.batch_get_v1(["k0", "missing", "k2"], slots(b, 4, 3)) == [True, False, False]
    assert torch.equal(every_page(b)[4], every_page(a)[0])
    assert all(torch.equal(x, y) for x, y in zip(every_page(b)[5:], before[5:], strict=True))


@pytest.mark.parametrize("layout", ["layer_first", "page_first"])
def test_the_generic_path_and_the_zero_copy_path_read_each_others_pages(
    cm: Any, layout: str
) -> None:
    """SGLang's generic path hands a flat page of the pool (``get_data_page``) and puts what
    ``get`` loaded back with ``set_from_flat_data_page``: the same bytes as the batch path."""
    a, b = mha_pool(layout, seed=1), mha_pool(layout, seed=2)
    writer, reader = storage(cm, a), storage(cm, b)
    assert writer.batch_set_v1(["zero-copy"], slots(a, 3, 1)) == [True]
    flat = reader.get("zero-copy", b.get_dummy_flat_data_page())
    assert flat is not None
    b.set_from_flat_data_page(5 * b.page_size, flat)
    assert torch.equal(page_bytes(b, 5 * b.page_size), page_bytes(a, 3 * a.page_size))
    assert writer.set("generic", a.get_data_page(6 * a.page_size, flat=True))
    assert reader.batch_get_v1(["generic"], slots(b, 7, 1)) == [True]
    assert torch.equal(page_bytes(b, 7 * b.page_size), page_bytes(a, 6 * a.page_size))


def test_pools_whose_pages_lie_in_another_order_share_none(cm: Any) -> None:
    """A page_first pool's flat page is token-major, a layer_first pool's layer-major: the
    same bytes mean other things, so neither finds the other's pages. page_first_direct keeps
    layer_first's order, and reads its pages."""
    layer_first, token_first = mha_pool("layer_first", seed=1), mha_pool("page_first", seed=2)
    assert storage(cm, layer_first).batch_set_v1(["order"], slots(layer_first, 2, 1)) == [True]
    assert storage(cm, token_first).batch_exists(["order"]) == 0
    assert storage(cm, token_first).batch_get_v1(["order"], slots(token_first, 2, 1)) == [False]
    direct = mha_pool("page_first_direct", seed=3)
    assert storage(cm, direct).batch_get_v1(["order"], slots(direct, 4, 1)) == [True]
    assert torch.equal(page_bytes(direct, 16), page_bytes(layer_first, 8))


def test_pools_of_another_element_type_share_none(cm: Any) -> None:
    """bfloat16 and float16 pages of one model are the same size: the same bytes mean other
    numbers, so neither finds the other's pages."""
    bf16, fp16 = mha_pool(seed=7), mha_pool(seed=8, dtype=torch.float16)
    assert storage(cm, bf16).batch_set_v1(["dtype"], slots(bf16, 2, 1)) == [True]
    assert storage(cm, fp16).batch_exists(["dtype"]) == 0
    assert storage(cm, fp16).batch_get_v1(["dtype"], slots(fp16, 2, 1)) == [False]
    again = mha_pool(seed=9)
    assert storage(cm, again).batch_get_v1(["dtype"], slots(again, 4, 1)) == [True]


def test_the_generic_path_keeps_pools_of_another_order_apart(cm: Any) -> None:
    """SGLang's generic path hands the pool's flat page: a page_first pool's, token-major,
    put back by a layer_first pool's ``set_from_flat_data_page`` would scramble every page."""
    token_first, layer_first = mha_pool("page_first", seed=1), mha_pool("layer_first", seed=2)
    writer, reader = storage(cm, token_first), storage(cm, layer_first)
    assert writer.set("flat", token_first.get_data_page(0, flat=True))
    assert not reader.exists("flat")
    assert reader.get("flat", layer_first.get_dummy_flat_data_page()) is None


def test_pages_of_another_salt_are_invisible(cm: Any) -> None:
    a, b = mha_pool(seed=1), mha_pool(seed=2)
    assert storage(cm, a, salt="tenant-a").batch_set_v1(["salted"], slots(a, 0, 1)) == [True]
    other = storage(cm, b, salt="tenant-b")
    assert other.batch_exists(["salted"]) == 0 and not other.exists("salted")
    assert other.batch_get_v1(["salted"], slots(b, 0, 1)) == [False]
    assert storage(cm, b, salt="tenant-a").batch_get_v1(["salted"], slots(b, 0, 1)) == [True]


@pytest.mark.parametrize(("rank", "ranks"), [
    ("tp_rank", "tp_size"), ("pp_rank", "pp_size"), ("attn_cp_rank", "attn_cp_size")])
def test_ranks_whose_pages_differ_share_none(cm: Any, rank: str, ranks: str) -> None:
    """Pipeline stages hold other layers, context-parallel ranks other slices of each page,
    tensor-parallel ranks of an MHA model other heads: a page of one is not another's."""
    page = torch.randint(0, 256, (512,), generator=torch.Generator().manual_seed(0),
                         dtype=torch.uint8)
    first, second = storage(cm, **{rank: 0, ranks: 2}), storage(cm, **{rank: 1, ranks: 2})
    assert first.set("rank-page", page) and first.exists("rank-page")
    assert not second.exists("rank-page")
    assert second.get("rank-page", torch.zeros(512, dtype=torch.uint8)) is None


def test_tensor_parallel_ranks_of_an_mla_model_share_its_pages(cm: Any) -> None:
    a, b = mla_pool(seed=1), mla_pool(seed=2)
    assert storage(cm, a, tp_rank=0, tp_size=2).batch_set_v1(["mla"], slots(a, 0, 1)) == [True]
    assert storage(cm, b, tp_rank=1, tp_size=2).batch_get_v1(["mla"], slots(b, 1, 1)) == [True]
    assert torch.equal(page_bytes(b, b.page_size), page_bytes(a, 0))


def test_a_corrupt_block_is_a_miss_for_its_page_and_those_after(cm: Any, copies: str) -> None:
    """A byte of page 1's block flipped in the service's DRAM: page 0 loads, page 1 never
    lands (or is zeroed where it landed before its check failed), pages 2 and 3 are not
    loaded; the corrupt copy is quarantined, and a store brings the page back."""
    a, b = mha_pool(seed=1), mha_pool(seed=2)
    writer, reader = storage(cm, a), storage(cm, b)
    keys = [f"c{i}" for i in range(4)]
    assert writer.batch_set_v1(keys, slots(a, 0, 4)) == [True] * 4
    bad = writer._kv_namespace().keys(key_tokens("c1"))
    pins = cm.plane.pin_prefix(bad, "test-corrupt")
    assert len(pins) == 1
    cm.plane.payload(pins[0])[-1] ^= 0xFF
    cm.plane.unpin(pins)
    before = every_page(b)
    assert reader.batch_get_v1(keys, slots(b, 8, 4)) == [True, False, False, False]
    after = every_page(b)
    assert torch.equal(after[8], every_page(a)[0])
    assert torch.equal(after[9], before[9]) or not after[9].any()  # never the corrupt bytes
    assert all(torch.equal(x, y) for x, y in zip(after[10:], before[10:], strict=True))
    assert reader.batch_exists(keys) == 1  # quarantined
    assert writer.batch_set_v1(keys, slots(a, 0, 4)) == [True] * 4
    assert reader.batch_get_v1(keys, slots(b, 8, 4)) == [True] * 4
    assert all(torch.equal(x, y) for x, y in zip(every_page(b)[8:12], every_page(a)[:4]))


def test_calls_that_name_no_whole_pages_change_nothing(cm: Any) -> None:
    a = mha_pool(seed=1)
    writer = storage(cm, a)
    with pytest.raises(LayoutMismatchError, match="2 pages of 4 tokens, got 7"):
        writer.batch_set_v1(["x0", "x1"], slots(a, 0, 2)[:7])
    assert writer.batch_exists(["x0"]) == 0
    with pytest.raises(BlockStateError, match="no host pool"):
        storage(cm).batch_get_v1(["x0"], slots(a, 0, 1))
