"""The machine's own limits, the baselines the suites measure beside their figures.

- fio: O_DIRECT bandwidth of one job on a file in the bench directory (the same filesystem as
  the stores), io_uring where the kernel allows it, libaio otherwise (``fio_bandwidth``).
- numpy memcpy of the same bytes into a buffer already faulted in (``memcpy_bandwidth``), and
  on as many threads as the stores copy with (``ThreadedMemcpy``, ``copy_threads``).

A suite calls them in its own repetitions, so that a store's figure and its baseline come from
the same minutes of the same run; suite "limits" (``cmx.bench.suites.limits``) reports them
alone.
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

from cmx.bench.harness.core import BenchContext, GiB, KiB, MiB
from cmx.errors import CmxError

__all__ = [
    "FioJob",
    "FioMissingError",
    "ThreadedMemcpy",
    "copy_threads",
    "fio_bandwidth",
    "fio_engine",
    "fio_file_bytes",
    "fio_path",
    "memcpy_bandwidth",
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


def fio_file_bytes(ctx: BenchContext) -> int:
    """Bytes of the laid-out file the time-based fio jobs run on."""
    # Big enough that a QD16 1 MiB read does not sit in one device cache line, small enough
    # to lay out in seconds.
    return min(ctx.config.nbytes, GiB)


def _run_fio(ctx: BenchContext, job: FioJob, engine: str, seconds: float) -> dict:
    path, size = _fio_file(ctx), fio_file_bytes(ctx)
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
    if path.exists() and path.stat().st_size >= fio_file_bytes(ctx):
        return
    cmd = [
        fio_path(), "--name=layout", f"--filename={path}", f"--size={fio_file_bytes(ctx)}",
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
