"""Suite "million": a million-token context at full scale in blocks, small in bytes.

A prefix of 1,000,000 tokens is 62,500 blocks of 16 tokens, the block count of the seed's case
(Llama-3-8B, 1M tokens), with a layout whose block is 16 KiB: 1 GB in all, held in the DRAM of
node "a" of the benchmarks' cluster (``cluster.bench_cluster``, DRAM sized to hold it all).
Through ``ContextMemory``, in order:

- store: ``ns.store(tokens, kv).wait()`` of the whole prefix, each repetition into a namespace
  of its own (the one before dropped, untimed), so each stores every block anew;
- lookup: ``ns.lookup(tokens)``, every block asked of the directory;
- the scheduler's lookup: ``vllm_scheduler.look_up`` as the vLLM connector's
  ``get_num_new_matched_tokens`` calls it (this node's tiers first, the prompt a tuple of ids);
- load: ``ns.load(tokens)`` into a new tensor, checked byte for byte against what was stored;
- load into a warm buffer: ``ns.load_into(tokens, buffer)``, the buffer loaded into before.

Each repetition of each runs beside a warm numpy memcpy of the same 1 GB (into a buffer
written before), the two alternated (``intervals.alternated``); its figure is the ratio of
medians with a bootstrap interval over the pairs. A lookup moves no bytes, so its goal is
absolute: its milliseconds against a budget of ``LOOKUP_BUDGET_MS`` (ratio <= 1, as the
"lookups" suite judges its p99), the memcpy beside it in the note. Every note gives the
control cost per block: the median seconds over 62,500.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import numpy as np

from cmx.bench.harness.cluster import bench_cluster
from cmx.bench.harness.core import BenchContext, Figure, Goal, MiB, SuiteResult, median
from cmx.bench.harness.intervals import alternated, ratio_interval
from cmx.config import ServiceConfig
from cmx.layout import KVLayout

__all__ = ["BLOCKS", "LAYOUT", "LOOKUP_BUDGET_MS", "run_million"]

LAYOUT = KVLayout(num_layers=4, num_kv_heads=2, head_dim=32, dtype="float16",
                  block_tokens=16)  # 16 KiB blocks
BLOCKS = 62_500  # 1,000,000 tokens
LOOKUP_BUDGET_MS = 100.0
SUITE = "million"


def _seconds(fn: Callable[[], Any]) -> Callable[[], float]:
    def run() -> float:
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0
    return run


def _per_block(seconds: float) -> str:
    return f"{seconds / BLOCKS * 1e6:.2f} µs a block"


def _against_memcpy(name: str, a: list[float], b: list[float], goal: Goal | None,
                    note: str) -> Figure:
    return Figure(SUITE, name, "s", tuple(a), "warm numpy memcpy of the same 1 GB, alternated",
                  tuple(b), goal, note=note, interval=ratio_interval(a, b))


def _lookup_figure(name: str, a: list[float], b: list[float], note: str) -> Figure:
    ms = [x * 1e3 for x in a]
    beside = ratio_interval(a, b)
    return Figure(SUITE, name, "ms", tuple(ms), "budget", (LOOKUP_BUDGET_MS,) * len(ms),
                  Goal("<=", 1.0),
                  note=f"{_per_block(median(a))}; {note}; beside a warm memcpy of the 1 GB it "
                       f"finds ({median(b) * 1e3:.0f} ms, alternated): {beside}")


def _drop(cm: Any, namespace: Any, tries: int = 10) -> None:
    """``drop_namespace``, again while a directory shard is still learning its sources'
    copies (it refuses to list a namespace it may know only in part)."""
    from cmx.errors import UnavailableError

    for left in reversed(range(tries)):
        try:
            cm.drop_namespace(namespace)
            return
        except UnavailableError:
            if not left:
                raise
            time.sleep(1.0)


def run_million(ctx: BenchContext) -> SuiteResult:
    import torch

    from cmx.connectors.vllm_scheduler import look_up

    result = SuiteResult(SUITE, command="cmx bench million")
    block = LAYOUT.block_bytes
    config = ServiceConfig(block_bytes=block, hbm_bytes=64 * MiB,
                           dram_bytes=(BLOCKS + 2048) * block, nvme_bytes=(BLOCKS + 8192) * block,
                           nvme_dir=str(ctx.scratch(SUITE)), call_timeout_s=60.0,
                           load_timeout_s=600.0)
    reps = ctx.config.reps
    toks = np.random.default_rng(0).integers(0, 50_000, BLOCKS * LAYOUT.block_tokens)
    prompt = tuple(toks.tolist())  # as vLLM's scheduler holds a request's prompt
    kv = LAYOUT.random_kv(len(toks), seed=0)
    src = kv.view(torch.uint8).numpy().reshape(-1)
    dst = np.ones_like(src)  # written once: every later copy into it is warm

    def memcpy() -> None:
        np.copyto(dst, src)

    with bench_cluster(config) as bc:
        cm = bc.cm
        namespaces: list[Any] = []

        def store() -> float:
            if namespaces:  # the last one's blocks go first, untimed: DRAM holds one prefix
                _drop(cm, namespaces[-1].namespace)
            namespaces.append(cm.namespace("bench-million", LAYOUT, f"r{len(namespaces)}"))
            t0 = time.perf_counter()
            stored = namespaces[-1].store(toks, kv).wait()
            seconds = time.perf_counter() - t0
            if stored != BLOCKS:
                raise AssertionError(f"stored {stored} of {BLOCKS} blocks")
            return seconds

        ctx.log(f"million: {reps} stores of {BLOCKS:,} blocks of {block >> 10} KiB, each "
                "beside a warm memcpy")
        stored, store_copy = alternated(reps, store, _seconds(memcpy))
        ns = namespaces[-1]

        def lookup() -> None:
            if ns.lookup(toks).num_blocks != BLOCKS:
                raise AssertionError("a lookup found less than was stored")

        def scheduler() -> None:
            if look_up(ns, prompt, None).num_blocks != BLOCKS:
                raise AssertionError("the scheduler's lookup found less than was stored")

        def load() -> None:
            if ns.load(toks).shape[3] != len(toks):
                raise AssertionError("a DRAM hit came back short")

        def load_into() -> None:
            if ns.load_into(toks, into) != len(toks):
                raise AssertionError("a DRAM hit came back short")

        for fn in (lookup, scheduler):  # the first calls of each actor, the tables mapped
            fn()
        got = ns.load(toks)
        if not torch.equal(got.view(torch.int16), kv.view(torch.int16)):
            raise AssertionError("the load brought other bytes than were stored")
        del got
        ctx.log(f"million: {5 * reps} lookups each way, {reps} loads, each beside a memcpy")
        looked, look_copy = alternated(5 * reps, _seconds(lookup), _seconds(memcpy))
        planned, plan_copy = alternated(5 * reps, _seconds(scheduler), _seconds(memcpy))
        blocks = look_up(ns, prompt, None).blocks
        t0 = time.perf_counter()
        places = [(b.tier.value, b.node) for b in blocks]  # what the scheduler's plan reads
        read_s = time.perf_counter() - t0
        loaded, load_copy = alternated(reps, _seconds(load), _seconds(memcpy))
        into = torch.zeros_like(kv)  # written: every load into it is warm
        load_into()
        if not torch.equal(into.view(torch.int16), kv.view(torch.int16)):
            raise AssertionError("the load into a buffer brought other bytes than were stored")
        loaded_into, into_copy = alternated(reps, _seconds(load_into), _seconds(memcpy))
    if len(places) != BLOCKS:
        raise AssertionError(f"read {len(places)} of {BLOCKS} blocks")
    result.figures.append(_against_memcpy(
        f"store of a 1M-token prefix ({BLOCKS:,} blocks of 16 KiB, 1 GB) into DRAM here: "
        "ContextMemory store", stored, store_copy, None,
        note=f"{_per_block(median(stored))}, the copy included"))
    result.figures.append(_lookup_figure(
        "lookup of that prefix, held in DRAM here: ContextMemory lookup (every block asked of "
        "the directory)", looked, look_copy, "its block keys hashed, then one call a directory "
        "shard, keys and answer each one buffer"))
    result.figures.append(_lookup_figure(
        "lookup of that prefix as the vLLM connector's scheduler makes it (look_up: this "
        "node's tiers first, the prompt a tuple of ids)", planned, plan_copy,
        f"then reading every block's tier and node, as the scheduler's plan does (a "
        f"BlockLocation made for each as it is read): {read_s * 1e3:.0f} ms more"))
    extra = (median(loaded) - median(load_copy)) / BLOCKS * 1e6
    result.figures.append(_against_memcpy(
        "load of that prefix, a DRAM hit here, into a new tensor: ContextMemory load",
        loaded, load_copy, Goal("<=", 2.0),
        note=f"{_per_block(median(loaded))} in all, {extra:.2f} µs a block beyond the "
             f"memcpy's; checked byte for byte once"))
    extra = (median(loaded_into) - median(into_copy)) / BLOCKS * 1e6
    result.figures.append(_against_memcpy(
        "load of that prefix, a DRAM hit here, into the caller's warm buffer: ContextMemory "
        "load_into", loaded_into, into_copy, Goal("<=", 2.0),
        note=f"{_per_block(median(loaded_into))} in all, {extra:.2f} µs a block beyond the "
             f"memcpy's; checked byte for byte once"))
    return result
