"""HBM <-> pinned DRAM on a stream of its own, against cudaMemcpy of the same bytes.

What this GPU gives a copy between pinned host memory and HBM on a non-default CUDA stream,
off the engine's compute stream. The service does not make such copies yet: its HBM tier is
emulated on host memory (docs/GPU.md). For every block size from 2 MiB to 256 MiB this
measures:

- host -> device and device -> host, ``copy_`` with ``non_blocking`` on a side stream, timed
  by events on that stream: the stream copy;
- ``cudaMemcpy`` (CuPy's runtime binding; synchronous, legacy default stream) of the same
  bytes between the same buffers: the copy ceiling;
- a device -> device copy of the same bytes: HBM's own speed, for scale.

Goal: the stream copy reaches at least 0.8 of cudaMemcpy in both directions at every size.
The table is written to ``$CMX_GPU_OUT/gpu_bandwidth.md`` (and .json) before anything is
asserted, so a miss still returns its numbers.
"""

from __future__ import annotations

import time
from typing import Any

from common import GB, MiB, time_on_stream, write_table

SIZES = (2 * MiB, 8 * MiB, 32 * MiB, 128 * MiB, 256 * MiB)
GOAL = 0.8


def _reps(nbytes: int) -> int:
    return max(5, min(200, (2 << 30) // nbytes))  # about 2 GiB moved per figure


def _cuda_memcpy_s(dst: Any, src: Any, nbytes: int, kind: str, reps: int) -> tuple[float, str]:
    """Seconds per synchronous cudaMemcpy of ``nbytes``; CuPy's binding where present."""
    import torch

    try:
        import cupy

        rt = cupy.cuda.runtime
        code = {"h2d": rt.memcpyHostToDevice, "d2h": rt.memcpyDeviceToHost,
                "d2d": rt.memcpyDeviceToDevice}[kind]

        def run() -> None:
            rt.memcpy(dst.data_ptr(), src.data_ptr(), nbytes, code)

        how = "cudaMemcpy (CuPy runtime)"
    except ImportError:
        def run() -> None:
            dst.copy_(src)  # default stream, blocking: what cudaMemcpy does
            torch.cuda.synchronize()

        how = "torch copy_ on the default stream, synchronized (CuPy absent)"
    run()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        run()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / reps, how


def _measure(nbytes: int, stream: Any) -> dict[str, Any]:
    import torch

    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    host.copy_(torch.randint(0, 256, (nbytes,), dtype=torch.uint8))
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dev2 = torch.empty_like(dev)
    back = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    reps = _reps(nbytes)
    h2d = time_on_stream(lambda: dev.copy_(host, non_blocking=True), stream, reps)
    d2h = time_on_stream(lambda: back.copy_(dev, non_blocking=True), stream, reps)
    d2d = time_on_stream(lambda: dev2.copy_(dev, non_blocking=True), stream, reps)
    stream.synchronize()
    same = bool(torch.equal(back, host))
    m_h2d, how = _cuda_memcpy_s(dev, host, nbytes, "h2d", reps)
    m_d2h, _ = _cuda_memcpy_s(back, dev, nbytes, "d2h", reps)
    return {"bytes": nbytes, "h2d": nbytes / h2d, "d2h": nbytes / d2h, "d2d": nbytes / d2d,
            "memcpy_h2d": nbytes / m_h2d, "memcpy_d2h": nbytes / m_d2h, "how": how,
            "identical": same}


def test_stream_copies_reach_the_memcpy_ceiling_from_2_mib_up() -> None:
    import torch

    stream = torch.cuda.Stream()
    assert stream != torch.cuda.default_stream()
    results = [_measure(n, stream) for n in SIZES]
    rows = []
    for r in results:
        rows.append([f"{r['bytes'] // MiB} MiB",
                     f"{r['h2d'] / GB:.1f}", f"{r['memcpy_h2d'] / GB:.1f}",
                     f"{r['h2d'] / r['memcpy_h2d']:.2f}",
                     f"{r['d2h'] / GB:.1f}", f"{r['memcpy_d2h'] / GB:.1f}",
                     f"{r['d2h'] / r['memcpy_d2h']:.2f}", f"{r['d2d'] / GB:.0f}"])
    write_table("gpu_bandwidth",
                ["block", "H2D stream GB/s", "H2D cudaMemcpy GB/s", "ratio",
                 "D2H stream GB/s", "D2H cudaMemcpy GB/s", "ratio", "D2D GB/s"], rows,
                {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                 "cuda": torch.version.cuda, "baseline": results[0]["how"],
                 "host memory": "pinned (torch pin_memory)", "goal": f"ratio >= {GOAL}"})
    assert all(r["identical"] for r in results), "a round trip changed bytes"
    misses = [(r["bytes"] // MiB, kind, round(r[kind] / r[f"memcpy_{kind}"], 2))
              for r in results for kind in ("h2d", "d2h")
              if r[kind] < GOAL * r[f"memcpy_{kind}"]]
    assert not misses, f"below {GOAL} of cudaMemcpy (MiB, direction, ratio): {misses}"


def test_a_copy_on_its_own_stream_overlaps_compute_on_the_default_stream() -> None:
    import torch

    n = 256 * MiB
    host = torch.empty(n, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(n, dtype=torch.uint8, device="cuda")
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    side = torch.cuda.Stream()
    compute = torch.cuda.default_stream()

    def matmuls() -> None:
        for _ in range(20):
            a @ a

    t_compute = time_on_stream(matmuls, compute, 1)
    t_copy = time_on_stream(lambda: dev.copy_(host, non_blocking=True), side, 1)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    done = torch.cuda.Event()
    with torch.cuda.stream(side):
        dev.copy_(host, non_blocking=True)
        done.record(side)
    matmuls()
    compute.wait_event(done)  # the engine waits on the copy by an event, not a sync
    torch.cuda.synchronize()
    both = time.perf_counter() - t0
    write_table("gpu_overlap", ["compute s", "copy s", "both s", "sum s"],
                [[f"{t_compute:.4f}", f"{t_copy:.4f}", f"{both:.4f}",
                  f"{t_compute + t_copy:.4f}"]],
                {"copy": "256 MiB pinned -> HBM on a side stream",
                 "compute": "20 bf16 8192^2 matmuls on the default stream"})
    assert both < 0.9 * (t_compute + t_copy), "the copy serialized with the compute"
