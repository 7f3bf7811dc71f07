"""Suite "limits": what the machine can do with no store in the way.

- The disk's raw O_DIRECT bandwidth, measured with fio on a file in the bench directory (the
  same filesystem as the stores): sequential write and read, 4 KiB / 128 KiB / 1 MiB I/Os, at
  queue depth 1 and 16, io_uring where the kernel allows it, libaio otherwise.
- numpy memcpy of the same bytes, in 32 MiB pieces into a buffer already faulted in.

The measurements are the harness's baselines (``cmx.bench.harness.baselines``), the ones other
suites take beside their own figures; this suite reports them alone.
"""

from __future__ import annotations

import numpy as np

from cmx.bench.harness.baselines import (
    FioJob,
    fio_bandwidth,
    fio_engine,
    fio_file_bytes,
    memcpy_bandwidth,
)
from cmx.bench.harness.core import GB, BenchContext, Figure, GiB, KiB, MiB, SuiteResult, Table

__all__ = ["run_limits"]

MATRIX = tuple(
    FioJob(rw, bs, qd)
    for rw in ("write", "read")
    for bs in (4 * KiB, 128 * KiB, MiB)
    for qd in (1, 16)
)


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
        f"{fio_file_bytes(ctx) / GiB:g} GiB file laid out in {ctx.config.dir}; reads: "
        f"{ctx.cold_read_method}",
        "each fio figure's ratio is to 1 MiB at QD16 of the same direction: the small-I/O "
        "cliff a store pays for smaller or fewer I/Os; memcpy's ratio is how much faster host "
        "memory is than the disk",
    ]
    return result


def _size(n: int) -> str:
    return f"{n // MiB} MiB" if n >= MiB else f"{n // KiB} KiB"
