"""Suite "limits": what the machine can do with no store in the way.

- The disk's raw O_DIRECT bandwidth, measured with fio on a file in the bench directory (the
  same filesystem as the stores): sequential write and read, 4 KiB / 128 KiB / 1 MiB I/Os, at
  queue depth 1 and 16, io_uring where the kernel allows it, libaio otherwise.
- numpy memcpy of the same bytes, in 32 MiB pieces into a buffer already faulted in.

Other suites call ``fio_bandwidth``, ``memcpy_bandwidth`` and ``ThreadedMemcpy`` (memcpy on as
many threads as the stores copy with, ``copy_threads``) for their own baselines, so that a
store's figure and its baseline come from the same minutes of the same run.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from cmx.bench.core import GB, BenchContext, Figure, GiB, KiB, MiB, SuiteResult, Table
from cmx.errors import CmxError

__all__ = [
    "FioJob",
    "FioMissingError",
    "ThreadedMemcpy",
    "copy_threads",
    "fio_bandwidth",
    "fio_engine",
    "fio_path",
    "memcpy_bandwidth",
    "run_limits",
]

FIO_INSTALL_HINT = "fio is not installed: `apt-get install -y fio` (or `make bench`) installs it"
_FIO_FILE = "fio-raw.dat"


class FioMissingError(CmxError):
    """fio is needed for the raw disk baseline and is not on PATH."""


@dataclass(frozen=True)
class FioJob:
    """One fio job. By default time-based over a laid-out file; ``fresh`` writes the run's
    ``--gib`` once into a new file and fsyncs it, as a store's put_many+flush does."""

    rw: str  # "write" or "read" (sequential)
    bs: int  # bytes per I/O
    iodepth: int  # I/Os in flight
    fresh: bool = False  # new file, size-based, fsync at the end (durable, like a store flush)

    @property
    def label(self) -> str:
        size = f"{self.bs // MiB} MiB" if self.bs >= MiB else f"{self.bs // KiB} KiB"
        tail = " into a new file, then fsync" if self.fresh else ""
        return f"fio {self.rw} {size} QD{self.iodepth}{tail}"


def fio_path() -> str:
    path = shutil.which("fio")
    if path is None:
        raise FioMissingError(FIO_INSTALL_HINT)
    return path


def _fio_file(ctx: BenchContext) -> Path:
    return ctx.scratch("raw") / _FIO_FILE


def _file_bytes(ctx: BenchContext) -> int:
    # Big enough that a QD16 1 MiB read does not sit in one device cache line, small enough
    # to lay out in seconds.
    return min(ctx.config.nbytes, GiB)


def _run_fio(ctx: BenchContext, job: FioJob, engine: str, seconds: float) -> dict:
    path, size = _fio_file(ctx), _file_bytes(ctx)
    if job.fresh:
        path, size = path.with_name(path.name + ".new"), ctx.config.nbytes
        path.unlink(missing_ok=True)
    cmd = [
        fio_path(), "--name=raw", f"--filename={path}", f"--size={size}",
        "--direct=1", f"--ioengine={engine}", f"--rw={job.rw}", f"--bs={job.bs}",
        f"--iodepth={job.iodepth}", "--output-format=json", "--numjobs=1", "--group_reporting",
    ]
    if job.fresh:
        cmd.append("--end_fsync=1")  # its bandwidth then counts the flush, as a store's does
    else:
        cmd += ["--time_based", f"--runtime={max(1, round(seconds * 1000))}ms"]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if job.fresh:
        path.unlink(missing_ok=True)
    if proc.returncode != 0:
        why = proc.stderr.strip() or proc.stdout[-500:]
        raise CmxError(f"fio failed ({proc.returncode}): {why}")
    # fio may print warnings before the JSON document.
    return json.loads(proc.stdout[proc.stdout.index("{"):])


def fio_engine(ctx: BenchContext) -> str:
    """io_uring if a small O_DIRECT job runs with it here, else libaio (memoized per run)."""
    if "fio_engine" not in ctx.memo:
        _prepare_file(ctx)
        engine = "libaio"
        try:
            _run_fio(ctx, FioJob("read", 4 * KiB, 1), "io_uring", 0.2)
            engine = "io_uring"
        except CmxError:
            ctx.log("fio: io_uring unavailable here, using libaio")
        ctx.memo["fio_engine"] = engine
    return str(ctx.memo["fio_engine"])


def _prepare_file(ctx: BenchContext) -> None:
    """Lay the fio file out once, with real writes, so reads hit allocated extents."""
    path = _fio_file(ctx)
    if path.exists() and path.stat().st_size >= _file_bytes(ctx):
        return
    cmd = [
        fio_path(), "--name=layout", f"--filename={path}", f"--size={_file_bytes(ctx)}",
        "--direct=1", "--rw=write", "--bs=1M", "--iodepth=1", "--output-format=json",
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise CmxError(f"fio could not lay out {path}: {proc.stderr.strip()}")


def fio_bandwidth(ctx: BenchContext, job: FioJob) -> float:
    """Bytes/s of one fio job (O_DIRECT, time-based) on the bench directory's filesystem."""
    engine = fio_engine(ctx)
    if job.rw == "read":
        ctx.drop_cache()
    result = _run_fio(ctx, job, engine, ctx.config.fio_seconds)
    return float(result["jobs"][0][job.rw]["bw_bytes"])


def memcpy_bandwidth(nbytes: int, piece: int = 32 * MiB) -> float:
    """Bytes/s of numpy copying ``nbytes`` in ``piece``-sized copies into a faulted-in buffer."""
    import time

    src = np.random.default_rng(0).integers(0, 256, size=piece, dtype=np.uint8)
    dst = np.empty_like(src)
    np.copyto(dst, src)  # fault both in: page faults are not memcpy
    n = max(1, nbytes // piece)
    t0 = time.perf_counter()
    for _ in range(n):
        np.copyto(dst, src)
    return n * piece / (time.perf_counter() - t0)


MATRIX = tuple(
    FioJob(rw, bs, qd)
    for rw in ("write", "read")
    for bs in (4 * KiB, 128 * KiB, MiB)
    for qd in (1, 16)
)


def copy_threads() -> int:
    """Threads a store's large copy runs on: ``copy_bytes`` splits it over every core this
    process may use, the caller's thread included."""
    return len(os.sched_getaffinity(0))


class ThreadedMemcpy:
    """numpy memcpy of blocks into consecutive slots of one destination on ``threads`` threads:
    each block cut into ``threads`` pieces, piece ``j`` of every block copied by thread ``j``
    (the caller's thread is thread 0), so each thread copies its share in one go."""

    def __init__(self, threads: int) -> None:
        if threads < 1:
            raise ValueError(f"threads must be >= 1, got {threads}")
        self.threads = threads
        self._pool = ThreadPoolExecutor(threads - 1, "cmx-bench-memcpy") if threads > 1 else None

    def _share(self, j: int, dst: np.ndarray, blocks: Sequence[np.ndarray],
               block_bytes: int) -> None:
        piece = -(-block_bytes // self.threads)
        lo, hi = j * piece, min(block_bytes, (j + 1) * piece)
        for i, src in enumerate(blocks):
            base = i * block_bytes
            np.copyto(dst[base + lo:base + hi], src[lo:hi])

    def copy(self, dst: np.ndarray, pool: Sequence[np.ndarray], n: int,
             block_bytes: int) -> None:
        """``dst[i * block_bytes:][:block_bytes] = pool[i % len(pool)]`` for ``i < n``."""
        blocks = [pool[i % len(pool)] for i in range(n)]
        futures = [self._pool.submit(self._share, j, dst, blocks, block_bytes)
                   for j in range(1, self.threads)] if self._pool else []
        self._share(0, dst, blocks, block_bytes)
        for future in futures:
            future.result()

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown()


def run_limits(ctx: BenchContext) -> SuiteResult:
    """fio's O_DIRECT matrix and memcpy, each job's figure a ratio to 1 MiB QD16 of its kind."""
    result = SuiteResult("limits", command="")
    samples: dict[FioJob, list[float]] = {job: [] for job in MATRIX}
    memcpy: list[float] = []
    for rep in range(ctx.config.reps):
        for job in MATRIX:
            ctx.log(f"limits rep {rep + 1}/{ctx.config.reps}: {job.label}")
            samples[job].append(fio_bandwidth(ctx, job) / GB)
        memcpy.append(memcpy_bandwidth(ctx.config.nbytes) / GB)
    engine = fio_engine(ctx)
    for job in MATRIX:
        ref = FioJob(job.rw, MiB, 16)
        if job != ref:
            result.figures.append(Figure("limits", job.label, "GB/s", tuple(samples[job]),
                                         ref.label, tuple(samples[ref])))
    read_ref = FioJob("read", MiB, 16)
    result.figures.append(Figure(
        "limits", "numpy memcpy, 32 MiB pieces", "GB/s", tuple(memcpy),
        read_ref.label, tuple(samples[read_ref]),
    ))
    rows = tuple(
        (job.rw, _size(job.bs), str(job.iodepth), f"{np.median(samples[job]):.3f}",
         " / ".join(f"{s:.3f}" for s in samples[job]))
        for job in MATRIX
    )
    result.tables.append(Table(
        f"Raw O_DIRECT bandwidth (fio, {engine}, sequential, {ctx.config.fio_seconds:g} s per job)",
        ("rw", "I/O size", "QD", "GB/s (median)", "samples"), rows,
    ))
    result.notes += [
        f"fio jobs: --direct=1 --ioengine={engine}, sequential, time-based, on a "
        f"{_file_bytes(ctx) / GiB:g} GiB file laid out in {ctx.config.dir}; reads: "
        f"{ctx.cold_read_method}",
        "each fio figure's ratio is to 1 MiB at QD16 of the same direction: the small-I/O "
        "cliff a store pays for smaller or fewer I/Os; memcpy's ratio is how much faster host "
        "memory is than the disk",
    ]
    return result


def _size(n: int) -> str:
    return f"{n // MiB} MiB" if n >= MiB else f"{n // KiB} KiB"
