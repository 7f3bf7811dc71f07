"""A load into the caller's own buffer (``NamespaceClient.load_into``) and straight into an
engine's paged cache (``load_to`` with a ``PagedSink``): the exact bytes land where they are
used, nothing else is written, and a block that fails its check is neither counted nor kept."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import numpy as np
import pytest
import torch
from plane import Plane, make_plane, namespace_client
from scenarios import LAYOUT, check, held, small_config

from cmx.client import NamespaceClient
from cmx.connectors.paged import LoadCancelled, PagedLayout, PagedSink, WriteGate, block_view
from cmx.errors import LayoutMismatchError
from cmx.tiers import Tier

NODE = f"into-{uuid.uuid4().hex[:6]}"  # arenas named apart from other suites' on this host
T = LAYOUT.block_tokens
L, H, D = LAYOUT.num_layers, LAYOUT.num_kv_heads, LAYOUT.head_dim


@pytest.fixture
def plane(tmp_path) -> Iterator[Plane]:
    p = make_plane(small_config(tmp_path), nodes=(NODE,))
    yield p
    p.close()


def stored(plane: Plane, n: int, seed: int) -> tuple[NamespaceClient, list[int], torch.Tensor]:
    ns = namespace_client(plane, NODE, LAYOUT, f"t{seed}")
    toks = [int(t) for t in np.random.default_rng(seed).integers(0, 50_000, n * T)]
    kv = LAYOUT.random_kv(len(toks), seed=seed)
    assert ns.store(toks, kv).wait() == n
    return ns, toks, kv


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16)  # random bytes make NaNs, which equal nothing


def nothing_held(plane: Plane) -> bool:
    return all(held(plane, NODE, t) == (0, 0) for t in (Tier.HBM, Tier.DRAM))


def test_a_load_into_the_callers_buffer_is_exact_and_fills_only_its_prefix(
        plane: Plane) -> None:
    ns, toks, kv = stored(plane, 3, seed=1)
    out = torch.full(LAYOUT.shape(5 * T), 7.0, dtype=kv.dtype)  # room for more than is held
    for _ in range(2):  # the same buffer again: no new tensor, the same bytes
        assert ns.load_into(toks, out) == 3 * T
        assert torch.equal(bits(out[:, :, :, : 3 * T]), bits(kv))
        assert bool((out[:, :, :, 3 * T :] == 7.0).all())  # past the prefix: untouched
    assert nothing_held(plane)
    check(plane)


def test_a_buffer_shorter_than_the_prefix_takes_what_fits(plane: Plane) -> None:
    ns, toks, kv = stored(plane, 3, seed=2)
    out = torch.zeros(LAYOUT.shape(2 * T), dtype=kv.dtype)
    assert ns.load_into(toks, out) == 2 * T
    assert torch.equal(bits(out), bits(kv[:, :, :, : 2 * T]))
    assert nothing_held(plane)


def test_a_buffer_of_another_shape_or_dtype_is_refused_untouched(plane: Plane) -> None:
    ns, toks, kv = stored(plane, 2, seed=3)
    wrong_dtype = torch.zeros(LAYOUT.shape(2 * T), dtype=torch.float32)
    wrong_heads = torch.zeros((L, 2, H + 1, 2 * T, D), dtype=kv.dtype)
    for out in (wrong_dtype, wrong_heads):
        with pytest.raises(LayoutMismatchError):
            ns.load_into(toks, out)
        assert not out.any()
    with pytest.raises(LayoutMismatchError):
        ns.load_into(toks, torch.zeros(LAYOUT.shape(2 * T), dtype=kv.dtype, device="meta"))
    assert nothing_held(plane)


def test_a_corrupt_block_in_the_callers_buffer_is_zeroed_and_not_counted(plane: Plane) -> None:
    ns, toks, kv = stored(plane, 3, seed=4)
    keys = ns.keys(toks)
    dram = plane.tiers[(NODE, Tier.DRAM)]
    dram.store.arena.slot_view(dram.store.locate(keys[1]).slot)[5] ^= 0xFF
    out = torch.full(LAYOUT.shape(3 * T), 7.0, dtype=kv.dtype)
    assert ns.load_into(toks, out) == T
    assert torch.equal(bits(out[:, :, :, :T]), bits(kv[:, :, :, :T]))
    assert not out[:, :, :, T : 2 * T].any()  # its bytes landed, then were wiped
    assert dram.contains(keys) == [True, False, True]  # quarantined where it lay
    assert nothing_held(plane)


def paged(blocks: int = 8) -> list[torch.Tensor]:
    """One vLLM CPU-layout cache per layer: [blocks, kv_heads, block_size, 2 * head_dim]."""
    return [torch.zeros(blocks, H, T, 2 * D, dtype=torch.float16) for _ in range(L)]


def paged_blocks(caches: list[torch.Tensor], ids: list[int]) -> torch.Tensor:
    """[layers, 2, kv_heads, len(ids) * T, head_dim] of those paged blocks, in order."""
    views = [block_view(c, PagedLayout.VLLM_CPU, D)[ids] for c in caches]
    return torch.stack([v.permute(2, 1, 0, 3, 4).reshape(2, H, len(ids) * T, D)
                        for v in views])


def test_a_load_lands_straight_in_the_paged_cache_at_its_block_ids(plane: Plane) -> None:
    ns, toks, kv = stored(plane, 3, seed=5)
    caches = paged()
    ids = [6, 1, 4]
    sink = PagedSink(caches, PagedLayout.VLLM_CPU, D, ids, WriteGate())
    assert ns.load_to(sink, toks) == 3
    assert torch.equal(bits(paged_blocks(caches, ids)), bits(kv))
    others = [b for b in range(8) if b not in ids]
    assert not paged_blocks(caches, others).any()  # nothing else written
    assert nothing_held(plane)


def test_a_corrupt_block_never_stays_in_the_paged_cache(plane: Plane) -> None:
    ns, toks, kv = stored(plane, 3, seed=6)
    keys = ns.keys(toks)
    dram = plane.tiers[(NODE, Tier.DRAM)]
    dram.store.arena.slot_view(dram.store.locate(keys[1]).slot)[-1] ^= 0xFF  # the last layer
    caches = paged()
    sink = PagedSink(caches, PagedLayout.VLLM_CPU, D, [3, 5, 7], WriteGate())
    assert ns.load_to(sink, toks) == 1
    assert torch.equal(bits(paged_blocks(caches, [3])), bits(kv[:, :, :, :T]))
    assert not paged_blocks(caches, [5]).any()
    assert dram.contains(keys) == [True, False, True]


def test_a_closed_gate_lets_no_write_through(plane: Plane) -> None:
    ns, toks, _ = stored(plane, 2, seed=7)
    caches = paged()
    gate = WriteGate()
    gate.close()
    with pytest.raises(LoadCancelled):
        ns.load_to(PagedSink(caches, PagedLayout.VLLM_CPU, D, [0, 1], gate), toks)
    assert not any(c.any() for c in caches)
    assert nothing_held(plane)  # the pins went back on the way out


def test_a_sink_refuses_block_ids_outside_the_cache() -> None:
    with pytest.raises(LayoutMismatchError):
        PagedSink(paged(4), PagedLayout.VLLM_CPU, D, [1, 4], WriteGate())


def test_a_store_of_small_blocks_goes_a_run_at_a_time_and_loads_back_exact(
        plane: Plane, monkeypatch: pytest.MonkeyPatch) -> None:
    from cmx.client.stores import TensorSource

    runs: list[int] = []
    original = TensorSource.copy_run

    def counted(self: TensorSource, i: int, n: int):  # type: ignore[no-untyped-def]
        runs.append(n)
        return original(self, i, n)
    monkeypatch.setattr(TensorSource, "copy_run", counted)
    ns, toks, kv = stored(plane, 6, seed=8)
    assert sum(runs) == 6 and len(runs) <= 2  # 8 KiB blocks: 64 to a run
    out = torch.zeros(LAYOUT.shape(6 * T), dtype=kv.dtype)
    assert ns.load_into(toks, out) == 6 * T  # every block's checksum held as it was stored
    assert torch.equal(bits(out), bits(kv))
    assert nothing_held(plane)
    check(plane)
