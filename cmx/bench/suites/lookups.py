"""Suite "lookups": a 1,000-block lookup through ``NamespaceClient.lookup`` under concurrent
callers, of a prefix this node holds in DRAM, on a local Ray cluster.

- Ours: the lookup as a serving replica makes it: this node's tiers' books first (one round
  trip to DRAM and HBM at once), the directory only for what they lack (here: nothing).
- Baseline, in the same run: the same lookup asking the directory for every block (one
  batched call per shard), as lookups did before the node's memory answered them.
- The floor, in the same run: the same callers computing the prefix's block keys alone, which
  every lookup by tokens does first (one hash per block, in the caller's process).
- ``CALLERS`` threads of the driver look up at once, each ``PER_CALLER`` times per round;
  rounds rotate ours, the baseline and the floor (A B C A B C), ``3 x reps`` rounds in all, so
  that other work on the machine weighs on all alike. p50 and p99 are over every lookup of a
  mode.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import numpy as np

from cmx.bench.harness.cluster import SMALL, bench_cluster, store_prefix
from cmx.bench.harness.core import BenchContext, Figure, Goal, MiB, SuiteResult, Table
from cmx.config import ServiceConfig

__all__ = ["CALLERS", "P99_BUDGET_MS", "run_lookups"]

BLOCKS = 1000
CALLERS = 16
PER_CALLER = 10
P99_BUDGET_MS = 5.0


def _round(ns: Any, toks: np.ndarray, here_first: bool | None) -> list[float]:
    """Seconds of each lookup of ``CALLERS`` threads looking up ``toks`` at once; with
    ``here_first`` None, each computes the prefix's block keys alone (what every lookup by
    tokens pays first)."""
    out: list[float] = []
    lock = threading.Lock()
    start = threading.Barrier(CALLERS)
    failed: list[str] = []

    def caller() -> None:
        mine = []
        start.wait()
        for _ in range(PER_CALLER):
            t0 = time.perf_counter()
            if here_first is None:
                ns.keys(toks)
                mine.append(time.perf_counter() - t0)
                continue
            match = ns.lookup(toks, here_first)
            mine.append(time.perf_counter() - t0)
            if match.num_blocks != BLOCKS:
                failed.append(f"a lookup found {match.num_blocks} of {BLOCKS} blocks")
        with lock:
            out.extend(mine)

    threads = [threading.Thread(target=caller) for _ in range(CALLERS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if failed:
        raise AssertionError(failed[0])
    return out


def _ms(samples: list[float], q: float) -> float:
    return float(np.percentile(samples, q)) * 1e3


def run_lookups(ctx: BenchContext) -> SuiteResult:
    result = SuiteResult("lookups", command="")
    config = ServiceConfig(block_bytes=SMALL.block_bytes, hbm_bytes=64 * MiB,
                           dram_bytes=256 * MiB, nvme_bytes=512 * MiB,
                           nvme_dir=str(ctx.scratch("lookups")))
    ours: list[float] = []
    directory: list[float] = []
    keys: list[float] = []
    per_round: list[tuple[str, ...]] = []
    with bench_cluster(config) as bc:
        ctx.log(f"lookups: storing a {BLOCKS:,}-block prefix in node a's DRAM")
        ns, toks = store_prefix(bc.cm, SMALL, BLOCKS, seed=7)
        baseline = bc.cm.namespace("bench", SMALL, "s7")
        # The same namespace both ways; the baseline asks the directory for every block.
        _round(ns, toks, True)  # untimed: Ray's handles and the first calls of each actor
        _round(baseline, toks, False)
        modes: list[tuple[str, Any, bool | None, list[float]]] = [
            ("node plane", ns, True, ours), ("directory only", baseline, False, directory),
            ("block keys alone", ns, None, keys)]
        for rnd in range(3 * ctx.config.reps):
            mode, client, here_first, into = modes[rnd % 3]
            ctx.log(f"lookups round {rnd + 1}/{3 * ctx.config.reps}: {mode}")
            lat = _round(client, toks, here_first)
            into.extend(lat)
            per_round.append((str(rnd + 1), mode, f"{_ms(lat, 50):.2f}", f"{_ms(lat, 99):.2f}"))
    p99, base99 = _ms(ours, 99), _ms(directory, 99)
    result.figures.append(Figure(
        "lookups", f"p99 of a {BLOCKS:,}-block lookup held in DRAM here, {CALLERS} callers",
        "ms", (p99,), "budget", (P99_BUDGET_MS,), Goal("<=", 1.0),
        note=f"p50 {_ms(ours, 50):.2f} ms over {len(ours)} lookups"))
    result.figures.append(Figure(
        "lookups", f"p99 of that lookup against the directory alone, {CALLERS} callers", "ms",
        (p99,), "directory-only lookup, rounds alternated", (base99,), None,
        note=f"directory only: p50 {_ms(directory, 50):.2f} ms, p99 {base99:.2f} ms"))
    result.figures.append(Figure(
        "lookups", f"p99 of that lookup against computing its block keys alone, {CALLERS} "
        "callers", "ms", (p99,), "block keys alone (the floor), rounds rotated",
        (_ms(keys, 99),), None,
        note=f"keys alone: p50 {_ms(keys, 50):.2f} ms, p99 {_ms(keys, 99):.2f} ms"))
    result.tables.append(Table(
        f"{BLOCKS:,}-block lookups, {CALLERS} callers x {PER_CALLER}, rounds alternated",
        ("round", "path", "p50 ms", "p99 ms"), tuple(per_round)))
    return result
