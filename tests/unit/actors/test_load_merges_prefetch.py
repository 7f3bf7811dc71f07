"""A load of blocks a prefetch is still filling into HBM waits for that fill and pins what it
committed: it never comes back short because a prefetch got there first (the agent's
``InFlight``). Two loads of the same blocks at once merge the same way."""

from __future__ import annotations

import threading
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import pytest
from plane import Plane, make_plane
from scenarios import blocks, check, held, small_config

from cmx.actors.agent.inflight import InFlight
from cmx.actors.agent.loads import Loads
from cmx.actors.agent.scheduler import Priority
from cmx.errors import CmxError
from cmx.tiers import Tier

NODE = f"merge-{uuid.uuid4().hex[:6]}"  # arenas named apart from other suites' on this host
BOUND_S = 30.0


@pytest.fixture
def plane(tmp_path) -> Iterator[Plane]:
    p = make_plane(small_config(tmp_path), nodes=(NODE,))
    yield p
    p.close()


def held_fill(monkeypatch: pytest.MonkeyPatch, priority: Priority, fail: bool = False
              ) -> tuple[threading.Event, threading.Event]:
    """Hold every fill at ``priority`` once its HBM slots are granted, until ``opened``;
    ``entered`` is set once one is held. With ``fail``, the fill then fails."""
    entered, opened = threading.Event(), threading.Event()
    fill = Loads._fill_hbm

    def held(self: Loads, *args: Any, **kw: Any) -> Any:
        if args[3] is priority:
            entered.set()
            assert opened.wait(BOUND_S)
            if fail:
                raise CmxError("its source went")
        return fill(self, *args, **kw)

    monkeypatch.setattr(Loads, "_fill_hbm", held)
    return entered, opened


def merging(monkeypatch: pytest.MonkeyPatch) -> threading.Event:
    """Set once a load asks which fills under way it must wait for."""
    asked = threading.Event()
    waits = InFlight.waits

    def noted(self: InFlight, keys: Any) -> Any:
        found = waits(self, keys)
        if found:
            asked.set()
        return found

    monkeypatch.setattr(InFlight, "waits", noted)
    return asked


def in_dram_only(plane: Plane, n: int, seed: int) -> tuple[list[bytes], np.ndarray]:
    keys, payload = blocks(n, seed=seed)
    agent = plane.agents[NODE]
    assert agent.store(keys, [None, *keys[:-1]], payload) == n
    plane.tiers[(NODE, Tier.HBM)].evict(keys)
    return keys, payload


def hbm_bytes(plane: Plane, result: Any) -> np.ndarray:
    _, hbm = plane.agents[NODE].tiers.current(Tier.HBM)
    return np.concatenate([hbm.slot_view(b.slot)[: b.size] for b in result.blocks])


def whole_then_nothing_held(plane: Plane, results: Any, payload: np.ndarray, n: int) -> None:
    """Each load brought all ``n`` blocks with their bytes; once they are released, HBM holds
    nothing for anyone, nothing is in flight and every part is intact."""
    agent = plane.agents[NODE]
    for result in results:
        assert len(result.blocks) == n  # every block, no load short
        assert np.array_equal(hbm_bytes(plane, result), payload)
        agent.release([b.lease for b in result.blocks])
    assert held(plane, NODE, Tier.HBM) == (0, 0)
    assert len(agent.loads.in_flight) == 0
    check(plane)


def test_a_load_of_blocks_a_prefetch_is_filling_waits_and_gets_them_all(
        plane: Plane, monkeypatch: pytest.MonkeyPatch) -> None:
    keys, payload = in_dram_only(plane, 3, seed=21)
    agent = plane.agents[NODE]
    entered, opened = held_fill(monkeypatch, Priority.PREFETCH)
    with ThreadPoolExecutor(2) as pool:
        prefetched = pool.submit(agent.prefetch, keys, plane.lookup(keys))
        assert entered.wait(BOUND_S)  # the prefetch holds every HBM slot of the prefix
        asked = merging(monkeypatch)
        loading = pool.submit(agent.load, keys, plane.lookup(keys), Priority.LOAD, "reader")
        assert asked.wait(BOUND_S)  # waiting for the prefetch's fill, not answered short
        assert not loading.done()
        opened.set()
        result = loading.result(BOUND_S)
        assert prefetched.result(BOUND_S) == 3
    assert len(result.blocks) == 3  # not short: merged into the prefetch's fill
    assert np.array_equal(hbm_bytes(plane, result), payload)
    agent.release([b.lease for b in result.blocks])
    assert held(plane, NODE, Tier.HBM) == (0, 0)
    check(plane)


def test_two_loads_of_the_same_blocks_at_once_both_get_them(
        plane: Plane, monkeypatch: pytest.MonkeyPatch) -> None:
    keys, payload = in_dram_only(plane, 2, seed=22)
    agent = plane.agents[NODE]
    entered, opened = held_fill(monkeypatch, Priority.LOAD)
    with ThreadPoolExecutor(2) as pool:
        first = pool.submit(agent.load, keys, plane.lookup(keys), Priority.LOAD, "first")
        assert entered.wait(BOUND_S)
        asked = merging(monkeypatch)
        second = pool.submit(agent.load, keys, plane.lookup(keys), Priority.LOAD, "second")
        assert asked.wait(BOUND_S)
        opened.set()
        results = [first.result(BOUND_S), second.result(BOUND_S)]
    whole_then_nothing_held(plane, results, payload, 2)


def test_a_fill_that_fails_leaves_the_merged_load_short_never_hung(
        plane: Plane, monkeypatch: pytest.MonkeyPatch) -> None:
    keys, _ = in_dram_only(plane, 2, seed=23)
    agent = plane.agents[NODE]
    entered, opened = held_fill(monkeypatch, Priority.PREFETCH, fail=True)
    with ThreadPoolExecutor(2) as pool:
        prefetched = pool.submit(agent.prefetch, keys, plane.lookup(keys))
        assert entered.wait(BOUND_S)
        asked = merging(monkeypatch)
        loading = pool.submit(agent.load, keys, plane.lookup(keys), Priority.LOAD, "reader")
        assert asked.wait(BOUND_S)
        opened.set()
        with pytest.raises(CmxError):
            prefetched.result(BOUND_S)
        result = loading.result(BOUND_S)
    assert result.blocks == []  # a miss, answered: the load asks again or recomputes
    assert held(plane, NODE, Tier.HBM) == (0, 0)
    assert len(agent.loads.in_flight) == 0
    check(plane)


def flaky_pins(monkeypatch: pytest.MonkeyPatch, plane: Plane, who: str) -> None:
    """The HBM tier answers ``who``'s first pin (a load's acquire), then fails the next
    (the pin after a merge), as a call that timed out."""
    hbm = plane.tiers[(NODE, Tier.HBM)]
    pin = hbm.pin
    calls: list[int] = []

    def flaky(keys: Any, owner: str = "") -> Any:
        if owner == who:
            calls.append(len(keys))
            if len(calls) > 1:
                raise CmxError("the HBM tier did not answer in time")
        return pin(keys, owner)

    monkeypatch.setattr(hbm, "pin", flaky)


def test_a_merge_that_fails_gives_back_the_pins_of_the_loads_own_fill(
        plane: Plane, monkeypatch: pytest.MonkeyPatch) -> None:
    """The load fills block 0 itself, finds block 1's slot held by a prefetch, merges, and
    the pin after the merge fails: nothing may stay pinned for its owner ("a load never
    leaves a pin or a reservation behind but the returned prefix's")."""
    keys, _ = in_dram_only(plane, 2, seed=41)
    agent = plane.agents[NODE]
    entered, opened = held_fill(monkeypatch, Priority.PREFETCH)
    asked = merging(monkeypatch)
    flaky_pins(monkeypatch, plane, "reader")
    with ThreadPoolExecutor(2) as pool:
        prefetched = pool.submit(agent.prefetch, keys[1:], plane.lookup(keys[1:]))
        assert entered.wait(BOUND_S)
        loading = pool.submit(agent.load, keys, plane.lookup(keys), Priority.LOAD, "reader")
        assert asked.wait(BOUND_S)
        opened.set()
        assert prefetched.result(BOUND_S) == 1
        with pytest.raises(CmxError):
            loading.result(BOUND_S)
    assert held(plane, NODE, Tier.HBM) == (0, 0)


def test_a_prefetch_whose_merge_fails_leaves_no_pin_of_its_own(
        plane: Plane, monkeypatch: pytest.MonkeyPatch) -> None:
    """The same through a prefetch, whose pins are the agent's own: nobody would give them
    up, and block 0 would stay pinned in HBM until its lease ended."""
    keys, _ = in_dram_only(plane, 2, seed=42)
    agent = plane.agents[NODE]
    entered, opened = held_fill(monkeypatch, Priority.LOAD)
    asked = merging(monkeypatch)
    flaky_pins(monkeypatch, plane, agent.loads.tiers.owner)
    with ThreadPoolExecutor(2) as pool:
        loading = pool.submit(agent.load, keys[1:], plane.lookup(keys[1:]), Priority.LOAD,
                              "reader")
        assert entered.wait(BOUND_S)
        prefetched = pool.submit(agent.prefetch, keys, plane.lookup(keys))
        assert asked.wait(BOUND_S)
        opened.set()
        result = loading.result(BOUND_S)
        agent.release([b.lease for b in result.blocks])
        with pytest.raises(CmxError):
            prefetched.result(BOUND_S)
    plane.tiers[(NODE, Tier.HBM)].release_owner("reader")
    assert held(plane, NODE, Tier.HBM) == (0, 0)


def between_acquire_and_fill(monkeypatch: pytest.MonkeyPatch, plane: Plane, who: str,
                             step: Any) -> None:
    """Run ``step`` once, when HBM has reserved ``who``'s slots and before its load hears so:
    the moment a load of the same blocks finds them neither held nor granted."""
    hbm = plane.tiers[(NODE, Tier.HBM)]
    acquire = hbm.acquire
    ran: list[bool] = []

    def answered(items: Any, owner: str) -> Any:
        grants = acquire(items, owner)
        if owner == who and not ran:
            ran.append(True)
            step()
        return grants

    monkeypatch.setattr(hbm, "acquire", answered)


def test_a_load_in_the_gap_after_another_loads_acquire_waits_for_its_fill(
        plane: Plane, monkeypatch: pytest.MonkeyPatch) -> None:
    """The second load asks HBM while the first one's slots are reserved but before the first
    hears its grants: it must wait for the first's fill, not come back short."""
    keys, payload = in_dram_only(plane, 3, seed=43)
    agent = plane.agents[NODE]
    settled = merging(monkeypatch)  # the second load waits for a fill, or has answered
    pool = ThreadPoolExecutor(2)
    second: list[Any] = []

    def second_load() -> None:
        second.append(pool.submit(agent.load, keys, plane.lookup(keys), Priority.LOAD,
                                  "second"))
        second[0].add_done_callback(lambda _: settled.set())
        assert settled.wait(BOUND_S)

    between_acquire_and_fill(monkeypatch, plane, "first", second_load)
    with pool:
        first = agent.load(keys, plane.lookup(keys), Priority.LOAD, "first")
        result = second[0].result(BOUND_S)
    whole_then_nothing_held(plane, (first, result), payload, 3)


def test_a_load_whose_acquire_fails_leaves_nothing_in_flight(
        plane: Plane, monkeypatch: pytest.MonkeyPatch) -> None:
    """Nobody waits for the fill of a load that never got its slots."""
    keys, payload = in_dram_only(plane, 2, seed=44)
    agent = plane.agents[NODE]
    hbm = plane.tiers[(NODE, Tier.HBM)]
    acquire = hbm.acquire

    def failing(items: Any, owner: str) -> Any:
        if owner == "first":
            raise CmxError("the HBM tier did not answer in time")
        return acquire(items, owner)

    monkeypatch.setattr(hbm, "acquire", failing)
    with pytest.raises(CmxError):
        agent.load(keys, plane.lookup(keys), Priority.LOAD, "first")
    assert len(agent.loads.in_flight) == 0
    result = agent.load(keys, plane.lookup(keys), Priority.LOAD, "second")
    assert np.array_equal(hbm_bytes(plane, result), payload)
    agent.release([b.lease for b in result.blocks])
    assert held(plane, NODE, Tier.HBM) == (0, 0)
    check(plane)
