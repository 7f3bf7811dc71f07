"""The "dram" suite's baseline copies on as many threads as the store does: a store that splits
its copies over the cores, judged against one thread's memcpy, would pass on the split alone."""

from __future__ import annotations

import os
import threading
import uuid
from pathlib import Path

import numpy as np
import pytest

from cmx.bench.harness.baselines import ThreadedMemcpy, copy_threads
from cmx.bench.harness.core import BenchConfig, BenchContext, Verdict
from cmx.bench.suites.stores import storage
from cmx.bench.suites.stores.storage import dram_figures, run_dram


def test_the_baseline_uses_the_stores_thread_count() -> None:
    assert copy_threads() == len(os.sched_getaffinity(0))


@pytest.mark.parametrize("threads,n,block", [(1, 3, 4096), (3, 5, 4096 + 7), (4, 1, 10)])
def test_threaded_memcpy_copies_every_block_in_one_share_per_thread(
        threads: int, n: int, block: int, monkeypatch: pytest.MonkeyPatch) -> None:
    rng = np.random.default_rng(threads)
    pool = [rng.integers(0, 256, block, dtype=np.uint8) for _ in range(2)]
    dst = np.zeros(n * block, dtype=np.uint8)
    shares: dict[int, int] = {}  # share -> the thread that copied it
    share = ThreadedMemcpy._share

    def recording(self: ThreadedMemcpy, j: int, *args: object) -> None:
        shares[j] = threading.get_ident()
        share(self, j, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(ThreadedMemcpy, "_share", recording)
    memcpy = ThreadedMemcpy(threads)
    try:
        memcpy.copy(dst, pool, n, block)
    finally:
        memcpy.close()
    assert np.array_equal(dst, np.concatenate([pool[i % 2] for i in range(n)]))
    assert sorted(shares) == list(range(threads))
    here = threading.get_ident()
    assert shares[0] == here and all(shares[j] != here for j in range(1, threads))


def test_dram_figures_name_the_threads_and_are_judged_against_them() -> None:
    rates = {k: [v] * 3 for k, v in (("memcpy", 20.0), ("memcpy1", 11.0), ("put", 18.0),
                                      ("get_into", 15.0), ("get", 8.0), ("shm", 10.0),
                                      ("shm_split", 19.0))}
    figs = dram_figures(rates, 4, 32 << 20, threads=2)
    put = next(f for f in figs if f.name.startswith("DramStore put"))
    assert "split over 2 thread(s), as many as the store copies with" in put.baseline_name
    assert put.baseline == 20.0 and put.verdict is Verdict.PASS  # 0.9
    get_into = next(f for f in figs if f.name.startswith("DramStore get_into"))
    assert get_into.verdict is Verdict.MISS  # 0.75: against one thread's 11 it would pass
    one = next(f for f in figs if "one thread" in f.name)
    assert one.ratio == pytest.approx(0.55) and one.goal is None


def test_run_dram_times_its_baseline_on_copy_threads(tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    used: list[int] = []

    def fake_pass(block_bytes: int, n: int, pool: list[np.ndarray], dst: np.ndarray,
                  memcpy: ThreadedMemcpy) -> dict[str, float]:
        used.append(memcpy.threads)
        return {k: 1.0 for k in ("memcpy", "memcpy1", "put", "get_into", "get", "shm",
                                 "shm_split")}

    monkeypatch.setattr(storage, "_dram_pass", fake_pass)
    monkeypatch.setattr(storage, "payload_pool", lambda block: [np.zeros(8, np.uint8)])
    monkeypatch.setattr(storage, "copy_threads", lambda: 3)
    work = tmp_path / f"work-{uuid.uuid4().hex[:8]}"
    result = run_dram(BenchContext(BenchConfig(dir=tmp_path, reps=2, gib=0.03), work))
    assert used == [3, 3, 3]  # the warm-up, then each repetition
    assert all("3 thread(s)" in f.baseline_name for f in result.figures)
