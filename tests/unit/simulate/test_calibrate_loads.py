"""How the calibration times the service's loads, with a stand-in namespace (the loads
themselves need a cluster; ``tests/integration/test_calibrate_small.py`` runs them)."""

from __future__ import annotations

import os
import threading
import time
from typing import Any

import pytest

from cmx.simulate.calibrate.service import TINY, _block_sum, _prefixes, _timed_loads


class _Namespace:
    """Loads a fixed tensor, recording the thread and the interval of each load."""

    layout = TINY

    def __init__(self, seen: list[tuple[int, float, float]]) -> None:
        self.kv = TINY.random_kv(2 * TINY.block_tokens, seed=1)
        self.seen = seen

    def load(self, tokens: Any) -> Any:
        start = time.monotonic()
        time.sleep(0.02)
        self.seen.append((threading.get_ident(), start, time.monotonic()))
        return self.kv


def _loads(count: int, seen: list[tuple[int, float, float]]) -> list[Any]:
    T = TINY.block_tokens
    out = []
    for _ in range(count):
        ns = _Namespace(seen)
        out.append((ns, None, (_block_sum(ns.kv[:, :, :, :T]), _block_sum(ns.kv[:, :, :, -T:]))))
    return out


def test_every_load_runs_on_a_thread_other_than_the_callers() -> None:
    # The calling thread's new tensors can reuse its heap's pages; a load there would copy
    # several times faster than on the client threads of the other cells.
    for count, together in ((1, True), (3, False)):
        seen: list[tuple[int, float, float]] = []
        times, busy = _timed_loads(_loads(count, seen), 2, together)
        assert len(times) == count
        assert threading.get_ident() not in {thread for thread, _, _ in seen}


def test_one_client_loads_one_after_another_and_clients_at_once() -> None:
    seen: list[tuple[int, float, float]] = []
    _timed_loads(_loads(3, seen), 2, together=False)
    spans = sorted((start, end) for _, start, end in seen)
    assert all(end <= nxt for (_, end), (nxt, _) in zip(spans, spans[1:]))
    seen.clear()
    _timed_loads(_loads(3, seen), 2, together=True)
    assert len({thread for thread, _, _ in seen}) == 3


def test_the_arenas_hold_the_widest_cell() -> None:
    from cmx.simulate.calibrate.service import TINY_LOADS, TINY_SIZES, _cells, _most

    assert _prefixes(1) >= 3 and _prefixes(4) == 4 and _prefixes(16) == 16
    for blocks, clients in ((6, (1, 4, 16)), (2, (1, 4)), (1, (1,))):
        cells = _cells(blocks, clients)
        widest = max(n * (_prefixes(c) if n == blocks else TINY_LOADS) for _, n, c in cells)
        assert _most(blocks, clients) >= widest
        assert [n for _, n, _ in cells[:len(TINY_SIZES)]] == list(TINY_SIZES)


def test_a_loads_own_cpu_is_the_machines_less_what_it_keeps_busy_idle() -> None:
    from cmx.simulate.calibrate.service import ServiceLoads

    loads = ServiceLoads()
    loads.idle["dram"] = [0.5, 0.0]
    loads.add_large("dram", 1, [0.1, 0.1, 0.1], busy_s=0.3)  # 0.1 CPU-s a load, 0.05 idle
    loads.add_large("dram", 1, [0.2, 0.2, 0.2], busy_s=0.3)  # nothing kept busy idle
    loads.add_large("dram", 4, [0.3] * 4, busy_s=1.0)
    assert loads.load_cpu_alone("dram", 0) == pytest.approx(0.1 - 0.5 * 0.1)
    assert loads.load_cpu_alone("dram", 1) == pytest.approx(0.1)
    assert loads.load_cpu_alone("dram", 2) is None  # no such repetition
    assert loads.load_cpu_alone("nvme", 0) is None
    loads.idle["dram"][0] = 5.0  # never below nothing
    assert loads.load_cpu_alone("dram", 0) == 0.0


def _fake_run(monkeypatch: Any, cpu_alone_s: float) -> Any:
    """A calibration of DRAM loads by 1 and 4 clients whose measurements are given: one
    load alone takes ``cpu_alone_s`` of the machine's CPU."""
    import cmx.simulate.calibrate.run as run
    from cmx.simulate.calibrate.result import MachineSpeeds
    from cmx.simulate.calibrate.service import ServiceLoads

    speeds = MachineSpeeds(copy=4e9, copy_out=2e9, odirect_read=1e9, checksum=8e9, nixl=3e9,
                           nixl_note="test", odirect_latency_s=2e-4)

    def fake(*args: Any, **kwargs: Any) -> ServiceLoads:
        loads = ServiceLoads()
        loads.tiny["dram"] = {1: [0.002], 8: [0.003]}
        loads.baselines["dram"] = [speeds]
        loads.idle["dram"] = [0.0]
        loads.add_large("dram", 1, [0.1, 0.1, 0.1], busy_s=3 * cpu_alone_s)
        loads.add_large("dram", 4, [0.2] * 4, busy_s=1.0)
        return loads

    monkeypatch.setattr(run, "measure_service", fake)
    return run.run_calibration(log=lambda m: None, reps=1, clients=(1, 4), sources=("dram",))


def test_the_cpu_floor_stands_beside_the_prediction_never_in_its_place(
    monkeypatch: Any,
) -> None:
    """An absurd CPU per load (10 CPU-s) puts the floor far above the simulator's
    prediction: each row's prediction is still the simulator's own, and the floor its own
    column, in the row, the JSON and the docs."""
    from cmx.simulate.calibrate.docs import render
    from cmx.simulate.calibrate.predict import predict_loads
    from cmx.simulate.calibrate.run import _control
    from cmx.simulate.calibrate.service import BLOCK_BYTES

    result = _fake_run(monkeypatch, cpu_alone_s=10.0)
    cores = os.cpu_count() or 1
    speeds = result.speeds
    costs = _control({1: [0.002], 8: [0.003]}, 0)
    for row in result.rows:
        simulated = predict_loads(speeds, costs, "dram", 6, BLOCK_BYTES, row.clients, cores)
        assert row.predicted_s == tuple(simulated)
        assert row.floor_s == pytest.approx((row.clients * 10.0 / cores,))
        assert row.predicted < 1.0 < row.floor  # the floor did not raise the prediction
    four = result.rows[1]
    as_json = result.to_dict()["rows"][1]
    assert as_json["predicted_median_s"] == four.predicted
    assert as_json["floor_median_s"] == four.floor
    assert f"| {four.predicted:.3f} | {four.floor:.3f} | {100 * four.error:+.1f}% | **MISS** |" \
        in render(result)


def test_a_calibration_sets_the_scenarios_parameters_against_its_own_figures(
    monkeypatch: Any,
) -> None:
    from cmx.simulate.strategy import CMX

    result = _fake_run(monkeypatch, cpu_alone_s=0.2)
    by_name = {p.name: p for p in result.parameters}
    control = by_name["control per load, dram"]
    assert control.scenarios == CMX.control_s and control.measured is not None
    assert control.measured.median == pytest.approx(result.control["dram"].fixed_s)
    latency = by_name["NVMe latency, per I/O"]
    assert latency.measured is not None and latency.measured.median == 2e-4
    assert [p["name"] for p in result.to_dict()["parameters"]] == list(by_name)
