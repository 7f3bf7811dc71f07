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
- W: the median of our own cold loads in this run (the time of the cold load itself), and
  half of it.
- Cold load: each side's load with no wait, LMCache's through its blocking path.

Ours runs first (store, cold loads, preloaded loads), then LMCache's (one process: its disk
index lives in memory, so it stores the prefix itself), so the two never hold 10 GiB of
destination memory at the same time.
"""

from __future__ import annotations

import shutil
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from cmx.bench.core import BenchContext, Figure, GiB, Goal, SuiteResult, Table, median, timed
from cmx.bench.lmcache_env import Peer, PeerError, ensure_peer, run_driver
from cmx.bench.peer import driver_geometry
from cmx.bench.prefix import llama_layout, load_into, open_store, prefix_keys, put_prefix
from cmx.bench.storage import payload_pool
from cmx.buffers import aligned_empty
from cmx.policies.prefetch import make_prefetch

__all__ = ["BLOCK_TOKENS", "TOKENS_PER_GIB", "ThreadLoad", "prefix_tokens", "run_prefetch",
           "time_to_ready"]

BLOCK_TOKENS = 256
TOKENS_PER_GIB = 40_960  # 81,920 tokens (10 GiB of Llama-3-8B KV) at the default --gib 2
READY_GOAL = Goal("<=", 0.5)  # at most half LMCache's time-to-ready: >= 2x faster
WAIT_FRACTIONS = (1.0, 0.5)  # queue waits, as fractions of our median cold load


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


def _ours(ctx: BenchContext, tokens: int) -> dict[str, Any]:
    """Our store, cold loads and preloaded loads of the prefix; W is decided here."""
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
            waits = [f * median(out["cold_s"]) for f in WAIT_FRACTIONS]
            out["waits"] = waits
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


def _theirs(ctx: BenchContext, peer: Peer, tokens: int, waits: list[float]) -> dict[str, Any]:
    disk = ctx.scratch("prefetch-lmcache")
    layout = llama_layout(BLOCK_TOKENS)
    spec = {"op": "prefetch", "geometry": driver_geometry(), "chunk_tokens": BLOCK_TOKENS,
            "tokens": tokens, "disk_dir": str(disk), "seed": 80, "reps": ctx.config.reps,
            "waits": waits, "ring_tokens": 256 * 2**20 // layout.token_bytes,
            "store_batch_tokens": 16_384}
    ctx.log(f"prefetch: LMCache stores {tokens:,} tokens, then loads them "
            f"{ctx.config.reps * (1 + len(waits))} times")
    try:
        got = run_driver(peer, spec, ctx.scratch("lmcache-driver"), timeout=3600)
    finally:
        shutil.rmtree(disk, ignore_errors=True)
    # JSON keys are strings; map them back to the waits asked for, in order.
    got["ready_s"] = {w: got["ready_s"][str(w)] for w in waits}
    return got


def run_prefetch(ctx: BenchContext) -> SuiteResult:
    result = SuiteResult("prefetch", command="")
    tokens = prefix_tokens(ctx.config.gib)
    size = f"{tokens:,} tokens ({tokens * llama_layout(BLOCK_TOKENS).token_bytes / GiB:g} GiB)"
    ours = _ours(ctx, tokens)
    try:
        peer = ensure_peer(ctx)
        theirs = _theirs(ctx, peer, tokens, ours["waits"])
    except PeerError as exc:
        result.notes.append(f"LMCache could not be measured, so there are no figures: {exc}")
        result.tables.append(_table(ours, None, size))
        return result
    result.figures += _figures(ours, theirs, size)
    result.tables.append(_table(ours, theirs, size))
    result.notes += [
        f"peer: {peer.describe()}; enable_async_loading=True, local disk with O_DIRECT, no CPU "
        "hot cache; the scheduler's side (told by the engine when a prefetch is done) is "
        "played by the driver; cold loads set the engine's async_loading off for that call, "
        "so they take its blocking path (batched_get_blocking, 4 threads)",
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
    for i, w in enumerate(ours["waits"]):
        ready_o, ready_t = tuple(ours["ready_s"][w]), tuple(theirs["ready_s"][w])
        what = "our median cold load" if i == 0 else f"{WAIT_FRACTIONS[i]:g} x our cold load"
        label = f"time-to-KV-ready, {size}, queue wait {w:.2f} s ({what})"
        figures += [
            Figure("prefetch", label, "s", ready_o,
                   "LMCache async_lookup_and_prefetch at arrival", ready_t,
                   READY_GOAL if i == 0 else None,
                   note="ratio ≤ 0.5 is ≥ 2x faster than LMCache"),
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
    cold = median(ours["cold_s"])
    for w in ours["waits"]:
        rows.append((f"time-to-ready after a {w:.2f} s wait", cell(ours["ready_s"][w]),
                     cell(theirs["ready_s"][w]) if theirs else "n/a",
                     f"{time_to_ready(cold, w):.3f}"))
    return Table(f"Seconds, {size}: median (samples)",
                 ("", "ours", "LMCache", "ours by the model: max(0, cold load - wait)"),
                 tuple(rows))
