"""The "prefetch" suite's queue waits are fixed in seconds, set by neither side: no cold load,
LMCache's or ours, moves them, LMCache's driver must wait the same ones, and every wait is
judged on its own."""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

import pytest

from cmx.bench.harness.core import BenchConfig, BenchContext, Verdict
from cmx.bench.suites.lmcache import prefetch
from cmx.bench.suites.lmcache.lmcache_env import REQUIRED_KEYS, Peer, PeerError
from cmx.bench.suites.lmcache.prefetch import (
    QUEUE_WAITS_S,
    READY_GOAL,
    _figures,
    _theirs_waited,
    run_prefetch,
)

SIZE = "81,920 tokens (10 GiB)"


def context(tmp_path: Path) -> BenchContext:
    work = tmp_path / f"work-{uuid.uuid4().hex[:8]}"
    return BenchContext(BenchConfig(dir=tmp_path, reps=3, gib=0.01), work)


def test_the_waits_are_fixed_seconds_rising_from_none() -> None:
    assert QUEUE_WAITS_S[0] == 0.0 and len(QUEUE_WAITS_S) >= 3
    assert list(QUEUE_WAITS_S) == sorted(set(QUEUE_WAITS_S))


def test_the_driver_must_wait_the_fixed_waits_whatever_its_cold_loads() -> None:
    assert "waits" in REQUIRED_KEYS["prefetch"]
    cold = [5.0, 4.0, 6.0]
    ready = [[w / 10] * 3 for w in QUEUE_WAITS_S]
    got = _theirs_waited({"cold_s": cold, "waits": list(QUEUE_WAITS_S), "ready_s": ready}, 3)
    assert got["ready_s"] == dict(zip(QUEUE_WAITS_S, ready, strict=True))
    with pytest.raises(PeerError):  # waits set from its own cold load, and half of it
        _theirs_waited({"cold_s": cold, "waits": [5.0, 2.5], "ready_s": [[0.5], [2.5]]}, 1)
    with pytest.raises(PeerError):  # a wait left out
        _theirs_waited({"cold_s": cold, "waits": list(QUEUE_WAITS_S[:-1]),
                        "ready_s": ready[:-1]}, 3)
    with pytest.raises(PeerError):  # one time a wait where the run asked for three
        _theirs_waited({"cold_s": cold, "waits": list(QUEUE_WAITS_S),
                        "ready_s": [[w / 10] for w in QUEUE_WAITS_S]}, 3)


def test_both_sides_wait_the_fixed_waits_and_each_is_judged(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[str] = []
    seen: dict[str, Any] = {}

    def theirs(ctx: BenchContext, peer: Peer, tokens: int) -> dict[str, Any]:
        calls.append("theirs")
        return {"cold_s": [10.0, 12.0, 11.0], "waits": list(QUEUE_WAITS_S), "store_s": 1.0,
                "verified": True,
                "ready_s": {w: [11.5 - w, 11.6 - w, 11.4 - w] for w in QUEUE_WAITS_S}}

    def ours(ctx: BenchContext, tokens: int, got_waits: list[float]) -> dict[str, Any]:
        calls.append("ours")
        seen["waits"] = got_waits
        return {"cold_s": [5.0, 5.0, 5.0], "waits": list(got_waits), "store_s": 1.0,
                "ready_s": {w: [max(0.0, 5.0 - w)] * 3 for w in got_waits}}

    monkeypatch.setattr(prefetch, "ensure_peer", lambda ctx: Peer(Path("py"), "0.5", "2"))
    monkeypatch.setattr(prefetch, "_theirs", theirs)
    monkeypatch.setattr(prefetch, "_ours", ours)
    result = run_prefetch(context(tmp_path))
    assert calls == ["theirs", "ours"]
    # Neither LMCache's median cold load (11 s) nor ours (5 s) set a wait.
    assert seen["waits"] == list(QUEUE_WAITS_S)
    judged = [f for f in result.figures if f.goal is not None]
    assert [f.goal for f in judged] == [READY_GOAL] * len(QUEUE_WAITS_S)
    for w, f in zip(QUEUE_WAITS_S, judged, strict=True):
        assert f"queue wait {w:g} s (fixed)" in f.name and "cold load" not in f.name
    assert any("set by neither side" in n for n in result.notes)


def test_a_wait_passes_only_when_its_own_times_show_it() -> None:
    ours = {"cold_s": [4.0, 4.2, 4.1], "waits": list(QUEUE_WAITS_S),
            "ready_s": {w: [max(0.0, 4.1 - w)] * 3 for w in QUEUE_WAITS_S}}
    theirs = {"cold_s": [5.0, 5.1, 4.9], "waits": list(QUEUE_WAITS_S),
              "ready_s": {w: [5.0 - w + 0.7] * 3 for w in QUEUE_WAITS_S}}
    figs = _figures(ours, theirs, SIZE)
    by_wait = {w: f for w in QUEUE_WAITS_S for f in figs
               if f.goal is not None and f"queue wait {w:g} s" in f.name}
    assert by_wait[0.0].verdict is Verdict.MISS  # 4.1 s against 5.7 s: no head start at all
    last = QUEUE_WAITS_S[-1]
    assert by_wait[last].verdict is Verdict.PASS  # 0.1 s against 1.7 s
    no_preload = next(f for f in figs if f"queue wait {last:g} s" in f.name
                      and "no preloading" in f.name)
    assert no_preload.goal is None and no_preload.baseline == 5.0  # its blocking load


def test_without_lmcache_ours_makes_cold_loads_only_and_there_is_no_figure(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    seen: dict[str, Any] = {}

    def no_peer(ctx: BenchContext) -> Peer:
        raise PeerError("no LMCache here")

    def ours(ctx: BenchContext, tokens: int, got_waits: list[float]) -> dict[str, Any]:
        seen["waits"] = got_waits
        return {"cold_s": [2.0], "waits": [], "store_s": 1.0, "ready_s": {}}

    monkeypatch.setattr(prefetch, "ensure_peer", no_peer)
    monkeypatch.setattr(prefetch, "_ours", ours)
    result = run_prefetch(context(tmp_path))
    assert seen["waits"] == [] and result.figures == []
    assert "no LMCache here" in result.notes[0]


def test_a_wait_that_outlasts_a_cold_load_judges_nothing() -> None:
    # Ours loads in 2 s: after a wait of 2 s or more it is done by construction, however
    # LMCache fares, so those waits are shown and not judged.
    ours = {"cold_s": [2.0, 2.0, 2.0], "waits": list(QUEUE_WAITS_S),
            "ready_s": {w: [max(0.0, 2.0 - w)] * 3 for w in QUEUE_WAITS_S}}
    theirs = {"cold_s": [5.0, 5.1, 4.9], "waits": list(QUEUE_WAITS_S),
              "ready_s": {w: [5.0 - w + 0.7] * 3 for w in QUEUE_WAITS_S}}
    figs = [f for f in _figures(ours, theirs, SIZE)
            if f.name.endswith("(fixed)")]  # the judged kind, one a wait
    judged = {w for w in QUEUE_WAITS_S for f in figs
              if f"queue wait {w:g} s" in f.name and f.goal is not None}
    assert judged == {w for w in QUEUE_WAITS_S if w < 2.0}
    assert all("by construction" in f.note for f in figs if f.goal is None)
