"""A small calibration on an embedded two-node Ray cluster: 1 and 4 clients at once, two
blocks per load, this node's DRAM and the other node's. Whether the predictions fall within
25% on a shared two-core machine is the full calibration's question; this one checks that
each cell is judged by the medians of its raw samples and reports its pass or miss as they
say. It runs in a process of its own: the embedded cluster needs a process without Ray."""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

from cmx.simulate.calibrate.service import _prefixes

pytestmark = pytest.mark.multinode

REPS, BLOCKS, CLIENTS, SOURCES = 2, 2, (1, 4), ("dram", "dram@peer")
RUN = """
import sys
from pathlib import Path
from cmx.simulate.calibrate import run_calibration, write_calibration
result = run_calibration(log=lambda m: None, reps={reps}, blocks={blocks}, clients={clients},
                         sources={sources}, directory=Path(sys.argv[1]),
                         measure_bytes=32 << 20)
write_calibration(result, Path(sys.argv[1]) / "calibration.json", None)
"""


@pytest.mark.timeout(300)
def test_a_small_calibration_judges_each_cell_by_the_medians_of_its_loads(
    tmp_path: Path,
) -> None:
    code = RUN.format(reps=REPS, blocks=BLOCKS, clients=CLIENTS, sources=SOURCES)
    subprocess.run([sys.executable, "-c", code, str(tmp_path)], check=True, timeout=280)
    result = json.loads((tmp_path / "calibration.json").read_text())

    rows = result["rows"]
    assert [(r["source"], r["clients"]) for r in rows] == [
        (s, c) for s in SOURCES for c in CLIENTS]
    for r in rows:
        # Every load of every repetition, on both sides: one client loads several prefixes,
        # one after another, each predicted alike.
        assert len(r["measured_s"]) == REPS * _prefixes(r["clients"])
        assert len(r["predicted_s"]) == REPS * r["clients"]
        assert all(t > 0 for t in r["measured_s"] + r["predicted_s"])
        measured = statistics.median(r["measured_s"])
        predicted = statistics.median(r["predicted_s"])
        assert r["measured_median_s"] == measured and r["predicted_median_s"] == predicted
        assert abs(r["error"]) == pytest.approx(abs(predicted / measured - 1), rel=1e-12)
        assert r["ok"] == (abs(predicted / measured - 1) <= result["goal"])
    assert result["goal"] == 0.25
    assert result["ok"] == all(r["ok"] for r in rows)
    assert set(result["control"]) == set(SOURCES)
    assert {k: len(v) for k, v in result["raw"]["large_s"].items()} == {
        s: len(CLIENTS) for s in SOURCES}
    # The machine's CPU per load, per source and number of clients, every repetition.
    cpu = result["raw"]["cpu_per_load_s"]
    assert {s: sorted(int(c) for c in v) for s, v in cpu.items()} == {
        s: sorted(CLIENTS) for s in SOURCES}
    assert all(len(v) == REPS and min(v) > 0 for per in cpu.values() for v in per.values())
