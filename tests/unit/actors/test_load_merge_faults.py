"""A load that merges into another fill (``Loads._merge``) and fails there must give
back what its own fill pinned, as ``Loads.load`` promises ("a load never leaves a pin or a
reservation behind but the returned prefix's")."""

from __future__ import annotations

import threading
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
from plane import Plane, make_plane
from scenarios import blocks, held, small_config

from cmx.actors.agent.inflight import InFlight
from cmx.actors.agent.loads import Loads
from cmx.actors.agent.scheduler import Priority
from cmx.errors import CmxError
from cmx.tiers import Tier

NODE = f"rvmerge-{uuid.uuid4().hex[:6]}"
BOUND_S = 30.0


@pytest.fixture
def plane(tmp_path) -> Iterator[Plane]:
    p = make_plane(small_config(tmp_path), nodes=(NODE,))
    yield p
    p.close()


def test_a_merge_that_fails_gives_back_the_pins_of_the_loads_own_fill(
        plane: Plane, monkeypatch: pytest.MonkeyPatch) -> None:
    keys, payload = blocks(2, seed=41)
    agent = plane.agents[NODE]
    assert agent.store(keys, [None, keys[0]], payload) == 2
    plane.tiers[(NODE, Tier.HBM)].evict(keys)  # both in DRAM only

    # A prefetch of the second block holds its HBM slot, its fill held open.
    entered, opened = threading.Event(), threading.Event()
    fill = Loads._fill_hbm

    def held_fill(self: Loads, *args: Any, **kw: Any) -> Any:
        if args[3] is Priority.PREFETCH:
            entered.set()
            assert opened.wait(BOUND_S)
        return fill(self, *args, **kw)

    monkeypatch.setattr(Loads, "_fill_hbm", held_fill)
    merging = threading.Event()
    waits = InFlight.waits

    def noted(self: InFlight, ks: Any) -> Any:
        found = waits(self, ks)
        if found:
            merging.set()
        return found

    monkeypatch.setattr(InFlight, "waits", noted)

    # The HBM tier answers the load's acquire, then fails its next pin (a call that timed out).
    hbm = plane.tiers[(NODE, Tier.HBM)]
    pin = hbm.pin
    calls: list[int] = []

    def flaky_pin(keys: Any, owner: str = "") -> Any:
        if owner == "reader":
            calls.append(len(keys))
            if len(calls) > 1:
                raise CmxError("the HBM tier did not answer in time")
        return pin(keys, owner)

    monkeypatch.setattr(hbm, "pin", flaky_pin)

    with ThreadPoolExecutor(2) as pool:
        prefetched = pool.submit(agent.prefetch, keys[1:], plane.lookup(keys[1:]))
        assert entered.wait(BOUND_S)
        # The load is granted block 0 (filled and pinned for it) and finds block 1's slot
        # taken by the prefetch: it merges, and the pin after the merge fails.
        loading = pool.submit(agent.load, keys, plane.lookup(keys), Priority.LOAD, "reader")
        assert merging.wait(BOUND_S)
        opened.set()
        assert prefetched.result(BOUND_S) == 1
        with pytest.raises(CmxError):
            loading.result(BOUND_S)
    # Nothing is returned to "reader", so nothing may stay pinned for it: block 0's pin, made
    # by the load's own fill (commit_pinned), is held until its lease ends.
    leaked = held(plane, NODE, Tier.HBM)
    hbm.release_owner("reader")  # what "reader" holds: the pin the load left behind
    assert held(plane, NODE, Tier.HBM) == (0, 0)
    assert leaked == (0, 0), f"the failed load left {leaked[0]} pin(s) for its owner"


def test_a_prefetch_whose_merge_fails_leaves_no_pin_of_its_own(
        plane: Plane, monkeypatch: pytest.MonkeyPatch) -> None:
    """The same through a prefetch, whose pins are the agent's own: no client gives them up
    (``give_up``), so block 0 stays pinned in HBM until its lease ends (``lease_s``)."""
    keys, payload = blocks(2, seed=42)
    agent = plane.agents[NODE]
    assert agent.store(keys, [None, keys[0]], payload) == 2
    plane.tiers[(NODE, Tier.HBM)].evict(keys)

    entered, opened = threading.Event(), threading.Event()
    fill = Loads._fill_hbm

    def held_fill(self: Loads, *args: Any, **kw: Any) -> Any:
        if args[3] is Priority.LOAD:  # a request's load of block 1 holds its slot
            entered.set()
            assert opened.wait(BOUND_S)
        return fill(self, *args, **kw)

    monkeypatch.setattr(Loads, "_fill_hbm", held_fill)
    merging = threading.Event()
    waits = InFlight.waits

    def noted(self: InFlight, ks: Any) -> Any:
        found = waits(self, ks)
        if found:
            merging.set()
        return found

    monkeypatch.setattr(InFlight, "waits", noted)
    hbm = plane.tiers[(NODE, Tier.HBM)]
    pin = hbm.pin
    mine = agent.loads.tiers.owner
    calls: list[int] = []

    def flaky_pin(keys: Any, owner: str = "") -> Any:
        if owner == mine:
            calls.append(len(keys))
            if len(calls) > 1:  # the prefetch's acquire passes; its merge's pin times out
                raise CmxError("the HBM tier did not answer in time")
        return pin(keys, owner)

    monkeypatch.setattr(hbm, "pin", flaky_pin)
    with ThreadPoolExecutor(2) as pool:
        loading = pool.submit(agent.load, keys[1:], plane.lookup(keys[1:]), Priority.LOAD,
                              "reader")
        assert entered.wait(BOUND_S)
        prefetched = pool.submit(agent.prefetch, keys, plane.lookup(keys))
        assert merging.wait(BOUND_S)
        opened.set()
        result = loading.result(BOUND_S)
        agent.release([b.lease for b in result.blocks])
        with pytest.raises(CmxError):
            prefetched.result(BOUND_S)
    hbm.release_owner("reader")  # whatever the request's load may hold: not counted here
    leaked = held(plane, NODE, Tier.HBM)
    assert leaked == (0, 0), f"the failed prefetch left {leaked[0]} pin(s) of the agent's own"
