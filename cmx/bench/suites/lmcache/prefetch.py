"""Suite "prefetch": time from a request leaving the queue to its 80K-token prefix being ready.

py-kvcache's scenario. A request whose prefix is on NVMe arrives and waits W seconds in the
queue before a replica is free for it. Loading can start at arrival (scheduler-aware
preloading) or only when the request is scheduled. Time-to-KV-ready is measured from the end
of the wait to the moment every byte of the prefix is in the destination.

- The prefix: Llama-3-8B (32 layers, 8 KV heads, head_dim 128, bfloat16), 256-token blocks;
  ``40,960 x --gib`` tokens, so the default ``--gib 2`` is the 80K-token (10 GiB) prefix and
  a smoke run can be small.
- Ours: NvmeStore, one ``get_many_into`` of the prefix, every block into its own slot of a
  page-aligned destination faulted in beforehand. The load starts on a thread at the
  request's arrival; after W the replica waits with the ``wait_complete`` prefetch policy,
  and what it waits is the time-to-ready.
- LMCache 0.5, local disk backend with O_DIRECT, the same bytes on the same disk. With
  ``enable_async_loading`` it has a prefetch call, ``async_lookup_and_prefetch``, which vLLM's
  scheduler makes when it first looks a request up: chunks are read into LMCache's CPU memory
  while the request waits; the request is scheduled when the engine reports the prefetch done,
  and ``retrieve`` then copies the chunks into the KV cache. That is what it is measured
  doing, at arrival, with the same W. Without async loading it loads only when the request is
  scheduled: its time-to-ready is then its whole blocking load (``time_to_ready`` with no
  preloading), shown beside it.
- W: fixed in seconds (``QUEUE_WAITS_S``: 0, 1, 2, 3 and 4 s), set by neither side: no
  measurement of this run moves them. A wait derived from one side's load would favour it (a
  wait of our own cold load lets our preload finish by construction; one of LMCache's, LMCache's
  prefetch). They sweep from no head start at all to 80-85% of either side's cold load of
  the default 10 GiB prefix on these machines (4.7 s ours, 5.0 s LMCache's, 2026-11-29), in
  even steps, and stop short of both loads, where either side's time would be only what is
  left after its bytes arrived. At a smaller ``--gib`` the later waits outlast the loads.
  Every wait is judged on its own against the same goal (``READY_GOAL``). LMCache's driver is
  handed the same waits, and the suite checks that it waited them.
- Cold load: each side's load with no wait, LMCache's through its blocking path.

LMCache's side runs first (one process: its disk index lives in memory, so it stores the prefix
itself; cold loads, then preloaded loads), then ours (store, cold loads, preloaded loads), so
the two never hold 10 GiB of destination memory at the same time. If LMCache cannot be
measured there is no baseline: ours makes its cold loads alone, and no figure.
"""

from __future__ import annotations

import shutil
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from cmx.bench.harness.core import (
    BenchContext,
    Figure,
    GiB,
    Goal,
    SuiteResult,
    Table,
    median,
    timed,
)
from cmx.bench.harness.payloads import payload_pool
from cmx.bench.suites.lmcache.lmcache_env import Peer, PeerError, ensure_peer, run_driver
from cmx.bench.suites.lmcache.peer import driver_geometry
from cmx.bench.suites.lmcache.prefix import (
    llama_layout,
    load_into,
    open_store,
    prefix_keys,
    put_prefix,
)
from cmx.buffers import aligned_empty
from cmx.policies.prefetch import make_prefetch

__all__ = ["BLOCK_TOKENS", "QUEUE_WAITS_S", "READY_GOAL", "TOKENS_PER_GIB", "ThreadLoad",
           "prefix_tokens", "run_prefetch", "time_to_ready"]

BLOCK_TOKENS = 256
TOKENS_PER_GIB = 40_960  # 81,920 tokens (10 GiB of Llama-3-8B KV) at the default --gib 2
READY_GOAL = Goal("<=", 0.5)  # at most half LMCache's time-to-ready: >= 2x faster
QUEUE_WAITS_S = (0.0, 1.0, 2.0, 3.0, 4.0)  # seconds in the queue, fixed: set by neither side


def prefix_tokens(gib: float, block_tokens: int = BLOCK_TOKENS) -> int:
    """Tokens of the prefix for ``--gib``: whole blocks, at least one."""
    blocks = int(gib * TOKENS_PER_GIB) // block_tokens
    return max(1, blocks) * block_tokens


def time_to_ready(load_s: float, wait_s: float, residual_s: float = 0.0,
                  preload: bool = True) -> float:
    """Seconds from the end of a queue wait of ``wait_s`` to the KV being ready.

    A preloading loader started at arrival has ``wait_s`` of its ``load_s`` behind it when the
    request is scheduled; ``residual_s`` is what remains after the bytes have arrived (a copy
    into the KV cache). Without preloading the whole load comes after the wait.
    """
    if min(load_s, wait_s, residual_s) < 0:
        raise ValueError(f"times must be >= 0: load {load_s}, wait {wait_s}, "
                         f"residual {residual_s}")
    if not preload:
        return load_s + residual_s
    return max(0.0, load_s - wait_s) + residual_s


class ThreadLoad:
    """A load started now on its own thread; a ``PendingPrefetch`` for the prefetch policies."""

    def __init__(self, load: Callable[[], None], clock: Callable[[], float]) -> None:
        self.started_s = clock()
        self.error: BaseException | None = None
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(load,), daemon=True,
                                        name="cmx-bench-preload")
        self._thread.start()

    def _run(self, load: Callable[[], None]) -> None:
        try:
            load()
        except BaseException as exc:  # handed to the waiter, who raises it
            self.error = exc
        finally:
            self._done.set()

    def done(self) -> bool:
        return self._done.is_set()

    def wait(self, timeout_s: float) -> bool:
        return self._done.wait(timeout_s)

    def result(self) -> None:
        """Join the load; raise what it raised."""
        self._thread.join()
        if self.error is not None:
            raise self.error


def _ours(ctx: BenchContext, tokens: int, waits: list[float]) -> dict[str, Any]:
    """Our store, cold loads, and preloaded loads of the prefix after each wait in ``waits``."""
    layout = llama_layout(BLOCK_TOKENS)
    blocks = tokens // BLOCK_TOKENS
    block = layout.block_bytes
    keys = prefix_keys(layout, blocks, seed=80)
    pool = payload_pool(block)
    root = ctx.work / "prefetch-ours"
    dest = aligned_empty(blocks * block)
    dest[:] = 0  # the destination is an arena faulted in long before any request
    policy = make_prefetch("wait_complete", max_wait_s=3600.0)
    clock = time.perf_counter
    out: dict[str, Any] = {"cold_s": [], "ready_s": {}}
    try:
        store = open_store(root, blocks, block)
        with store:
            ctx.log(f"prefetch: storing {tokens:,} tokens ({blocks * block / GiB:g} GiB), ours")
            out["store_s"] = timed(lambda: put_prefix(store, keys, pool))
            for rep in range(ctx.config.reps):
                ctx.log(f"prefetch ours: cold load {rep + 1}/{ctx.config.reps}")
                ctx.drop_cache()
                out["cold_s"].append(timed(lambda: load_into(store, keys, dest)))
                _check(dest, block, blocks, pool)
            out["waits"] = list(waits)
            for rep in range(ctx.config.reps):
                for w in waits:
                    ctx.log(f"prefetch ours: wait {w:.2f} s, {rep + 1}/{ctx.config.reps}")
                    dest[::4096] = 0  # the previous load's bytes must not count
                    ctx.drop_cache()
                    load = ThreadLoad(lambda: load_into(store, keys, dest), clock)
                    time.sleep(w)
                    waited = policy.wait(load, clock)
                    load.result()
                    _check(dest, block, blocks, pool)
                    out["ready_s"].setdefault(w, []).append(waited.waited_s)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return out


def _check(dest: np.ndarray, block: int, blocks: int, pool: list[np.ndarray]) -> None:
    for i in {0, blocks // 2, blocks - 1}:
        if not np.array_equal(dest[i * block:(i + 1) * block], pool[i % len(pool)]):
            raise AssertionError(f"block {i} of the prefix loaded wrong bytes")


def _theirs(ctx: BenchContext, peer: Peer, tokens: int) -> dict[str, Any]:
    """LMCache's store, cold loads, then preloaded loads after each of ``QUEUE_WAITS_S``."""
    disk = ctx.scratch("prefetch-lmcache")
    layout = llama_layout(BLOCK_TOKENS)
    spec = {"op": "prefetch", "geometry": driver_geometry(), "chunk_tokens": BLOCK_TOKENS,
            "tokens": tokens, "disk_dir": str(disk), "seed": 80, "reps": ctx.config.reps,
            "waits": list(QUEUE_WAITS_S),
            "ring_tokens": 256 * 2**20 // layout.token_bytes, "store_batch_tokens": 16_384}
    ctx.log(f"prefetch: LMCache stores {tokens:,} tokens, then loads them "
            f"{ctx.config.reps * (1 + len(QUEUE_WAITS_S))} times")
    try:
        got = run_driver(peer, spec, ctx.scratch("lmcache-driver"), timeout=3600)
    finally:
        shutil.rmtree(disk, ignore_errors=True)
    return _theirs_waited(got, ctx.config.reps)


def _theirs_waited(got: dict[str, Any], reps: int) -> dict[str, Any]:
    """The driver's answer with ``ready_s`` keyed by wait; PeerError if it did not wait
    ``QUEUE_WAITS_S``, each with one time per repetition (``reps``)."""
    waits = [float(w) for w in got["waits"]]
    if waits != list(QUEUE_WAITS_S) or len(got["ready_s"]) != len(waits):
        raise PeerError(f"LMCache's driver waited {waits} s, not the suite's fixed "
                        f"{list(QUEUE_WAITS_S)} s")
    counts = [len(r) for r in got["ready_s"]]
    if any(n != reps for n in counts):
        raise PeerError(f"LMCache's driver timed {counts} loads at the waits, not {reps} each")
    return {**got, "waits": waits,
            "ready_s": {w: list(r) for w, r in zip(waits, got["ready_s"], strict=True)}}


def run_prefetch(ctx: BenchContext) -> SuiteResult:
    result = SuiteResult("prefetch", command="")
    tokens = prefix_tokens(ctx.config.gib)
    size = f"{tokens:,} tokens ({tokens * llama_layout(BLOCK_TOKENS).token_bytes / GiB:g} GiB)"
    try:
        peer = ensure_peer(ctx)
        theirs = _theirs(ctx, peer, tokens)
    except PeerError as exc:
        ours = _ours(ctx, tokens, [])
        result.notes.append(f"LMCache could not be measured, so there is no baseline and no "
                            f"figure: {exc}")
        result.tables.append(_table(ours, None, size))
        return result
    ours = _ours(ctx, tokens, list(QUEUE_WAITS_S))
    result.figures += _figures(ours, theirs, size)
    result.tables.append(_table(ours, theirs, size))
    result.notes += [
        f"peer: {peer.describe()}; enable_async_loading=True, local disk with O_DIRECT, no CPU "
        "hot cache; the scheduler's side (told by the engine when a prefetch is done) is "
        "played by the driver; cold loads set the engine's async_loading off for that call, "
        "so they take its blocking path (batched_get_blocking, 4 threads)",
        f"queue waits: {', '.join(f'{w:g}' for w in QUEUE_WAITS_S)} s, fixed in the suite "
        "(QUEUE_WAITS_S) and set by neither side; each judged on its own",
        f"ours: NvmeStore get_many_into of the prefix, into a page-aligned destination; "
        f"prefix stored in {ours['store_s']:.1f} s (put_many + flush), LMCache's in "
        f"{theirs['store_s']:.1f} s",
        "time-to-ready starts when the queue wait ends; a load that finished during the wait "
        "counts 0; LMCache's includes retrieve's copy of the prefetched chunks into the KV "
        "tensor, ours has none (the load lands in the destination itself)",
        f"cold reads: {ctx.cold_read_method}",
    ]
    if not theirs.get("verified", False):
        result.notes.append("LMCache's retrieved KV did not match what it stored")
    return result


def _figures(ours: dict[str, Any], theirs: dict[str, Any], size: str) -> list[Figure]:
    cold_o, cold_t = tuple(ours["cold_s"]), tuple(theirs["cold_s"])
    figures = [Figure("prefetch", f"cold load, {size}, no queue wait", "s", cold_o,
                      "LMCache blocking retrieve", cold_t)]
    # A wait that outlasts either side's cold load judges nothing: that side is done when the
    # wait ends, by construction, whatever its preloading is worth.
    shortest = min(median(cold_o), median(cold_t))
    for w in QUEUE_WAITS_S:
        ready_o, ready_t = tuple(ours["ready_s"][w]), tuple(theirs["ready_s"][w])
        label = f"time-to-KV-ready, {size}, queue wait {w:g} s (fixed)"
        judged = w < shortest
        figures += [
            Figure("prefetch", label, "s", ready_o,
                   "LMCache async_lookup_and_prefetch at arrival", ready_t,
                   READY_GOAL if judged else None,
                   note="ratio ≤ 0.5 is ≥ 2x faster than LMCache" if judged else
                   f"not judged: the wait outlasts a cold load ({shortest:.2f} s), so a side "
                   "is done when it ends, by construction"),
            Figure("prefetch", f"{label}, against no preloading", "s", ready_o,
                   "LMCache without async loading: its blocking load after the wait",
                   tuple(time_to_ready(c, w, preload=False) for c in cold_t)),
        ]
    return figures


def _table(ours: dict[str, Any], theirs: dict[str, Any] | None, size: str) -> Table:
    def cell(samples: list[float] | tuple[float, ...] | None) -> str:
        if not samples:
            return "n/a"
        return f"{median(samples):.3f} ({' / '.join(f'{s:.3f}' for s in samples)})"

    rows = [("cold load (no wait)", cell(ours["cold_s"]),
             cell(theirs["cold_s"]) if theirs else "n/a", "")]
    cold = median(ours["cold_s"])  # the model's load is ours
    for w in ours["waits"]:
        rows.append((f"time-to-ready after a {w:g} s wait", cell(ours["ready_s"][w]),
                     cell(theirs["ready_s"][w]) if theirs else "n/a",
                     f"{time_to_ready(cold, w):.3f}"))
    return Table(f"Seconds, {size}: median (samples)",
                 ("", "ours", "LMCache", "ours by the model: max(0, cold load - wait)"),
                 tuple(rows))
