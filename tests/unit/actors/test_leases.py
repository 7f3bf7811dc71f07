"""Every pin and reservation has an owner and an expiry: error paths give back what they were
granted, and what a holder that timed out or died leaves is taken back within the lease time."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest
from plane import NODE_A, NODE_B, Plane, make_plane
from scenarios import BLOCK, LEASE_S, blocks, check, held, load, small_config

from cmx.actors.pool.node import PoolNodeService
from cmx.actors.tiers.leases import LeaseKind, Leases
from cmx.errors import UnavailableError
from cmx.links import actor_name
from cmx.tiers import Tier


@pytest.fixture
def plane(tmp_path) -> Iterator[Plane]:
    p = make_plane(small_config(tmp_path))
    yield p
    p.close()


class _Down:
    """A tier that is not running: every call to it fails as a dead actor's does."""

    def __init__(self, plane: Plane, node: str, kind: str) -> None:
        self.targets = plane.link._targets  # type: ignore[attr-defined]
        self.name = actor_name(kind, node)

    def __enter__(self) -> None:
        self.saved = self.targets.pop(self.name)

    def __exit__(self, *exc: object) -> None:
        self.targets[self.name] = self.saved


def test_leases_expire_on_the_clock_and_count() -> None:
    now = [0.0]
    given_back: list[int] = []
    leases = Leases(10.0, clock=lambda: now[0])
    a = leases.grant("client:a", LeaseKind.PIN, b"k" * 32, given_back.append)
    b = leases.grant("client:b", LeaseKind.RESERVE, b"j" * 32, given_back.append)
    now[0] = 9.9
    assert leases.expire() == 0 and given_back == []
    assert leases.take(b) is not None  # its holder committed it
    now[0] = 10.0
    assert leases.expire() == 1 and given_back == [a]
    stats = leases.stats()
    assert (stats.pinned, stats.reserved, stats.expired) == (0, 0, 1)
    with pytest.raises(ValueError, match="positive"):
        Leases(0)


def test_a_released_owners_pins_are_refused_for_a_lease_time() -> None:
    now = [0.0]
    given_back: list[int] = []
    leases = Leases(10.0, clock=lambda: now[0])
    assert leases.release_owner("client:late") == 0  # the release ran before the pin
    assert leases.grant_pin("client:late", b"k" * 32, given_back.append) is None
    assert leases.grant_pin("client:other", b"k" * 32, given_back.append) is not None
    now[0] = 10.0  # the owner is forgotten: its memory is bounded
    leases.release_owner("client:next")
    assert list(leases._gone) == ["client:next"]
    assert leases.grant_pin("client:late", b"k" * 32, given_back.append) is not None
    assert given_back == [] and leases.stats().released == 1


def test_pins_granted_at_once_are_refused_at_once_for_a_released_owner() -> None:
    ended: list[bytes] = []
    leases = Leases(10.0, clock=lambda: 0.0)

    def undo(key: bytes):  # type: ignore[no-untyped-def]
        return lambda _lease: ended.append(key)

    keys = [bytes([i]) * 32 for i in range(3)]
    granted = leases.grant_pins("client:a", keys, undo)
    assert granted is not None and len(set(granted)) == 3 and len(leases) == 3
    leases.release_owner("client:b")
    assert leases.grant_pins("client:b", keys, undo) is None and len(leases) == 3
    assert leases.end(granted[1:]) == 2 and ended == keys[1:]


def test_a_load_failing_part_way_leaves_nothing_held(plane: Plane) -> None:
    keys, payload = blocks(6, seed=31)
    plane.agents[NODE_A].store(keys, [None, *keys[:-1]], payload)
    load(plane, NODE_A, keys[:4])  # HBM (4 slots) is full of keys 0-3
    want = [keys[0], keys[1], keys[4], keys[5]]
    with _Down(plane, NODE_A, "dram"):  # HBM's victims cannot go down, the fills fail
        data, loaded = load(plane, NODE_A, want)
    assert len(loaded) == 2  # the HBM hits; the rest a miss
    assert held(plane, NODE_A, Tier.HBM) == (0, 0)
    data, loaded = load(plane, NODE_A, keys[:4])
    assert len(loaded) == 4 and np.array_equal(data, payload[: 4 * BLOCK])
    check(plane)


def test_a_store_whose_demotion_fails_leaves_its_keys_storable(plane: Plane) -> None:
    agent = plane.agents[NODE_A]
    keys, payload = blocks(8, seed=32)
    agent.store(keys, [None, *keys[:-1]], payload)  # DRAM (8 slots) is full
    more, more_payload = blocks(4, seed=33)
    with _Down(plane, NODE_A, "nvme"):  # the evicted blocks cannot be demoted
        agent.store(more, [None, *more[:-1]], more_payload)
    assert held(plane, NODE_A, Tier.DRAM) == (0, 0)
    agent.store(more, [None, *more[:-1]], more_payload)
    data, loaded = load(plane, NODE_A, more)
    assert len(loaded) == 4 and np.array_equal(data, more_payload)
    check(plane)


def test_a_store_whose_copy_raises_leaves_its_keys_storable(
    plane: Plane, monkeypatch: pytest.MonkeyPatch
) -> None:
    import cmx.actors.agent.host as agent_module

    agent = plane.agents[NODE_A]
    keys, payload = blocks(2, seed=35)

    def broken(data: object) -> int:
        raise OSError("copy failed")

    with monkeypatch.context() as m:
        m.setattr(agent_module, "checksum", broken)
        with pytest.raises(OSError, match="copy failed"):
            agent.store(keys, [None, keys[0]], payload)
    assert held(plane, NODE_A, Tier.DRAM) == (0, 0)
    assert agent.store(keys, [None, keys[0]], payload) == 2
    check(plane)


def test_pins_a_caller_never_releases_expire_after_the_lease_time(plane: Plane) -> None:
    agent = plane.agents[NODE_A]
    keys, payload = blocks(3, seed=36)
    agent.store(keys, [None, *keys[:-1]], payload)
    result = agent.load(keys, plane.lookup(keys), owner="client:gone")
    assert len(result.blocks) == 3 and held(plane, NODE_A, Tier.HBM)[0] == 3
    plane.clock.advance(LEASE_S - 1)
    plane.tiers[(NODE_A, Tier.HBM)].heartbeat()
    assert held(plane, NODE_A, Tier.HBM)[0] == 3  # still within the lease
    plane.clock.advance(1)
    plane.tiers[(NODE_A, Tier.HBM)].heartbeat()
    assert held(plane, NODE_A, Tier.HBM) == (0, 0)
    assert plane.tiers[(NODE_A, Tier.HBM)].stats().leases.expired == 3
    agent.release([b.lease for b in result.blocks])  # late: changes nothing
    check(plane)


def test_a_load_its_caller_gave_up_on_gives_its_pins_back(plane: Plane) -> None:
    agent = plane.agents[NODE_A]
    keys, payload = blocks(3, seed=37)
    agent.store(keys, [None, *keys[:-1]], payload)
    load(plane, NODE_A, keys[:1])  # one HBM hit, pinned at once by the next load
    # The caller's wait ran out while the load ran: its give_up arrives before the answer.
    agent.give_up("client:late")
    result = agent.load(keys, plane.lookup(keys), owner="client:late")
    assert result.blocks == []
    assert held(plane, NODE_A, Tier.HBM) == (0, 0)
    # ...or after it: what the finished load pinned is given back then.
    result = agent.load(keys, plane.lookup(keys), owner="client:later")
    assert len(result.blocks) == 3
    assert agent.give_up("client:later") == 3
    assert held(plane, NODE_A, Tier.HBM) == (0, 0)
    check(plane)


def test_a_peer_that_dies_between_stage_and_unstage_leaks_nothing(plane: Plane) -> None:
    keys, payload = blocks(6, seed=38)
    plane.agents[NODE_B].store(keys, [None, *keys[:-1]], payload)
    staged = plane.agents[NODE_B].stage(keys, plane.agents[NODE_A].owner)
    assert all(s is not None for s in staged)
    assert held(plane, NODE_B, Tier.DRAM)[0] == 6
    # node-a's agent dies here: it never unstages.
    plane.clock.advance(LEASE_S)
    plane.tiers[(NODE_B, Tier.DRAM)].heartbeat()
    assert held(plane, NODE_B, Tier.DRAM) == (0, 0)
    data, loaded = load(plane, NODE_A, keys[:3])
    assert np.array_equal(data, payload[: 3 * BLOCK])
    check(plane)


def test_a_transfer_failing_after_the_peer_staged_leaks_nothing(
    plane: Plane, monkeypatch: pytest.MonkeyPatch
) -> None:
    from cmx.actors.transport.base import TransferError

    keys, payload = blocks(3, seed=39)
    plane.agents[NODE_B].store(keys, [None, *keys[:-1]], payload)
    agent = plane.agents[NODE_A]

    def broken(*args: object, **kwargs: object) -> None:
        raise TransferError("peer went away mid-transfer")

    monkeypatch.setattr(agent.transport, "read", broken)
    data, loaded = load(plane, NODE_A, keys)
    assert loaded == []
    assert held(plane, NODE_A, Tier.HBM) == (0, 0)
    assert held(plane, NODE_B, Tier.DRAM) == (0, 0)
    check(plane)


def test_a_pool_node_whose_read_fails_leaks_nothing(
    plane: Plane, monkeypatch: pytest.MonkeyPatch
) -> None:
    cfg = plane.config
    pool = PoolNodeService("pool-1", "p1", f"{cfg.nvme_dir}/pool-p1", 64 * BLOCK, BLOCK,
                           4 * BLOCK, plane.link, cfg.directory_shards, cfg.transport,
                           segment_bytes=cfg.nvme_segment_bytes, lease_s=cfg.lease_s,
                           clock=plane.clock)
    try:
        keys, payload = blocks(3, seed=40)
        plane.agents[NODE_A].store(keys, [None, *keys[:-1]], payload)
        source = plane.agents[NODE_A]
        pins = plane.tiers[(NODE_A, Tier.DRAM)].pin(keys, source.owner)
        from cmx.protocol import Offer

        region = source.tiers.current(Tier.DRAM)[0].arena
        plane.link._targets[actor_name("agent", NODE_A)] = source  # type: ignore[attr-defined]
        offers = [Offer(p.key, None, region, p.slot, p.size, p.checksum) for p in pins]
        assert pool.ingest(actor_name("agent", NODE_A), offers) == 3
        plane.tiers[(NODE_A, Tier.DRAM)].unpin([p.lease for p in pins])
        pool.drop_staging()  # a cold read: every block comes off the pool's disk

        def broken(*args: object) -> None:
            raise OSError("read failed")

        with monkeypatch.context() as m:
            m.setattr(pool.io, "read_many", broken)
            assert pool.stage(keys, "agent:reader") == [None, None, None]
        stats = pool.stats()
        assert (stats.pinned, stats.reserved) == (0, 0)
        staged = pool.stage(keys, "agent:reader")  # the disk is back: the blocks are too
        assert all(s is not None for s in staged)
        plane.clock.advance(LEASE_S)  # the reader died without unstaging
        pool.heartbeat()
        assert (pool.stats().pinned, pool.stats().leases.expired) == (0, 3)
        pool.check_integrity()
    finally:
        pool.close()


def test_a_load_without_its_hbm_tier_fails_and_holds_nothing(plane: Plane) -> None:
    keys, payload = blocks(2, seed=41)
    plane.agents[NODE_A].store(keys, [None, keys[0]], payload)
    with _Down(plane, NODE_A, "hbm"), pytest.raises(UnavailableError):
        plane.agents[NODE_A].load(keys, plane.lookup(keys))
    assert held(plane, NODE_A, Tier.DRAM) == (0, 0)


def test_a_release_that_reaches_a_closed_tier_is_quiet(plane: Plane) -> None:
    """A client's one-way release can reach a tier that is being stopped (``shutdown``): its
    store is closed, nothing stays pinned, and the release must not raise (Ray logs an unhandled
    error for every such call)."""
    keys, payload = blocks(2, seed=37)
    agent = plane.agents[NODE_A]
    agent.store(keys, [None, keys[0]], payload)
    result = agent.load(keys, plane.lookup(keys))
    assert len(result.blocks) == 2
    plane.tiers[(NODE_A, Tier.HBM)].close()
    agent.release([b.lease for b in result.blocks])  # raised StoreClosedError
