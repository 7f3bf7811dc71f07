"""Gather/scatter between an engine's paged KV cache and the service's KV tensor, on CUDA.

Depends on ``cmx.connectors.paged`` (written beside the engine connectors), whose interface
these tests hold it to:

    gather_layer(cache, layout: PagedLayout, block_ids, out) -> None
        copies blocks ``block_ids`` of one layer's paged cache into ``out``
        [2, kv_heads, n * block_size, head_dim] (one layer of the service's tensor form);
    scatter_layer(cache, layout, block_ids, src) -> None
        the inverse: writes ``src`` of that shape into those blocks;
    PagedLayout.VLLM_CPU / VLLM_FLASH / FLASH
        [blocks, kv_heads, block_size, 2 * head_dim] (K of all the block's tokens, then V) /
        the same shape, each token's row its K then its V / [2, blocks, block_size, kv_heads,
        head_dim].

Each result is compared, exactly, with plain torch indexing of the same cache (the reference);
and the number of CUDA kernels a gather launches must not grow with the number of blocks
(one indexed copy per layer and batch, never one per block).
"""

from __future__ import annotations

from typing import Any

HEADS, SIZE, DIM, BLOCKS = 8, 16, 128, 256


def _paged() -> Any:
    try:
        from cmx.connectors import paged
    except ImportError as exc:  # a failure, not a skip: the module is part of the GPU path
        raise AssertionError(f"cmx.connectors.paged is not in this checkout: {exc}") from exc
    return paged


def _cache(layout: Any, paged: Any) -> Any:
    import torch

    g = torch.Generator(device="cuda").manual_seed(0)
    if layout is paged.PagedLayout.FLASH:
        shape: tuple[int, ...] = (2, BLOCKS, SIZE, HEADS, DIM)
    else:
        shape = (BLOCKS, HEADS, SIZE, 2 * DIM)
    return torch.randn(shape, generator=g, device="cuda").to(torch.bfloat16)


def _reference(cache: Any, layout: Any, ids: list[int], paged: Any) -> Any:
    """[2, heads, n * size, dim] by plain indexing, block by block."""
    import torch

    parts = []
    for b in ids:
        if layout is paged.PagedLayout.FLASH:
            block = cache[:, b].permute(0, 2, 1, 3)  # [2, heads, size, dim]
        elif layout is paged.PagedLayout.VLLM_FLASH:
            block = cache[b].unflatten(-1, (2, DIM)).permute(2, 0, 1, 3)
        else:  # VLLM_CPU: a block-head's memory is K for every token, then V
            block = cache[b].reshape(HEADS, 2, SIZE, DIM).permute(1, 0, 2, 3)
        parts.append(block)
    return torch.cat(parts, dim=2).contiguous()


def test_gather_matches_torch_indexing_for_every_layout() -> None:
    import torch

    paged = _paged()
    ids = [5, 0, 200, 17, 17, 255, 3]  # out of order, repeated, both ends
    for layout in paged.PagedLayout:
        cache = _cache(layout, paged)
        out = torch.empty(2, HEADS, len(ids) * SIZE, DIM, dtype=cache.dtype, device="cuda")
        paged.gather_layer(cache, layout, torch.tensor(ids, device="cuda"), out)
        torch.cuda.synchronize()
        assert torch.equal(out, _reference(cache, layout, ids, paged)), layout


def test_scatter_writes_exactly_the_blocks_named_and_gather_reads_them_back() -> None:
    import torch

    paged = _paged()
    ids = [9, 100, 42, 254]
    for layout in paged.PagedLayout:
        cache = _cache(layout, paged)
        before = cache.clone()
        src = torch.randn(2, HEADS, len(ids) * SIZE, DIM, device="cuda").to(cache.dtype)
        paged.scatter_layer(cache, layout, ids, src)
        back = torch.empty_like(src)
        paged.gather_layer(cache, layout, ids, back)
        torch.cuda.synchronize()
        assert torch.equal(back, src), layout
        untouched = [b for b in range(BLOCKS) if b not in ids]
        assert torch.equal(_reference(cache, layout, untouched, paged),
                           _reference(before, layout, untouched, paged)), layout


def _kernels(fn: Any) -> int:
    import torch
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)


def test_a_gathers_kernel_count_does_not_grow_with_its_blocks() -> None:
    import torch

    paged = _paged()
    layout = paged.PagedLayout.VLLM_FLASH
    cache = _cache(layout, paged)
    counts = {}
    for n in (4, 128):
        ids = torch.arange(n, device="cuda")
        out = torch.empty(2, HEADS, n * SIZE, DIM, dtype=cache.dtype, device="cuda")
        paged.gather_layer(cache, layout, ids, out)  # warm
        counts[n] = _kernels(lambda ids=ids, out=out: paged.gather_layer(cache, layout, ids, out))
    assert counts[128] == counts[4] <= 6, f"kernels per gather by blocks: {counts}"


def test_a_scatter_from_a_loader_thread_has_landed_when_it_returns() -> None:
    """A loader thread writes on its own stream; the forward reads on another (vLLM runs its
    forward on a stream of its own). Once ``scatter_layer`` returns, the bytes must be there
    for a reader on any stream, with no synchronisation of the reader's own: the loader says
    "written" then. A long kernel queued ahead of the write on the loader's stream would let
    an unsynchronised write land late."""
    import threading

    import torch

    paged = _paged()
    layout = paged.PagedLayout.VLLM_CPU
    ids = [3, 77, 200]
    cache = _cache(layout, paged)
    src = torch.randn(2, HEADS, len(ids) * SIZE, DIM, device="cuda").to(cache.dtype)
    want = src.clone()
    torch.cuda.synchronize()

    def loader() -> None:
        torch.cuda._sleep(2_000_000_000)  # ~1 s of GPU time queued on this thread's stream
        paged.scatter_layer(cache, layout, ids, src)

    thread = threading.Thread(target=loader)
    thread.start()
    thread.join()
    reader = torch.cuda.Stream()  # not the loader's stream: nothing orders the two
    with torch.cuda.stream(reader):
        back = torch.empty_like(want)
        paged.gather_layer(cache, layout, ids, back)
    reader.synchronize()
    assert torch.equal(back, want)
