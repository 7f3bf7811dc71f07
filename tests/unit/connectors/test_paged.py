"""Gather and scatter of paged KV against a plain torch reference, on every device here.

The reference reads and writes one token of one head at a time, by the layout's definition,
so it shares no indexing with the module under test.
"""

from __future__ import annotations

import pytest
import torch

from cmx.connectors.paged import PagedLayout, block_view, gather_layer, scatter_layer
from cmx.errors import LayoutMismatchError
from cmx.layout import KVLayout

BLOCKS, HEADS, SIZE, DIM = 7, 3, 4, 8
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def make_cache(layout: PagedLayout, device: str, dtype: torch.dtype = torch.bfloat16,
               seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if layout is PagedLayout.FLASH:
        shape: tuple[int, ...] = (2, BLOCKS, SIZE, HEADS, DIM)
    elif layout is PagedLayout.VLLM_FLASH:
        # vLLM's default physical order is [blocks, size, heads, 2*dim]; the engine hands the
        # connector the logical [blocks, heads, size, 2*dim] view of it, strides and all.
        raw = torch.randn(BLOCKS, SIZE, HEADS, 2 * DIM, generator=g).to(dtype).to(device)
        return raw.transpose(1, 2)
    else:
        # Every layer's cache lies in one storage: this one is the second layer's.
        both = torch.randn(2, BLOCKS, HEADS, SIZE, 2 * DIM, generator=g).to(dtype).to(device)
        return both[1]
    return torch.randn(shape, generator=g).to(dtype).to(device)


def ref_vector(cache: torch.Tensor, layout: PagedLayout, block: int, kv: int, head: int,
               token: int) -> torch.Tensor:
    """K (kv=0) or V (kv=1) of one token of one head, by each layout's definition; a view."""
    if layout is PagedLayout.FLASH:
        return cache[kv, block, token, head]
    if layout is PagedLayout.VLLM_FLASH:
        return cache[block, head, token, kv * DIM:(kv + 1) * DIM]
    flat = cache[block, head].reshape(-1)  # K of every token of the block, then V
    start = (kv * SIZE + token) * DIM
    return flat[start:start + DIM]


def ref_gather(cache: torch.Tensor, layout: PagedLayout, ids: list[int]) -> torch.Tensor:
    out = torch.empty(2, HEADS, len(ids) * SIZE, DIM, dtype=cache.dtype)
    for i, block in enumerate(ids):
        for kv in range(2):
            for head in range(HEADS):
                for token in range(SIZE):
                    out[kv, head, i * SIZE + token] = ref_vector(cache, layout, block, kv, head,
                                                                 token).cpu()
    return out


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("layout", list(PagedLayout))
def test_gather_matches_reference(layout: PagedLayout, device: str) -> None:
    cache = make_cache(layout, device)
    ids = [5, 0, 3, 3]  # any order, repeats allowed
    out = torch.zeros(2, HEADS, len(ids) * SIZE, DIM, dtype=cache.dtype, device=device)
    gather_layer(cache, layout, ids, out)
    assert torch.equal(out.cpu(), ref_gather(cache, layout, ids))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("layout", list(PagedLayout))
def test_scatter_writes_only_the_named_blocks(layout: PagedLayout, device: str) -> None:
    cache = make_cache(layout, device)
    before = cache.clone()
    ids = [6, 1, 4]
    src = make_cache(PagedLayout.FLASH, "cpu", seed=9)[:, :3].reshape(2, 3 * SIZE, HEADS, DIM)
    src = src.permute(0, 2, 1, 3).contiguous()  # [2, heads, 3 * size, dim]
    scatter_layer(cache, layout, torch.tensor(ids), src.to(device))
    assert torch.equal(ref_gather(cache, layout, ids), src)
    for block in set(range(BLOCKS)) - set(ids):
        assert torch.equal(ref_gather(cache, layout, [block]), ref_gather(before, layout, [block]))


@pytest.mark.parametrize("layout", list(PagedLayout))
def test_round_trip_through_block_payloads(layout: PagedLayout) -> None:
    """Blocks gathered from one engine's cache into the service's payloads and scattered into
    another's (at other block ids) read back the same K and V."""
    kv_layout = KVLayout(num_layers=2, num_kv_heads=HEADS, head_dim=DIM, block_tokens=SIZE)
    first = [make_cache(layout, "cpu", seed=s) for s in (1, 2)]
    second = [torch.zeros_like(c) for c in first]
    kv = torch.empty(kv_layout.shape(3 * SIZE), dtype=torch.bfloat16)
    for layer, cache in enumerate(first):
        gather_layer(cache, layout, [2, 4, 6], kv[layer])
    payloads: list[object] = list(kv_layout.split_blocks(kv))  # what the service stores
    back = kv_layout.join_blocks(payloads)
    for layer, cache in enumerate(second):
        scatter_layer(cache, layout, [0, 1, 5], back[layer].contiguous())
    for a, b in zip(first, second):
        assert torch.equal(ref_gather(a, layout, [2, 4, 6]), ref_gather(b, layout, [0, 1, 5]))


def test_block_view_is_a_view() -> None:
    cache = make_cache(PagedLayout.VLLM_CPU, "cpu")
    view = block_view(cache, PagedLayout.VLLM_CPU, DIM)
    assert view.shape == (BLOCKS, HEADS, 2, SIZE, DIM)
    view[2, 1, 1, 3].fill_(7)  # V of token 3, head 1, block 2
    assert torch.equal(ref_vector(cache, PagedLayout.VLLM_CPU, 2, 1, 1, 3),
                       torch.full((DIM,), 7, dtype=cache.dtype))


@pytest.mark.parametrize("bad", [
    dict(ids=[BLOCKS]), dict(ids=[-1]), dict(ids=[[0]]),
    dict(shape=(2, HEADS, 2 * SIZE, DIM)), dict(dtype=torch.float32),
])
def test_bad_input_is_refused_and_changes_nothing(bad: dict) -> None:
    cache = make_cache(PagedLayout.VLLM_CPU, "cpu")
    before = cache.clone()
    ids = bad.get("ids", [1])
    shape = bad.get("shape", (2, HEADS, SIZE, DIM))
    src = torch.ones(shape, dtype=bad.get("dtype", torch.bfloat16))
    with pytest.raises(LayoutMismatchError):
        scatter_layer(cache, PagedLayout.VLLM_CPU, ids, src)
    with pytest.raises(LayoutMismatchError):
        gather_layer(cache, PagedLayout.VLLM_CPU, ids, src)
    assert torch.equal(cache, before)


def test_a_cache_of_another_shape_is_refused() -> None:
    with pytest.raises(LayoutMismatchError):
        block_view(torch.zeros(BLOCKS, HEADS, SIZE, DIM), PagedLayout.VLLM_CPU, DIM)
    with pytest.raises(LayoutMismatchError):
        block_view(torch.zeros(BLOCKS, SIZE, HEADS, DIM), PagedLayout.FLASH, DIM)
