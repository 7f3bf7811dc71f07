"""The nvme suite's service-path pass reports GB/s, the unit of the fio baselines it is judged
against (a rate in bytes/s beside them once read as a baseline of ~0)."""

from __future__ import annotations

import uuid
from pathlib import Path

from cmx.bench.harness.core import BenchConfig, BenchContext, MiB
from cmx.bench.harness.payloads import block_keys, payload_pool
from cmx.bench.suites.stores.plane_io import plane_pass


def test_the_service_path_rates_are_in_gb_per_second(tmp_path: Path) -> None:
    ctx = BenchContext(BenchConfig(dir=tmp_path, reps=1, gib=0.01), tmp_path / "work")
    block = 2 * MiB
    rates = plane_pass(ctx, tmp_path / f"plane-{uuid.uuid4().hex[:8]}", block,
                       block_keys(8, b"plane-unit"), payload_pool(block, 4 * block))
    assert set(rates) == {"plane_write", "plane_read"}
    # A real disk moves well under 1,000 GB/s and well over 1 MB/s.
    assert all(0.001 < r < 1000 for r in rates.values()), rates
