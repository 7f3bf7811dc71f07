"""The "prefetch" suite's queue waits come from LMCache's cold loads, measured first, never from
our own: a wait set to our own cold load would let our preload finish by construction."""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

import pytest

from cmx.bench.harness.core import BenchConfig, BenchContext
from cmx.bench.suites.lmcache import prefetch
from cmx.bench.suites.lmcache.lmcache_env import REQUIRED_KEYS, Peer, PeerError
from cmx.bench.suites.lmcache.prefetch import (
    WAIT_FRACTIONS,
    _theirs_waited,
    queue_waits,
    run_prefetch,
)


def context(tmp_path: Path) -> BenchContext:
    work = tmp_path / f"work-{uuid.uuid4().hex[:8]}"
    return BenchContext(BenchConfig(dir=tmp_path, reps=3, gib=0.01), work)


def test_the_waits_are_fractions_of_the_baselines_median_cold_load() -> None:
    assert queue_waits([11.0, 13.0, 12.0]) == [f * 12.0 for f in WAIT_FRACTIONS]
    with pytest.raises(ValueError):
        queue_waits([])
    with pytest.raises(ValueError):
        queue_waits([1.0, 0.0, 2.0])


def test_the_driver_reports_its_waits_and_they_must_follow_from_its_cold_loads() -> None:
    assert "waits" in REQUIRED_KEYS["prefetch"]
    cold = [5.0, 4.0, 6.0]
    waits = queue_waits(cold)
    got = _theirs_waited({"cold_s": cold, "waits": waits, "ready_s": [[0.5] * 3, [2.5] * 3]})
    assert got["ready_s"] == {waits[0]: [0.5] * 3, waits[1]: [2.5] * 3}
    with pytest.raises(PeerError):  # waits set from anything else: our own cold load, say
        _theirs_waited({"cold_s": cold, "waits": [4.0, 2.0], "ready_s": [[0.5], [2.5]]})


def test_ours_loads_after_lmcaches_waits_and_lmcache_is_measured_first(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[str] = []
    their_cold = [10.0, 12.0, 11.0]
    waits = queue_waits(their_cold)
    seen: dict[str, Any] = {}

    def theirs(ctx: BenchContext, peer: Peer, tokens: int) -> dict[str, Any]:
        calls.append("theirs")
        return {"cold_s": their_cold, "waits": waits, "store_s": 1.0, "verified": True,
                "ready_s": {waits[0]: [0.4, 0.5, 0.6], waits[1]: [6.0, 6.1, 6.2]}}

    def ours(ctx: BenchContext, tokens: int, got_waits: list[float]) -> dict[str, Any]:
        calls.append("ours")
        seen["waits"] = got_waits
        # Our cold loads are far faster than LMCache's: the waits must not follow them.
        return {"cold_s": [2.0, 2.0, 2.0], "waits": list(got_waits), "store_s": 1.0,
                "ready_s": {w: [0.0, 0.0, 0.0] for w in got_waits}}

    monkeypatch.setattr(prefetch, "ensure_peer", lambda ctx: Peer(Path("py"), "0.5", "2"))
    monkeypatch.setattr(prefetch, "_theirs", theirs)
    monkeypatch.setattr(prefetch, "_ours", ours)
    result = run_prefetch(context(tmp_path))
    assert calls == ["theirs", "ours"]
    assert seen["waits"] == [11.0, 5.5]  # LMCache's median cold load, and half of it
    waited = [f for f in result.figures if "time-to-KV-ready" in f.name]
    assert waited and all("LMCache's median cold load" in f.name for f in waited)
    assert any("11.00 s" in f.name for f in waited) and any("5.50 s" in f.name for f in waited)
    assert not any("our" in f.name.split("queue wait")[-1] for f in waited)


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
