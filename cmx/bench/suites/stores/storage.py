"""Suites "nvme" and "dram": the block stores against the machine's own limits.

- ``nvme``: with 32 MiB blocks (256 tokens of Llama-3-8B) and 2 MiB blocks (16 tokens of the
  same geometry), ``--gib`` GiB, in prefix order: ``put_many`` of every block (in batches of
  256 MiB) then ``flush`` (durable), the call that stores a prefix; ``get_many_into`` of every
  block into page-aligned slots of a faulted-in 256 MiB arena, the call that loads a prefix;
  beside them ``put`` one block at a time then ``flush``, ``get_many`` (a fresh buffer per
  block) and ``get_into`` one block at a time. Baselines: fio O_DIRECT sequential write and
  read, 1 MiB I/Os at queue depth 16, run in the same repetition just before the store's
  passes. Goals judge put_many+flush and get_many_into. The write baseline writes the same
  bytes once into a new file and fsyncs it, as put_many+flush does; fio's time-based overwrite
  of a laid-out file, with no fsync, is shown beside it. The service's own NVMe path (the
  tier's ExtentBooks deciding, the agent's ExtentPlane moving the bytes: ``plane_io``) is
  measured on the same bytes and judged by the same goals.
- ``dram``: DramStore ``put``, ``get_into`` and ``get`` of the same bytes against numpy memcpy
  into a faulted-in destination of the same size, measured in the same repetition, on as many
  threads as the store copies with: the store splits large copies over the cores this process
  may use (``cmx.buffers.copy_bytes``), so the baseline does too (``baselines.ThreadedMemcpy``:
  piece ``j`` of every block on thread ``j``, one hand-off per pass). One thread's memcpy, and
  the store's copy alone into shared memory, are shown beside it.

Each repetition uses a new store in a new directory, removed afterwards. Payloads come from a
pool of random blocks (256 MiB in all, ``payloads.payload_pool``), each put under its own key.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable, Mapping, Sequence
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from cmx.bench.harness.baselines import (
    FioJob,
    ThreadedMemcpy,
    copy_threads,
    fio_bandwidth,
    fio_engine,
)
from cmx.bench.harness.core import (
    GB,
    BenchContext,
    Figure,
    Goal,
    KiB,
    MiB,
    SuiteResult,
    Table,
    timed,
)
from cmx.bench.harness.payloads import POOL_BYTES, block_keys, payload_pool
from cmx.bench.suites.stores.plane_io import plane_pass
from cmx.buffers import PARALLEL_MIN_BYTES, aligned_empty, copy_bytes
from cmx.keys import BlockHash

if TYPE_CHECKING:
    from cmx.storage import NvmeStore

__all__ = ["dram_figures", "io_histogram", "run_dram", "run_nvme", "size_label"]

# (block bytes, label, goal: ratio to fio 1 MiB QD16)
NVME_BLOCKS = (
    (32 * MiB, "32 MiB blocks (256 tokens)", 0.85),
    (2 * MiB, "2 MiB blocks (16 tokens)", 0.8),
)
DRAM_GOAL = Goal(">=", 0.8)


def _put_all(store: NvmeStore, keys: list[BlockHash], pool: list[np.ndarray]) -> None:
    """Put every key one at a time, then flush."""
    parent = None
    for i, key in enumerate(keys):
        store.put(key, pool[i % len(pool)], parent=parent)
        parent = key
    store.flush()


def _put_many_all(store: NvmeStore, keys: list[BlockHash], pool: list[np.ndarray],
                  block_bytes: int) -> None:
    """Put every key with ``put_many``, 256 MiB of blocks per call, then flush."""
    batch = max(1, POOL_BYTES // block_bytes)
    for start in range(0, len(keys), batch):
        items = [(keys[i], pool[i % len(pool)], keys[i - 1] if i else None)
                 for i in range(start, min(len(keys), start + batch))]
        if not all(store.put_many(items)):
            raise AssertionError("NvmeStore refused a new block")
    store.flush()


def _get_into_all(store: NvmeStore, keys: list[BlockHash], out: np.ndarray) -> None:
    for key in keys:
        if not store.get_into(key, out):
            raise AssertionError(f"NvmeStore lost block {key.hex()[:12]}")


def _get_many_all(store: NvmeStore, keys: list[BlockHash], block_bytes: int) -> None:
    batch = max(1, POOL_BYTES // block_bytes)  # bounds the memory the results hold
    for start in range(0, len(keys), batch):
        if any(b is None for b in store.get_many(keys[start:start + batch])):
            raise AssertionError("NvmeStore lost a block")


def _get_many_into_all(store: NvmeStore, keys: list[BlockHash], arena: np.ndarray,
                       block_bytes: int) -> None:
    slots = [arena[j:j + block_bytes] for j in range(0, arena.nbytes, block_bytes)]
    for start in range(0, len(keys), len(slots)):
        batch = keys[start:start + len(slots)]
        if not all(store.get_many_into(batch, slots[:len(batch)])):
            raise AssertionError("NvmeStore lost a block")


def _nvme_pass(ctx: BenchContext, root: Path, block_bytes: int, n: int,
               pool: list[np.ndarray]) -> tuple[dict[str, float], dict[str, object]]:
    """Bytes/s of each way to store and load ``n`` blocks in one fresh store, and its stats."""
    from cmx.storage import NvmeStore

    keys = block_keys(n, root.name.encode() + b"/many")
    keys_one = block_keys(n, root.name.encode() + b"/one")
    total = n * block_bytes
    capacity = 2 * total + total // 2 + block_bytes
    store = NvmeStore(root, capacity_bytes=capacity, block_bytes=block_bytes)
    rates: dict[str, float] = {}
    try:
        rates["put_many"] = total / timed(lambda: _put_many_all(store, keys, pool, block_bytes))
        arena = aligned_empty(max(block_bytes, POOL_BYTES // block_bytes * block_bytes))
        arena[:] = 0  # faulted in, as an arena is: page faults are not I/O
        ctx.drop_cache()
        rates["get_many_into"] = total / timed(
            lambda: _get_many_into_all(store, keys, arena, block_bytes))
        ctx.drop_cache()
        rates["get_many"] = total / timed(lambda: _get_many_all(store, keys, block_bytes))
        ctx.drop_cache()
        out = arena[:block_bytes]
        rates["get_into"] = total / timed(lambda: _get_into_all(store, keys, out))
        rates["put"] = total / timed(lambda: _put_all(store, keys_one, pool))
        extra = dict(store.stats().extra)
        store.check_integrity()
    finally:
        store.close()
        shutil.rmtree(root, ignore_errors=True)
    return {k: v / GB for k, v in rates.items()}, extra


def run_nvme(ctx: BenchContext) -> SuiteResult:
    result = SuiteResult("nvme", command="")
    engine = fio_engine(ctx)
    wjob, rjob = FioJob("write", MiB, 16), FioJob("read", MiB, 16)
    fresh = FioJob("write", MiB, 16, fresh=True)
    for block_bytes, label, goal in NVME_BLOCKS:
        n = max(1, ctx.config.nbytes // block_bytes)
        pool = payload_pool(block_bytes)
        rates: dict[str, list[float]] = {}
        fio_w, fio_r, fio_new = [], [], []
        extra: dict[str, object] = {}
        for rep in range(ctx.config.reps):
            ctx.log(f"nvme {label}, rep {rep + 1}/{ctx.config.reps}")
            fio_w.append(fio_bandwidth(ctx, wjob) / GB)
            fio_r.append(fio_bandwidth(ctx, rjob) / GB)
            fio_new.append(fio_bandwidth(ctx, fresh) / GB)
            root = ctx.work / f"nvme-{block_bytes // MiB}m-{rep}"
            got, extra = _nvme_pass(ctx, root, block_bytes, n, pool)
            got.update(plane_pass(ctx, root.with_name(root.name + "-plane"), block_bytes,
                                  block_keys(n, root.name.encode() + b"/plane"), pool))
            for k, v in got.items():
                rates.setdefault(k, []).append(v)
        size = f"{n * block_bytes / 2**30:g} GiB"
        w = (f"{fresh.label}, {size}, {engine}", tuple(fio_new))
        r = (f"{rjob.label}, {engine}", tuple(fio_r))
        result.figures += [
            Figure("nvme", f"NvmeStore put_many+flush, {label}, {size}", "GB/s",
                   tuple(rates["put_many"]), *w, Goal(">=", goal)),
            Figure("nvme", f"NvmeStore get_many_into, {label}, {size}", "GB/s",
                   tuple(rates["get_many_into"]), *r, Goal(">=", goal)),
            Figure("nvme", f"service path: ExtentPlane.write_many+commit+flush, {label}, "
                   f"{size}", "GB/s", tuple(rates["plane_write"]), *w, Goal(">=", goal),
                   note="what the agent and the NVMe tier do for a write-through store, "
                        "without Ray (plane_io.py)"),
            Figure("nvme", f"service path: ExtentPlane.read_many, {label}, {size}", "GB/s",
                   tuple(rates["plane_read"]), *r, Goal(">=", goal),
                   note="what the agent does for a load from the NVMe tier (BlockReader over "
                        "ExtentIo), without Ray"),
            Figure("nvme", f"NvmeStore put_many+flush, {label}, {size}, against overwrites",
                   "GB/s", tuple(rates["put_many"]), f"{wjob.label}, {engine}", tuple(fio_w),
                   note="fio rewriting a laid-out file for a fixed time, with no fsync: the "
                        "disk acknowledges writes its host may still hold in a cache"),
            Figure("nvme", f"NvmeStore put one by one+flush, {label}, {size}", "GB/s",
                   tuple(rates["put"]), *w,
                   note="one block's writes in flight at a time"),
            Figure("nvme", f"NvmeStore get_many (new buffers), {label}, {size}", "GB/s",
                   tuple(rates["get_many"]), *r,
                   note="allocates and faults in a result buffer per block"),
            Figure("nvme", f"NvmeStore get_into one by one, {label}, {size}", "GB/s",
                   tuple(rates["get_into"]), *r,
                   note="one block in flight at a time: its own I/Os only"),
        ]
        engine_desc = f"io_engine={extra.get('io_engine')}, queue_depth={extra.get('queue_depth')}"
        result.tables.append(_histogram_table(
            f"NvmeStore disk I/O sizes, {label}, last repetition, all passes ({engine_desc})",
            extra))
    result.notes += [
        "stores are judged on put_many+flush (durable), the call that stores a prefix; loads on "
        "get_many_into, the call that loads a prefix into arena slots",
        f"cold reads: {ctx.cold_read_method}",
    ]
    return result


# Where NvmeStore.stats().extra keeps its I/O size histograms (bucket bytes -> I/Os).
_HISTOGRAM_KEYS = {
    "read": ("io_size_histogram", "read_io_size_histogram", "read_io_sizes"),
    "write": ("write_io_size_histogram", "write_io_sizes"),
}


def io_histogram(extra: Mapping[str, object], op: str) -> dict[int, int]:
    """The store's histogram of ``op`` ("read" or "write") I/O sizes; {} if it keeps none."""
    for name in _HISTOGRAM_KEYS[op]:
        if name in extra:
            # The ignore below: extra maps names to ints or dicts
            return {int(k): int(v) for k, v in dict(extra[name]).items()}  # type: ignore[call-overload]
    return {}


def _histogram_table(title: str, extra: dict[str, object]) -> Table:
    rows = []
    for op in ("write", "read"):
        hist = io_histogram(extra, op)
        rows += [(op, size_label(size), str(count)) for size, count in sorted(hist.items())]
    return Table(title, ("op", "I/O size (bucket: next power of two)", "count"),
                 tuple(rows) or (("", "(not reported)", ""),))


def size_label(n: int) -> str:
    """``n`` bytes as "4 KiB", "1.5 MiB" or "512 B"."""
    for unit, name in ((MiB, "MiB"), (KiB, "KiB")):
        if n >= unit:
            return f"{n / unit:g} {name}"
    return f"{n} B"


def _copy_all(dst: np.ndarray, pool: list[np.ndarray], n: int, block_bytes: int,
              copy: Callable[[np.ndarray, np.ndarray], object] = np.copyto) -> None:
    for i in range(n):
        copy(dst[i * block_bytes:(i + 1) * block_bytes], pool[i % len(pool)])


def _shm_memcpy(pool: list[np.ndarray], n: int, block_bytes: int) -> tuple[float, float]:
    """Bytes/s of numpy memcpy, then of ``copy_bytes`` (the stores' copy, split over the
    cores), into a faulted-in POSIX shared-memory mapping, as the arena's."""
    from multiprocessing import shared_memory

    shm = shared_memory.SharedMemory(create=True, size=n * block_bytes)
    try:
        dst = np.ndarray((n * block_bytes,), np.uint8, shm.buf)
        dst[:] = 0
        plain = timed(partial(_copy_all, dst, pool, n, block_bytes))
        split = timed(partial(_copy_all, dst, pool, n, block_bytes, copy_bytes))
        del dst  # the mapping cannot close while an array still points into it
    finally:
        shm.close()
        shm.unlink()
    return n * block_bytes / plain, n * block_bytes / split


def _dram_pass(block_bytes: int, n: int, pool: list[np.ndarray], dst: np.ndarray,
               memcpy: ThreadedMemcpy) -> dict[str, float]:
    """GB/s of memcpy (on the stores' threads, on one, into shared memory), put, get_into and
    get over ``n`` blocks."""
    from cmx.storage import DramStore

    total = n * block_bytes
    rates = {"memcpy": total / timed(lambda: memcpy.copy(dst, pool, n, block_bytes)),
             "memcpy1": total / timed(lambda: _copy_all(dst, pool, n, block_bytes))}
    rates["shm"], rates["shm_split"] = _shm_memcpy(pool, n, block_bytes)
    keys = block_keys(n, b"dram")
    store = DramStore(capacity_bytes=total, block_bytes=block_bytes)
    with store:
        def put_all() -> None:
            for i, key in enumerate(keys):
                store.put(key, pool[i % len(pool)])

        def get_into_all() -> None:
            for i, key in enumerate(keys):
                store.get_into(key, dst[i * block_bytes:(i + 1) * block_bytes])

        def get_all() -> None:
            for key in keys:  # each result dropped at once, as a caller done with it would
                store.get(key)

        rates["put"] = total / timed(put_all)
        rates["get_into"] = total / timed(get_into_all)
        rates["get"] = total / timed(get_all)
        store.check_integrity()
    return {k: v / GB for k, v in rates.items()}


def run_dram(ctx: BenchContext) -> SuiteResult:
    result = SuiteResult("dram", command="")
    block_bytes = 32 * MiB
    n = max(1, ctx.config.nbytes // block_bytes)
    pool = payload_pool(block_bytes)
    dst = np.empty(n * block_bytes, dtype=np.uint8)
    dst[:] = 0  # fault the destination in: page faults are not memcpy
    memcpy = ThreadedMemcpy(copy_threads())
    rates: dict[str, list[float]] = {}
    try:
        _dram_pass(block_bytes, min(n, 8), pool, dst, memcpy)  # warm-up, not counted
        for rep in range(ctx.config.reps):
            ctx.log(f"dram rep {rep + 1}/{ctx.config.reps}")
            for k, v in _dram_pass(block_bytes, n, pool, dst, memcpy).items():
                rates.setdefault(k, []).append(v)
    finally:
        memcpy.close()
    result.figures += dram_figures(rates, n, block_bytes, memcpy.threads)
    result.notes.append(f"transparent huge pages here: {_thp('enabled')} for private memory "
                        f"(numpy asks for them on large arrays), {_thp('shmem_enabled')} for "
                        f"shared memory")
    return result


def dram_figures(rates: Mapping[str, Sequence[float]], n: int, block_bytes: int,
                 threads: int) -> list[Figure]:
    """The suite's figures from each pass's GB/s; the baseline memcpy ran on ``threads``."""
    size = f"{block_bytes // MiB} MiB blocks, {n * block_bytes / 2**30:g} GiB"
    base = (f"numpy memcpy into a faulted-in buffer, split over {threads} thread(s), as many as "
            f"the store copies with", tuple(rates["memcpy"]))
    return [
        Figure("dram", f"DramStore put, {size}", "GB/s", tuple(rates["put"]), *base, DRAM_GOAL),
        Figure("dram", f"DramStore get_into (caller's buffer), {size}", "GB/s",
               tuple(rates["get_into"]), *base, DRAM_GOAL),
        Figure("dram", f"DramStore get (new buffer each call), {size}", "GB/s",
               tuple(rates["get"]), *base,
               note="allocates a 32 MiB result per call; get_into avoids it"),
        Figure("dram", f"numpy memcpy on one thread, {size}", "GB/s", tuple(rates["memcpy1"]),
               *base, note="what splitting the copy over the cores gains"),
        Figure("dram", f"numpy memcpy into POSIX shared memory, {size}", "GB/s",
               tuple(rates["shm"]), *base,
               note="one thread, into the arena's kind of memory (a /dev/shm mapping) with no "
                    "store in the way: what the arena itself costs against private memory"),
        Figure("dram", f"copy_bytes into POSIX shared memory, {size}", "GB/s",
               tuple(rates["shm_split"]), *base,
               note=f"the stores' own copy with no store in the way: copies of "
                    f"{PARALLEL_MIN_BYTES // MiB} MiB or more are split over the "
                    f"{threads} cores this process may use, as torch's copy_ splits them"),
    ]


def _thp(name: str) -> str:
    """The mode in force of a transparent huge page setting: "[madvise] never" -> "madvise"."""
    try:
        text = Path(f"/sys/kernel/mm/transparent_hugepage/{name}").read_text()
    except OSError:
        return "unknown"
    start, end = text.find("["), text.find("]")
    return text[start + 1:end] if 0 <= start < end else text.strip()

