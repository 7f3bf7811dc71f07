"""Step 1 of the calibration: this machine's tier speeds, measured without the service.

The client's checked copy of blocks into a new tensor (``cmx.client.copy_out.copy_payloads``,
on a thread; and each thread's speed with a thread on every core), O_DIRECT reads of a file in
the NVMe directory (4 MiB, 8 in flight; and 4 KiB reads one at a time, for the latency of
one), XXH3 checksums, the agent's copy between arenas
(``cmx.buffers.copy_bytes``, NIXL's stand-in), and NIXL (UCX) between two processes
(``nixl``). Each is the median of a few runs; the machine is shared and its speeds drift, so
the calibration measures them again at the start of each repetition.
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from cmx.simulate.calibrate.nixl import nixl_read_rate
from cmx.simulate.calibrate.result import GB, MachineSpeeds, MiB
from cmx.simulate.hardware import LLAMA3_8B

__all__ = ["describe", "measure_machine"]


def _median_rate(nbytes: int, fn: Callable[[], object], reps: int = 3) -> float:
    fn()  # warm: page faults, thread pools, caches of code
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return nbytes / statistics.median(times)


def _copy_out_rate(block_bytes: int, blocks: int, threads: int = 1) -> float:
    """The client's copy out (``cmx.client.copy_out.copy_payloads``: each block copied into
    its place in a new tensor, checked as it is copied), on a thread of its own, as every
    load of the calibration runs. The tensor is new each time, as a load makes it: its pages
    fault in as the blocks land, and that is part of the cost (a thread's large allocation
    gets fresh pages; the calling thread's can reuse the heap's, and then runs at several
    times the speed: a load's speed that depends on what ran before it in the process).
    With ``threads`` > 1, that many copy at once, each its own tensor: each one's speed."""
    from cmx.checksum import checksum
    from cmx.client.copy_out import copy_payloads, empty_kv
    from cmx.keys import BlockHash

    layout = LLAMA3_8B.layout(block_bytes // LLAMA3_8B.kv_bytes_per_token)
    payload = np.random.default_rng(0).integers(0, 256, layout.block_bytes, dtype=np.uint8)
    payloads = [(BlockHash(b"calibration"), payload, int(checksum(payload)))] * blocks

    def copy_out() -> None:
        out = empty_kv(layout, blocks * layout.block_tokens)
        if copy_payloads(layout, payloads, out, 0) != blocks:
            raise AssertionError("a block failed its checksum in the copy-out measurement")

    def together() -> None:
        for done in [pool.submit(copy_out) for _ in range(threads)]:
            done.result()

    with ThreadPoolExecutor(threads) as pool:  # threads reused: as a load's client threads
        return _median_rate(blocks * layout.block_bytes, together)


def _odirect_rates(directory: Path, nbytes: int, io: int = 4 * MiB,
                   depth: int = 8) -> tuple[float, float]:
    """(bytes/s, seconds an I/O) of O_DIRECT reads of a new file of ``nbytes`` in
    ``directory``: ``io`` bytes each, ``depth`` in flight; then single 4 KiB reads."""
    from cmx.buffers import aligned_empty

    path = Path(tempfile.mkdtemp(prefix="cmx-calibrate-", dir=directory)) / "data"
    buf = aligned_empty(nbytes)
    buf[:] = 7
    fd = os.open(path, os.O_CREAT | os.O_RDWR | os.O_DIRECT, 0o600)
    try:
        for off in range(0, nbytes, io):
            os.pwritev(fd, [buf[off:off + io].data], off)
        os.fsync(fd)
        with ThreadPoolExecutor(depth) as pool:
            def run() -> None:
                list(pool.map(lambda off: os.preadv(fd, [buf[off:off + io].data], off),
                              range(0, nbytes, io)))
            rate = _median_rate(nbytes, run)
        return rate, _odirect_latency(fd, nbytes)
    finally:
        os.close(fd)
        path.unlink()
        path.parent.rmdir()


def _odirect_latency(fd: int, nbytes: int, probes: int = 64, size: int = 4096) -> float:
    """Median seconds of one ``size``-byte O_DIRECT read at a time, at random offsets of the
    first ``nbytes`` of ``fd``: the time to a read's first byte, its bytes being few."""
    from cmx.buffers import aligned_empty

    buf = aligned_empty(size)
    offsets = np.random.default_rng(0).integers(0, nbytes // size, probes) * size
    times = []
    for off in offsets:
        t0 = time.perf_counter()
        os.preadv(fd, [buf.data], int(off))
        times.append(time.perf_counter() - t0)
    return float(statistics.median(times))


def _memory_rates(nbytes: int) -> tuple[float, float]:
    """(copy_bytes, XXH3) bytes/s over ``nbytes`` of faulted-in memory."""
    import xxhash

    from cmx.buffers import aligned_empty, copy_bytes

    src, dst = aligned_empty(nbytes), aligned_empty(nbytes)
    src[:] = 1
    dst[:] = 0
    copy = _median_rate(nbytes, lambda: copy_bytes(dst, src))
    checksum = _median_rate(nbytes, lambda: xxhash.xxh3_64_intdigest(src.data))
    return copy, checksum


def measure_machine(directory: Path, nbytes: int = 256 * MiB, block_bytes: int = 16 * MiB,
                    nixl: tuple[float | None, str] | None = None) -> MachineSpeeds:
    """This machine's speeds now; ``nixl`` as measured before (it takes a process)."""
    copy, checksum = _memory_rates(nbytes)
    copy_out = _copy_out_rate(block_bytes, nbytes // block_bytes)
    cores = os.cpu_count() or 1
    threads = min(cores, 16)  # bounded memory: each thread its own tensor
    shared = _copy_out_rate(block_bytes, max(2, nbytes // block_bytes // threads),
                            threads) if cores > 1 else None
    odirect, latency = _odirect_rates(directory, nbytes)
    rate, note = nixl or nixl_read_rate(nbytes)
    return MachineSpeeds(copy, copy_out, odirect, checksum, copy if rate is None else rate,
                         note, shared, odirect_latency_s=latency, nixl_measured=rate is not None)


def describe(s: MachineSpeeds) -> str:
    """The speeds in GB/s, for the log."""
    latency = ("" if s.odirect_latency_s is None
               else f" ({s.odirect_latency_s * 1e6:.0f} µs a 4 KiB read)")
    return (f"copy {s.copy / GB:.2f}, copy-out {s.copy_out / GB:.2f} "
            f"({s.copy_out_at(2) / GB:.2f} a thread on every core), O_DIRECT read "
            f"{s.odirect_read / GB:.2f}{latency}, XXH3 {s.checksum / GB:.2f}, "
            f"NIXL {s.nixl / GB:.2f} GB/s")
