"""The service's NVMe data path keeps many I/Os in flight: loads, promotions for a peer,
write-through stores and pool stages each hand the disk a whole list of extents at once.

The count is of reads and writes submitted to ``ExtentIo`` and not yet waited for, seen by
an instrumented subclass: a path that reads one block per worker never passes the number of
agent workers (4), however fast the disk is."""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence

import numpy as np
import pytest
from plane import NODE_A, NODE_B, Plane, make_plane
from scenarios import BLOCK, blocks, check, load, small_config

from cmx.actors.pool.node import PoolNodeService
from cmx.links import actor_name
from cmx.protocol import Offer
from cmx.storage.nvme.dataplane import ExtentPlane
from cmx.storage.nvme.engines import make_io_engine
from cmx.storage.nvme.extentio import ExtentIo
from cmx.storage.nvme.io import IoBatch, IoRequest
from cmx.tiers import Tier

N = 24  # blocks of a prefix: more than the agent's workers and the engine's queue depth


class _Counted(IoBatch):
    def __init__(self, batch: IoBatch, io: CountingIo, op: str) -> None:
        self._batch, self._io, self._op, self._open = batch, io, op, True

    def wait_started(self) -> None:
        self._batch.wait_started()

    def wait(self) -> None:
        try:
            self._batch.wait()
        finally:
            if self._open:
                self._open = False
                self._io.done(self._op)


class CountingIo(ExtentIo):
    """ExtentIo that counts submitted reads and writes not yet waited for, and the most."""

    def __init__(self) -> None:
        super().__init__(make_io_engine("threads"), 1 << 20)
        self._lock = threading.Lock()
        self.now = {"read": 0, "write": 0}
        self.most = {"read": 0, "write": 0}

    def _start(self, op: str, batch: IoBatch) -> IoBatch:
        with self._lock:
            self.now[op] += 1
            self.most[op] = max(self.most[op], self.now[op])
        return _Counted(batch, self, op)

    def done(self, op: str) -> None:
        with self._lock:
            self.now[op] -= 1

    def submit_read(self, requests: list[IoRequest]) -> IoBatch:
        return self._start("read", super().submit_read(requests))

    def submit_write(self, requests: list[IoRequest]) -> IoBatch:
        return self._start("write", super().submit_write(requests))


def counting(owner: object) -> CountingIo:
    """Give ``owner`` (an agent or a pool node) a data plane over a CountingIo."""
    io = CountingIo()
    if hasattr(owner, "host"):  # an agent: its host's bytes
        owner = owner.host
    old: ExtentPlane = owner.nvme if hasattr(owner, "nvme") else owner.io  # type: ignore[attr-defined]
    old.close()
    plane = ExtentPlane(io=io)
    if hasattr(owner, "nvme"):
        owner.nvme = plane  # type: ignore[attr-defined]
    else:
        owner.io = plane  # type: ignore[attr-defined]
    return io


@pytest.fixture
def plane(tmp_path) -> Iterator[Plane]:
    p = make_plane(small_config(tmp_path, hbm_bytes=2 * N * BLOCK, dram_bytes=2 * N * BLOCK,
                                nvme_segment_bytes=64 * BLOCK, placement="write_through"))
    yield p
    p.close()


def only_on_nvme(plane: Plane, node: str, keys: Sequence[bytes]) -> None:
    for tier in (Tier.HBM, Tier.DRAM):
        plane.tiers[(node, tier)].evict(list(keys))
    assert all({c.tier for c in cs} == {Tier.NVME} for cs in plane.lookup(list(keys)))


def test_a_write_through_store_writes_its_blocks_in_parallel(plane: Plane) -> None:
    io = counting(plane.agents[NODE_A])
    keys, payload = blocks(N, seed=1)
    assert plane.agents[NODE_A].store(keys, [None, *keys[:-1]], payload) == N
    assert io.most["write"] == N  # every block of the window in flight at once
    assert all(Tier.NVME in {c.tier for c in cs} for cs in plane.lookup(keys))
    check(plane)


def test_a_load_from_local_nvme_reads_its_blocks_in_parallel(plane: Plane) -> None:
    keys, payload = blocks(N, seed=2)
    plane.agents[NODE_A].store(keys, [None, *keys[:-1]], payload)
    only_on_nvme(plane, NODE_A, keys)
    io = counting(plane.agents[NODE_A])
    data, got = load(plane, NODE_A, keys)
    assert np.array_equal(data, payload)
    assert {b.source_tier for b in got} == {Tier.NVME}
    assert io.most["read"] >= 16
    check(plane)


def test_a_peers_nvme_blocks_are_promoted_in_parallel(plane: Plane) -> None:
    keys, payload = blocks(N, seed=3)
    plane.agents[NODE_A].store(keys, [None, *keys[:-1]], payload)
    only_on_nvme(plane, NODE_A, keys)
    io = counting(plane.agents[NODE_A])
    data, got = load(plane, NODE_B, keys)
    assert np.array_equal(data, payload)
    assert {b.source_node for b in got} == {NODE_A}
    assert io.most["read"] >= 16
    assert plane.agents[NODE_A].counters.moved["nvme->dram"] == N * BLOCK
    check(plane)


def test_a_pool_node_stages_cold_blocks_in_parallel(plane: Plane) -> None:
    cfg = plane.config
    pool = PoolNodeService("pool-1", "p1", f"{cfg.nvme_dir}/pool-p1", 4 * N * BLOCK, BLOCK,
                           2 * N * BLOCK, plane.link, cfg.directory_shards, cfg.transport,
                           segment_bytes=cfg.nvme_segment_bytes, lease_s=cfg.lease_s,
                           clock=plane.clock)
    try:
        io = counting(pool)
        keys, payload = blocks(N, seed=4)
        source = plane.agents[NODE_A]
        source.store(keys, [None, *keys[:-1]], payload)
        dram = plane.tiers[(NODE_A, Tier.DRAM)]
        pins = dram.pin(keys, source.owner)
        region = source.tiers.current(Tier.DRAM)[0].arena
        offers = [Offer(p.key, None, region, p.slot, p.size, p.checksum) for p in pins]
        assert pool.ingest(actor_name("agent", NODE_A), offers) == N
        dram.unpin([p.lease for p in pins])
        assert io.most["write"] == N
        pool.drop_staging()  # a cold read: every block comes off the pool's disk
        staged = pool.stage(keys, "agent:reader")
        assert all(s is not None for s in staged)
        assert io.most["read"] >= 16
        arena = pool.staging.arena
        got = np.concatenate([arena.slot_view(s.slot)[: s.size] for s in staged if s])
        assert np.array_equal(got, payload)
        pool.unstage([s for s in staged if s])
        pool.check_integrity()
    finally:
        pool.close()


def test_compaction_is_decided_by_the_tier_and_its_bytes_moved_by_the_agent(tmp_path) -> None:
    p = make_plane(small_config(tmp_path, hbm_bytes=16 * BLOCK, dram_bytes=32 * BLOCK,
                                nvme_bytes=64 * BLOCK, nvme_segment_bytes=16 * BLOCK,
                                placement="write_through"))
    try:
        agent, nvme = p.agents[NODE_A], p.tiers[(NODE_A, Tier.NVME)]
        keys, payload = blocks(80, seed=5)
        agent.store(keys[:64], [None, *keys[:63]], payload[: 64 * BLOCK])
        assert nvme.evict(keys[0:48:2]) == 24  # a third of the log is dead: compaction's turn
        agent.store(keys[64:], keys[63:79], payload[64 * BLOCK :])
        extra = nvme.store.stats().extra
        assert extra["compactions"] >= 1 and extra["compacted_bytes"] > 0
        assert agent.counters.moved["nvme->nvme"] == extra["compacted_bytes"]
        engine = nvme.store.io.engine  # the tier's own engine never moved a byte
        assert engine.io_sizes("read") == {} and engine.io_sizes("write") == {}
        survivors = [i for i in range(80) if keys[i] in nvme.store]
        assert set(range(1, 48, 2)) <= set(survivors)  # compaction kept every live block
        only_on_nvme(p, NODE_A, [keys[i] for i in survivors])
        for i in survivors:
            data, got = load(p, NODE_A, [keys[i]])
            assert np.array_equal(data, payload[i * BLOCK : (i + 1) * BLOCK])
            assert got[0].source_tier is Tier.NVME
        check(p)
    finally:
        p.close()
