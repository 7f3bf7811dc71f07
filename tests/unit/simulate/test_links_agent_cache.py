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
    first = reserve([nic], 0.0, 10**9, 0.0, 1 << 20, 16)
    second = reserve([nic], 0.0, 10**9, 0.0, 1 << 20, 16)
    assert first == pytest.approx(0.1) and second == pytest.approx(0.2)
    slow = reserve([drive, nic], 0.2, 10**9, 0.0, 1 << 20, 16)
    assert slow == pytest.approx(1.2)  # the drive's second
    assert nic.free_at == pytest.approx(0.3)  # the NIC is free again after its own 0.1 s
    assert nic.bytes == 3 * 10**9 and drive.busy_s == pytest.approx(1.0)


def _job(priority: Priority, log: list[str], name: str, nbytes: int = 0) -> Job:
    return Job(priority, run=lambda now: now + 1.0, done=lambda now: log.append(name),
               staging_bytes=nbytes, refused=[lambda now: log.append(f"refused {name}")])


def test_agent_runs_loads_then_prefetches_then_demotions_and_a_full_class_waits() -> None:
    agent = Agent(lanes=1, bound=2, timeout_s=30.0)
    log: list[str] = []
    jobs = [_job(Priority.DEMOTE, log, "bg1"), _job(Priority.DEMOTE, log, "bg2"),
            _job(Priority.PREFETCH, log, "pf"), _job(Priority.LOAD, log, "ld"),
            _job(Priority.DEMOTE, log, "bg3")]  # its class is full: it waits for a place
    for j in jobs:
        agent.submit(j, 0.0)
    assert agent.alarms() == [30.0] and agent.queued == 4
    order = []
    while (ready := agent.next_job(0.0)) is not None:
        ready.done(0.0)
        order.append(log[-1])
        agent.finish(ready)
        agent.check_integrity()
    assert order == ["ld", "pf", "bg1", "bg2", "bg3"]
    agent.expire(30.0)  # bg3 got a place before its deadline
    assert agent.queued == 0 and agent.refused[Priority.DEMOTE] == 0


def test_a_job_still_waiting_for_a_place_at_its_deadline_is_refused() -> None:
    agent = Agent(lanes=1, bound=1, timeout_s=30.0)
    log: list[str] = []
    running, queued = _job(Priority.LOAD, log, "running"), _job(Priority.LOAD, log, "queued")
    late = _job(Priority.LOAD, log, "late")
    agent.submit(running, 0.0)
    assert agent.next_job(0.0) is running
    agent.submit(queued, 0.0)
    agent.submit(late, 10.0)
    assert agent.alarms() == [40.0]
    agent.expire(39.0)
    assert log == []
    agent.expire(40.0)
    assert log == ["refused late"] and agent.refused[Priority.LOAD] == 1
    agent.finish(running)
    assert agent.next_job(41.0) is queued and agent.next_job(41.0) is None
    agent.check_integrity()


def test_a_job_waits_on_its_lane_for_staging_bytes_and_is_refused_them_at_its_deadline() -> None:
    agent = Agent(lanes=2, bound=4, staging_bytes=100, timeout_s=30.0)
    log: list[str] = []
    a, b, c = (_job(Priority.DEMOTE, log, n, nbytes) for n, nbytes in
               (("a", 80), ("b", 40), ("c", 50)))
    for j in (a, b, c):
        agent.submit(j, 0.0)
    assert agent.next_job(0.0) is a
    assert agent.next_job(0.0) is None  # b holds the second lane, waiting for its bytes
    assert agent.running == 2 and agent.queued == 1 and agent.alarms() == [30.0]
    agent.finish(a)
    assert agent.next_job(1.0) is b  # then c takes a's lane: 40 + 50 fit
    assert agent.next_job(1.0) is c
    agent.finish(b)
    d = _job(Priority.DEMOTE, log, "d", 60)
    agent.submit(d, 2.0)
    assert agent.next_job(2.0) is None and agent.alarms() == [32.0]
    agent.expire(32.0)
    assert log == ["refused d"] and agent.running == 1
    agent.check_integrity()


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
