"""The simulator's parts alone: links, the agent's queues, one tier's cache."""

from __future__ import annotations

import pytest

from cmx.policies.eviction.lru import LRUPolicy
from cmx.policies.eviction.s3fifo import S3FIFOPolicy
from cmx.simulate.agent import Agent, Job, Priority
from cmx.simulate.cache import TierCache
from cmx.simulate.links import Resource, io_bandwidth, reserve


def test_small_ios_at_shallow_depth_do_not_reach_the_drives_bandwidth() -> None:
    bw, lat = 7e9, 100e-6
    assert io_bandwidth(bw, lat, 4096, 1) == pytest.approx(4096 / (lat + 4096 / bw))
    assert io_bandwidth(bw, lat, 4096, 1) < 0.01 * bw
    assert io_bandwidth(bw, lat, 2 << 20, 16) == bw


def test_two_transfers_over_one_link_take_twice_as_long_and_a_slow_drive_holds_no_nic() -> None:
    nic, drive = Resource("nic", 10e9), Resource("drive", 1e9)
    first = reserve([nic], 0.0, 10**9, 0.0, 1 << 20, 16, 0.0)
    second = reserve([nic], 0.0, 10**9, 0.0, 1 << 20, 16, 0.0)
    assert first == pytest.approx(0.1) and second == pytest.approx(0.2)
    slow = reserve([drive, nic], 0.2, 10**9, 0.0, 1 << 20, 16, 0.0)
    assert slow == pytest.approx(1.2)  # the drive's second
    assert nic.free_at == pytest.approx(0.3)  # the NIC is free again after its own 0.1 s
    assert nic.bytes == 3 * 10**9 and drive.busy_s == pytest.approx(1.0)


def _job(priority: Priority, log: list[str], name: str) -> Job:
    return Job(priority, run=lambda now: now + 1.0, done=lambda now: log.append(name))


def test_agent_runs_loads_then_prefetches_then_background_and_drops_only_below_loads() -> None:
    agent = Agent(lanes=1, bound=2)
    log: list[str] = []
    jobs = [_job(Priority.BACKGROUND, log, "bg1"), _job(Priority.BACKGROUND, log, "bg2"),
            _job(Priority.PREFETCH, log, "pf"), _job(Priority.LOAD, log, "ld")]
    for j in jobs:
        assert agent.submit(j, 0.0)
    assert not agent.submit(_job(Priority.BACKGROUND, log, "bg3"), 0.0)
    assert agent.dropped[Priority.BACKGROUND] == 1
    for _ in range(5):
        assert agent.submit(_job(Priority.LOAD, log, "more"), 0.0)  # loads are never dropped
    order = []
    while (j := agent.next_job(0.0)) is not None:
        j.done(0.0)
        order.append(log[-1])
        agent.finish()
        agent.check_integrity()
    assert order == ["ld"] + ["more"] * 5 + ["pf", "bg1", "bg2"]
    assert agent.queued == 0


def test_a_promoted_prefetch_runs_with_the_loads_and_is_counted_once() -> None:
    agent = Agent(lanes=1, bound=8)
    log: list[str] = []
    bg, pf = _job(Priority.BACKGROUND, log, "bg"), _job(Priority.PREFETCH, log, "pf")
    running = _job(Priority.LOAD, log, "running")
    agent.submit(running, 0.0)
    assert agent.next_job(0.0) is running
    agent.submit(pf, 0.0)
    agent.submit(bg, 0.0)
    agent.promote(pf)
    agent.check_integrity()
    assert agent.queued == 2
    assert agent.next_job(0.0) is None  # the one lane is busy
    agent.finish()
    assert agent.next_job(1.0) is pf and pf.priority is Priority.LOAD
    agent.finish()
    assert agent.next_job(2.0) is bg
    agent.finish()
    assert agent.next_job(3.0) is None and agent.queued == 0


def test_a_tier_evicts_in_its_policys_order_skips_pins_and_refuses_what_cannot_fit() -> None:
    cache = TierCache("t", capacity_bytes=300, eviction="lru")
    assert isinstance(cache.policy, LRUPolicy)
    for k in (b"a", b"b", b"c"):
        assert cache.insert(k, None, 100) == []
    cache.touch(b"a")  # b is now the least recently used
    cache.pin(b"b")
    assert cache.insert(b"d", None, 100) == [b"c"]  # b pinned: c goes
    cache.pin(b"a")
    cache.pin(b"d")
    assert cache.insert(b"e", None, 100) is None  # everything pinned: nothing changes
    assert cache.used == 300 and b"e" not in cache
    assert cache.insert(b"big", None, 301) is None
    cache.check_integrity()
    assert cache.evictions == 1 and cache.bytes_in - cache.bytes_out == 300


def test_a_tier_drives_the_policy_named_and_leaves_go_before_their_parents() -> None:
    cache = TierCache("t", capacity_bytes=200, eviction="s3fifo")
    assert isinstance(cache.policy, S3FIFOPolicy)
    lru = TierCache("u", capacity_bytes=200, eviction="lru")
    lru.insert(b"root", None, 100)
    lru.insert(b"leaf", b"root", 100)
    assert lru.insert(b"other", None, 100) == [b"leaf"]  # prefix-aware: the root is kept
    lru.check_integrity()
    with pytest.raises(ValueError):
        TierCache("v", capacity_bytes=-1)
