"""The pool at every crash point of its ingests and of a rebalance's moves.

An agent stores blocks to the pool (each owner's ``ingest``: pull into staging, verify, write
the extent, commit, flush, publish), replication is raised (each node's ``rebalance`` pushes its
blocks to the owners that lack them: the owner ingests the copy) and then lowered while a member
leaves (each node pushes what it no longer owns to the owners, asks them to confirm a copy of
the same checksum, and only then drops its own, durably). Every pool node's file calls go to
one log (``pool_crash``). Then, for every prefix of that log and each way a crash could leave
the files (everything written, only what was synced, the first unsynced write torn), every pool
node is started again over them, heartbeats its new epoch to the directory (which still lists
what it was told before the crash) and:

- every block the pool held when a step returned is still held by some node (a move never
  loses the last copy); no node holds a block never stored;
- every copy held reads back through the node's staging with its checksum verified and its
  exact bytes, none quarantined; ``check_integrity()`` holds on every node (an extent written
  and never committed is free space again, not a leak) and on the directory;
- the directory lists exactly the copies the nodes hold;
- a rebalance under the last view, run again over the restarted pool, finishes the move: each
  block on its owners alone, its bytes exact.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Mapping
from contextlib import ExitStack
from dataclasses import dataclass, field

import numpy as np
from plane import RUN, Plane, make_plane
from pool_crash import crash_pool, recorded_pools, restart_pools
from scenarios import BLOCK, blocks, small_config
from service_crash import ServiceFiles, crash_images
from tagging import NS, PoolMembers

from cmx.actors.pool.node import PoolNodeService
from cmx.keys import BlockHash
from cmx.policies.rendezvous import owners
from cmx.tiers import Tier

MEMBERS = ["pool-1", "pool-2", "pool-3"]
STAYING = MEMBERS[:2]  # pool-3 leaves in the last step
WRITER = f"pcrash-w-{RUN}"  # apart from other runs' and files' arenas
N = 8
READER = "client:replay"
# The images are many, each synced as it is opened and closed: in memory where there is some.
IMAGES = "/dev/shm" if os.path.isdir("/dev/shm") else None


@dataclass
class Ack:
    at: int  # the log's length when the step returned
    held: frozenset[bytes]  # every block some pool node held then


@dataclass
class Run:
    keys: list[BlockHash]
    payload: np.ndarray
    files: ServiceFiles
    acks: list[Ack] = field(default_factory=list)

    def data_of(self, key: bytes) -> np.ndarray:
        i = self.keys.index(BlockHash(key))
        return self.payload[i * BLOCK : (i + 1) * BLOCK]


def holders(pools: Mapping[str, PoolNodeService]) -> dict[bytes, set[str]]:
    out: dict[bytes, set[str]] = {}
    for name, pool in pools.items():
        for key in pool.store.keys():
            out.setdefault(bytes(key), set()).add(name)
    return out


def workload(plane: Plane, pools: Mapping[str, PoolNodeService], files: ServiceFiles) -> Run:
    keys, payload = blocks(N, seed=83)
    run = Run(keys, payload, files)
    parents = [None, *keys[:-1]]
    agent = plane.agents[WRITER]

    def ack() -> None:
        run.acks.append(Ack(len(files.log), frozenset(holders(pools))))

    half = N // 2
    for part in (slice(0, half), slice(half, N)):
        stored = agent.store(keys[part], parents[part], payload[part.start * BLOCK :
                                                              part.stop * BLOCK], NS, replicas=1)
        assert stored == part.stop - part.start
        ack()
    for name in MEMBERS:  # pool-3 leaves: each of its blocks moves to its owner
        moved = pools[name].rebalance(STAYING, 1, generation=1)
        assert moved.pushed == moved.dropped == (4 if name == "pool-3" else 0), moved
        ack()
    for name in STAYING:  # replication raised: each block to its second owner
        copied = pools[name].rebalance(STAYING, 2, generation=2)
        assert copied.pushed > 0 and copied.dropped == 0, copied
        ack()
    return run


def read_back(pool: PoolNodeService, run: Run, where: str) -> None:
    """Stage every block ``pool`` holds (read from its disk, checksum verified): each must
    come with exactly its bytes."""
    keys = sorted(pool.store.keys())
    pool.drop_staging()
    staged = pool.stage(keys, READER)
    try:
        missing = [k.hex()[:12] for k, s in zip(keys, staged) if s is None]
        assert not missing, f"{where}: {pool.node} lists {missing} but cannot stage them"
        for s in staged:
            assert s is not None
            got = pool.staging.arena.slot_view(s.slot)[: s.size]
            assert np.array_equal(got, run.data_of(s.key)), \
                f"{where}: {pool.node} served {s.key.hex()[:12]} with other bytes"
    finally:
        pool.unstage([s for s in staged if s is not None])
    assert pool.store.stats().quarantined == 0, f"{where}: {pool.node} quarantined blocks"


def listed(plane: Plane, keys: list[BlockHash]) -> dict[bytes, set[str]]:
    out: dict[bytes, set[str]] = {}
    for key, copies in zip(keys, plane.lookup(keys)):
        nodes = {c.node for c in copies if c.tier is Tier.POOL}
        if nodes:
            out[bytes(key)] = nodes
    return out


def check(plane: Plane, root: str, run: Run, upto: int, where: str) -> None:
    pools = restart_pools(plane, root, MEMBERS)
    try:
        held = holders(pools)
        assert set(held) <= {bytes(k) for k in run.keys}, f"{where}: blocks never stored"
        acked = [a for a in run.acks if a.at <= upto]
        if acked:
            lost = acked[-1].held - set(held)
            assert not lost, f"{where}: {len(lost)} blocks the pool held are lost"
        for pool in pools.values():
            pool.check_integrity()
            read_back(pool, run, where)
            assert pool.heartbeat(), f"{where}: {pool.node} could not resync the directory"
        assert listed(plane, run.keys) == held, f"{where}: the directory lists other copies"
        for shard in plane.shards:
            shard.check_integrity()
        for name in MEMBERS:  # the last view's rebalance, run again: the moves are finished
            pools[name].rebalance(STAYING, 2, generation=3)
        done = holders(pools)
        assert set(done) == set(held), f"{where}, rebalanced again: blocks lost"
        for key, nodes in done.items():
            assert nodes == set(owners(BlockHash(key), STAYING, 2)), \
                f"{where}, rebalanced again: {key.hex()[:12]} on {sorted(nodes)}"
        for pool in pools.values():
            pool.check_integrity()
            read_back(pool, run, where + ", rebalanced again")
    finally:
        for pool in pools.values():
            pool.close()


def test_every_crash_point_of_ingests_and_moves_keeps_every_block_the_pool_held(tmp_path):
    cfg = small_config(tmp_path, pool_admission_min_count=1, directory_shards=1,
                       transport="ray")
    with ExitStack() as stack:
        plane = make_plane(cfg, (WRITER,))
        stack.callback(plane.close)
        plane.link._targets["cmx:controller"] = PoolMembers(MEMBERS)  # type: ignore[attr-defined]
        pools, files = recorded_pools(plane, MEMBERS)
        run = workload(plane, pools, files)
        assert holders(pools) == {bytes(k): set(STAYING) for k in run.keys}
        for pool in pools.values():
            crash_pool(pool)
        images = stack.enter_context(tempfile.TemporaryDirectory(prefix="cmx-pool-crash-",
                                                                  dir=IMAGES))
        n = 0
        for upto, mode, write in crash_images(files.log):
            into = os.path.join(images, f"crash-{upto}-{mode}")
            for name in MEMBERS:  # the log names each node's files under its store's folder
                os.makedirs(os.path.join(into, f"pool-{name}"))
            write(into)
            check(plane, into, run, upto, f"after {upto} of {len(files.log)} calls, {mode}")
            shutil.rmtree(into)
            n += 1
        assert n > len(files.log)
