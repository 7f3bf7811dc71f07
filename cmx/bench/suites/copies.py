"""Suite "copies": what a local DRAM hit costs the caller's process, against a warm memcpy.

A 512 MiB prefix of 2 MiB blocks held in this node's DRAM tier is loaded through the client
four ways: into the caller's own warm buffer (``NamespaceClient.load_into``), into a new
tensor (``NamespaceClient.load``), into vLLM's paged CPU cache as the connector's worker loads
(``load_to`` a ``PagedSink``), and into the warm buffer unverified (only to show what the
check costs). Each repetition runs a load and a warm numpy memcpy of the same bytes back to
back, the order swapping every repetition (``intervals.alternated``). The figures are the
caller's CPU-seconds per GB (``getrusage`` of the whole process: the copy threads included)
and wall GB/s, each against the memcpy's of the same repetitions, with a bootstrap interval.
"""

from __future__ import annotations

import resource
import time
import uuid
from collections.abc import Callable
from typing import Any

import numpy as np

from cmx.bench.harness.cluster import bench_cluster
from cmx.bench.harness.core import BenchContext, Figure, Goal, MiB, SuiteResult, median
from cmx.bench.harness.intervals import alternated, ratio_interval
from cmx.config import ServiceConfig
from cmx.layout import KVLayout

__all__ = ["run_copies"]

LAYOUT = KVLayout(num_layers=32, num_kv_heads=8, head_dim=128, dtype="bfloat16",
                  block_tokens=16)  # 2 MiB blocks, Llama-3-8B's geometry
PREFIX_BYTES = 512 * MiB
SCATTER = "scatter into the KV layout"


def _cpu_s() -> float:
    use = resource.getrusage(resource.RUSAGE_SELF)
    return use.ru_utime + use.ru_stime


def _timed(fn: Callable[[], Any]) -> tuple[float, float]:
    """(CPU-seconds of this process, wall seconds) of one call."""
    c0, t0 = _cpu_s(), time.perf_counter()
    fn()
    return _cpu_s() - c0, time.perf_counter() - t0


def _series(reps: int, load: Callable[[], Any], memcpy: Callable[[], Any]
            ) -> tuple[list[tuple[float, float]], list[tuple[float, float]]]:
    """``reps`` pairs of (CPU, wall) of ``load`` and of ``memcpy``, alternated."""
    loads: list[tuple[float, float]] = []
    copies: list[tuple[float, float]] = []

    def one_load() -> float:
        loads.append(_timed(load))
        return 0.0

    def one_copy() -> float:
        copies.append(_timed(memcpy))
        return 0.0

    alternated(reps, one_load, one_copy)
    return loads, copies


def _cpu_figure(name: str, loads: list[tuple[float, float]],
                copies: list[tuple[float, float]], goal: Goal, note: str) -> Figure:
    gb = PREFIX_BYTES / 1e9
    a = [c / gb for c, _ in loads]
    b = [c / gb for c, _ in copies]
    return Figure("copies", name, "CPU-s/GB", tuple(a), "warm numpy memcpy of the same bytes",
                  tuple(b), goal, note=note, interval=ratio_interval(a, b))


def _budget(kv: Any, reps: int) -> dict[str, float]:
    """What each stage of a load costs this process alone, CPU-seconds per GB of ``kv``:
    a warm memcpy, XXH3, the scatter of block-major bytes into the KV tensor's layout (numpy
    alone, block by block into a warm tensor: the floor of any load into that layout), a
    fresh tensor's pages (touched one by one, and mapped in one call as ``empty_kv`` does)."""
    import torch

    from cmx.checksum import checksum
    from cmx.client.copy_out import kv_bytes, populate

    src = kv.view(torch.uint8).numpy().reshape(-1)
    gb = src.nbytes / 1e9
    dst = np.zeros_like(src)
    T = LAYOUT.block_tokens
    into = kv_bytes(torch.zeros_like(kv))
    n = into.shape[3] // T
    blocks = np.ascontiguousarray(  # each block's bytes together, as an arena slot holds them
        into.reshape(*into.shape[:3], n, T, -1).transpose(3, 0, 1, 2, 4, 5))

    def scatter() -> None:
        for b in range(n):
            np.copyto(into[:, :, :, b * T : (b + 1) * T], blocks[b])

    def touched() -> None:
        t = torch.empty(src.nbytes, dtype=torch.uint8)
        t.numpy()[::4096] = 1

    def mapped() -> None:
        t = torch.empty(src.nbytes, dtype=torch.uint8)
        populate(t.data_ptr(), src.nbytes)

    scatter()  # the tensor's pages mapped: every timed scatter is warm
    stages = {"warm memcpy": lambda: np.copyto(dst, src), "XXH3": lambda: checksum(src),
              SCATTER: scatter, "fresh pages touched": touched,
              "fresh pages mapped at once": mapped}
    return {name: median([_timed(fn)[0] for _ in range(reps)]) / gb
            for name, fn in stages.items()}


def _paged_caches(blocks: int) -> tuple[list[Any], list[int]]:
    """vLLM's paged CPU cache for ``LAYOUT`` (one [blocks, kv_heads, block_size, 2 * head_dim]
    tensor a layer, written once: warm), twice the blocks of a load, and the load's block ids,
    shuffled as a running engine's are."""
    import torch

    spec = LAYOUT
    caches = [torch.ones(2 * blocks, spec.num_kv_heads, spec.block_tokens, 2 * spec.head_dim,
                         dtype=spec.torch_dtype()) for _ in range(spec.num_layers)]
    ids = np.random.default_rng(1).permutation(2 * blocks)[:blocks].tolist()
    return caches, ids


def run_copies(ctx: BenchContext) -> SuiteResult:
    import torch

    from cmx.client.copy_out import COPY_THREADS, empty_kv

    result = SuiteResult("copies", command="cmx bench copies")
    blocks = PREFIX_BYTES // LAYOUT.block_bytes
    config = ServiceConfig(block_bytes=LAYOUT.block_bytes, hbm_bytes=32 * LAYOUT.block_bytes,
                           dram_bytes=(blocks + 32) * LAYOUT.block_bytes,
                           nvme_bytes=64 * LAYOUT.block_bytes,
                           nvme_dir=str(ctx.scratch("copies")), load_timeout_s=120)
    reps = max(3, 2 * ctx.config.reps)
    with bench_cluster(config) as bc:
        ns = bc.cm.namespace("bench-copies", LAYOUT, uuid.uuid4().hex[:8])
        toks = np.random.default_rng(0).integers(0, 50_000, blocks * LAYOUT.block_tokens)
        kv = LAYOUT.random_kv(len(toks), seed=0)
        ctx.log(f"copies: storing {blocks} blocks of {LAYOUT.block_bytes >> 20} MiB")
        if ns.store(toks, kv).wait() != blocks:
            raise AssertionError(f"stored fewer than {blocks} blocks")
        warm = empty_kv(LAYOUT, len(toks))
        warm.zero_()
        src = kv.view(torch.uint8).numpy().reshape(-1)
        dst = np.zeros_like(src)

        def into() -> None:
            if ns.load_into(toks, warm) != len(toks):
                raise AssertionError("a DRAM hit came back short")

        def new() -> None:
            if ns.load(toks).shape[3] != len(toks):
                raise AssertionError("a DRAM hit came back short")

        caches, ids = _paged_caches(blocks)

        def paged() -> None:  # as the vLLM connector's worker loads (vllm_worker)
            from cmx.connectors.paged import PagedLayout, PagedSink, WriteGate

            sink = PagedSink(caches, PagedLayout.VLLM_CPU, LAYOUT.head_dim, ids, WriteGate())
            if ns.load_to(sink, toks) != blocks:
                raise AssertionError("a DRAM hit came back short")

        def unverified() -> None:
            ns.verify = False
            try:
                into()
            finally:
                ns.verify = True

        def memcpy() -> None:
            np.copyto(dst, src)

        for fn in (into, new, paged, memcpy):  # each path's first run maps arenas, starts threads
            fn()
        if not torch.equal(warm.view(torch.int16), kv.view(torch.int16)):
            raise AssertionError("load_into brought other bytes than were stored")
        ctx.log(f"copies: {reps} alternated pairs of each load and a warm memcpy")
        into_s, copy_a = _series(reps, into, memcpy)
        new_s, copy_b = _series(reps, new, memcpy)
        paged_s, copy_c = _series(reps, paged, memcpy)
        bare_s, _ = _series(reps, unverified, memcpy)
        budget = _budget(kv, reps)
    gb = PREFIX_BYTES / 1e9
    bare = median([c for c, _ in bare_s]) / gb
    memcpy_cpu = median([c for c, _ in copy_a]) / gb
    threads = f"copied on {COPY_THREADS} thread(s)"
    result.figures.append(_cpu_figure(
        "local DRAM hit, 512 MiB into the caller's warm buffer (load_into): caller's CPU",
        into_s, copy_a, Goal("<=", 1.5),
        note=f"{threads}; the same load unverified {bare:.3f} CPU-s/GB "
             f"({bare / memcpy_cpu:.2f}x memcpy): the rest is XXH3; numpy alone scattering "
             f"the same blocks into this layout {budget[SCATTER]:.3f} "
             f"({budget[SCATTER] / memcpy_cpu:.2f}x memcpy), the floor of a load into it"))
    result.figures.append(_cpu_figure(
        "local DRAM hit, 512 MiB into a new tensor (load): caller's CPU", new_s, copy_b,
        Goal("<=", 3.0), note=f"{threads}; a fresh tensor's first touch is page faults"))
    result.figures.append(_cpu_figure(
        "local DRAM hit, 512 MiB into vLLM's paged CPU cache (load_to a PagedSink, as the "
        "connector's worker loads): caller's CPU", paged_s, copy_c, Goal("<=", 1.5),
        note=f"{threads}; {blocks} blocks to shuffled block ids of {LAYOUT.num_layers} layer "
             "caches [blocks, kv_heads, block_size, 2 * head_dim]"))
    a = [gb / w for _, w in into_s]
    b = [gb / w for _, w in copy_a]
    result.notes.append("the budget of a byte in the caller's process, CPU-s/GB, medians of "
                        f"{reps}: " + ", ".join(f"{k} {v:.3f}" for k, v in budget.items())
                        + f"; the whole load_into {median([c for c, _ in into_s]) / gb:.3f}, "
                        f"load {median([c for c, _ in new_s]) / gb:.3f}")
    result.figures.append(Figure(
        "copies", "local DRAM hit, 512 MiB into the caller's warm buffer (load_into): wall",
        "GB/s", tuple(a), "warm numpy memcpy of the same bytes", tuple(b), Goal(">=", 0.5),
        note=threads, interval=ratio_interval(a, b)))
    return result
