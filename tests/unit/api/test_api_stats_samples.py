"""Samples of the service: rates between samples of one tier incarnation, and the window."""

from __future__ import annotations

from api_fakes import NO_POOL, agent_stats

from cmx.api.stats_samples import Sample, StatsSampler, rates_between
from cmx.stats import LeaseStats, NodeStats, ServiceStats, TierStats, Unreachable
from cmx.storage.base import StoreStats
from cmx.tiers import Tier


def stats(bytes_in: int, hits: int = 0, misses: int = 0, epoch: str = "e") -> ServiceStats:
    store = StoreStats(100, 10, 1, hits=hits, misses=misses, bytes_written=bytes_in)
    dram = TierStats(Tier.DRAM, "n", epoch, store, 0, 0, LeaseStats(0, 0, 0, 0))
    tiers = {Tier.DRAM: dram, Tier.NVME: Unreachable("down")}
    return ServiceStats({"n": NodeStats("n", tiers, agent_stats("n"))}, (), NO_POOL)


def test_rates_need_two_samples_of_the_same_incarnation() -> None:
    a, b = Sample.of(10.0, stats(1000, 1, 1)), Sample.of(14.0, stats(5000, 4, 2))
    r = rates_between(a, b, ("n", "dram"))
    assert r is not None and r.window_s == 4.0
    assert r.in_bytes_per_s == 1000.0 and r.out_bytes_per_s == 0.0 and r.hit_ratio == 0.75
    assert rates_between(a, b, ("n", "nvme")) is None  # it did not answer
    assert rates_between(b, a, ("n", "dram")) is None  # time went back
    assert rates_between(a, Sample.of(14.0, stats(5000, epoch="f")), ("n", "dram")) is None
    assert rates_between(a, Sample.of(14.0, stats(10)), ("n", "dram")) is None
    same = rates_between(a, Sample.of(12.0, stats(1000, 1, 1)), ("n", "dram"))
    assert same is not None and same.hit_ratio is None  # no lookups in the window


def test_sampler_keeps_its_window_and_reuses_a_fresh_sample() -> None:
    now = [0.0]
    calls = []

    def collect() -> ServiceStats:
        calls.append(now[0])
        return stats(int(now[0]) * 10)

    sampler = StatsSampler(collect, history_s=30.0, clock=lambda: now[0])
    for t in range(0, 50, 5):
        now[0] = float(t)
        sampler.sample()
    assert [s.t for s in sampler] == [15.0, 20.0, 25.0, 30.0, 35.0, 40.0, 45.0]
    assert [s.t for s in sampler.window(10.0)] == [35.0, 40.0, 45.0]
    now[0] = 46.0
    latest = sampler.fresh(2.0)
    assert latest.t == 45.0 and len(calls) == 10
    assert sampler.previous(latest).t == 40.0  # type: ignore[union-attr]
    now[0] = 48.0
    assert sampler.fresh(2.0).t == 48.0 and len(calls) == 11

