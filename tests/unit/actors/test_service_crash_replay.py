"""The service's NVMe tier at every crash point: its books in the tier, its bytes by the agent.

The service runs the NVMe store split in two (``actors.tiers.nvme``: reserve, commit, the
journal; ``actors.agent.nvme`` over ``ExtentPlane``: the blocks' bytes, compaction's copies).
Blocks are stored the service's way (``NvmeWrites.write``: the tier reserves extents, the agent
writes them, the tier commits and flushes), some are deleted (``NvmeTierService.evict``), and a
small disk makes the tier evict and have the agent compact, with both halves' file calls in one
log (``service_crash.ServiceFiles``). Then, for every prefix of that log and each way a power
loss could leave the files (everything written, only what was synced, the first unsynced write
torn), the files are rebuilt in a fresh directory and a new tier is started over them. Where
everything was written, the tier's process may have died alone: the agent runs on, holding its
descriptors of the segments it wrote; after a power loss it starts afresh. Then:

- every block whose store was acknowledged (``write`` returned, the commit done) and not
  removed before the crash point is there, and reads back through the agent's data plane with
  its checksums verified and its exact bytes;
- every block whose deletion was acknowledged stays deleted;
- every block there at all reads back exactly the bytes stored under its key (nothing torn,
  nothing unacknowledged served wrong), and ``check_integrity()`` holds;
- the tier, killed again before it stored anything and restarted, finds the same blocks; the
  agent stores one more through it, and everything reads back, through the agent's descriptors
  and as a restarted agent would read the disk.
"""

from __future__ import annotations

import hashlib
import os
import random
import shutil
from collections.abc import Iterable
from dataclasses import dataclass, field

import numpy as np
from plane import Plane, make_plane
from service_crash import (
    NODE,
    ServiceFiles,
    crash,
    crash_images,
    live_tier,
    recorded_plane,
    restart_nvme,
    surviving_plane,
    written_segments,
)

from cmx.actors.tiers.nvme import NvmeTierService
from cmx.buffers import aligned_empty
from cmx.config import ServiceConfig
from cmx.keys import BlockHash
from cmx.storage.base import EventKind
from cmx.storage.nvme.dataplane import ExtentPlane
from cmx.tiers import Tier

KiB = 1024
BLOCK = 16 * KiB
STEPS = 18  # of the workload: 140 file calls, 237 images
SEED = 0
OWNER = "agent:reader"


def key(i: int, salt: bytes = b"service") -> BlockHash:
    return BlockHash(hashlib.blake2b(salt + i.to_bytes(8, "little"), digest_size=32).digest())


def size_of(k: bytes) -> int:
    """Half the blocks are whole pages (written straight from their buffers), half end
    mid-page (their tails through the data plane's staging buffer)."""
    n = 1 + int.from_bytes(k[8:12], "little") % BLOCK
    return max(4096, n // 4096 * 4096) if k[1] & 1 else n


def data_of(k: bytes) -> np.ndarray:
    """The bytes stored under ``k``: derived from the key alone, in a page-aligned buffer."""
    rng = np.random.default_rng(int.from_bytes(k[:8], "little"))
    buf = aligned_empty(size_of(k))
    buf[:] = rng.integers(0, 256, buf.nbytes, dtype=np.uint8)
    return buf


@dataclass
class Ack:
    at: int  # the log's length when the store or deletion returned
    held: frozenset[bytes]  # every block the tier held then (all durable)
    deleted: frozenset[bytes]  # every block removed by then (each removal durable)


@dataclass
class Run:
    files: ServiceFiles
    acks: list[Ack] = field(default_factory=list)
    removed: list[tuple[int, bytes]] = field(default_factory=list)  # (log length, key)
    put: set[bytes] = field(default_factory=set)


def config(root: str) -> ServiceConfig:
    """A disk of 8 blocks in segments of 3: the tier evicts and compacts within a few steps."""
    return ServiceConfig(block_bytes=BLOCK, hbm_bytes=4 * BLOCK, dram_bytes=4 * BLOCK,
                         nvme_bytes=8 * BLOCK, nvme_dir=root, nvme_segment_bytes=3 * BLOCK,
                         directory_shards=1, transport="ray", lease_s=30.0)


def store(plane: Plane, keys: list[BlockHash]) -> None:
    """The service's NVMe write: reserve in the tier, the agent writes, the tier commits."""
    changed = plane.agents[NODE].nvme_writes.write(
        Tier.DRAM, [(k, size_of(k), None) for k in keys], {}, {},
        sources=[data_of(k) for k in keys])
    assert not changed


def workload(plane: Plane, files: ServiceFiles, seed: int) -> Run:
    run = Run(files)
    tier = live_tier(plane)
    tier.store.subscribe(lambda e: e.kind is EventKind.REMOVED
                         and run.removed.append((len(files.log), bytes(e.key))))
    rng = random.Random(seed)
    i = 0
    for _ in range(STEPS):
        present = sorted(tier.store.keys())
        if rng.random() < 0.7 or not present:
            keys = [key(i + j) for j in range(rng.randint(1, 3))]
            i += len(keys)
            run.put.update(keys)
            store(plane, keys)
            done = any(k in tier.store for k in keys)
        else:
            done = tier.evict([rng.choice(present)]) > 0
        if done:  # the call flushed: everything before it is durable
            run.acks.append(Ack(len(files.log), frozenset(tier.store.keys()),
                                frozenset(k for _, k in run.removed)))
    return run


def read_back(tier: NvmeTierService, nvme: ExtentPlane, keys: Iterable[bytes], where: str
              ) -> None:
    """Pin ``keys`` in the tier, read them with the data plane ``nvme`` (checksums verified),
    unpin: each must check out with exactly its bytes."""
    keys = sorted(keys)
    extents = tier.pin(keys, OWNER)
    try:
        missing = [k.hex()[:12] for k, e in zip(keys, extents) if e is None]
        assert not missing, f"{where}: blocks {missing} listed but not pinned"
        dsts = [aligned_empty(BLOCK) for _ in extents]
        ok = nvme.read_many(extents, dsts)
    finally:
        tier.unpin([e.lease for e in extents if e is not None])
    bad = [k.hex()[:12] for k, good in zip(keys, ok) if not good]
    assert not bad, f"{where}: blocks {bad} failed their checksums"
    for k, e, dst in zip(keys, extents, dsts):
        assert e is not None and e.size == size_of(k), f"{where}: block {k.hex()[:12]} resized"
        np.testing.assert_array_equal(dst[: e.size], data_of(k), err_msg=where)


def check(plane: Plane, root: str, run: Run, upto: int, mode: str, where: str) -> None:
    host = plane.agents[NODE].host
    # In "all" the tier's process may have died alone: the agent runs on, its descriptors of
    # the segments it wrote still open. After a power loss it starts afresh.
    host.nvme = (surviving_plane(root, written_segments(run.files.log, upto)) if mode == "all"
                 else ExtentPlane(engine="threads", queue_depth=4))
    disk = ExtentPlane(engine="threads", queue_depth=4)  # what a restarted agent would read
    try:
        with restart_nvme(plane, root) as tier:
            present = set(tier.store.keys())
            assert present <= run.put, f"{where}: keys never stored are present"
            acked = [a for a in run.acks if a.at <= upto]
            if acked:
                last = acked[-1]
                gone = {k for at, k in run.removed if at <= upto}
                lost = last.held - gone - present
                assert not lost, f"{where}: {len(lost)} acknowledged blocks lost"
                back = last.deleted & present
                assert not back, f"{where}: {len(back)} acknowledged deletions undone"
            assert tier.store.stats().quarantined == 0, f"{where}: blocks quarantined"
            read_back(tier, host.nvme, present, where)
            tier.check_integrity()
        where += ", restarted again before it stored anything"
        with restart_nvme(plane, root) as tier:
            assert set(tier.store.keys()) == present, f"{where}: other blocks"
            after = key(0, b"after the crash")
            store(plane, [after])
            assert after in tier.store, f"{where}: the restarted tier stored nothing"
            read_back(tier, host.nvme, present | {after}, where + ", then one more stored")
            read_back(tier, disk, present | {after}, where + ", then one more stored, read "
                      "as a restarted agent would")
            tier.check_integrity()
    finally:
        host.nvme.close()
        disk.close()


def test_every_crash_point_of_the_split_tier_keeps_every_acknowledged_block(tmp_path):
    plane, files = recorded_plane(config(os.path.join(tmp_path, "live")), io_bytes=8 * KiB,
                                  staging_bytes=8 * KiB)
    try:
        run = workload(plane, files, SEED)
        tier = live_tier(plane)
        stats = tier.store.stats()
        crash(tier)
        plane.agents[NODE].host.nvme.close()  # each image gets its own (see check)
        log = files.log
        assert len(run.acks) >= 8 and stats.evictions and stats.extra["compactions"], \
            "the workload must store, delete, evict and compact"
        assert plane.agents[NODE].counters.moved["nvme->nvme"], "the agent moved no copies"
        n = 0
        for upto, mode, write in crash_images(log):
            into = os.path.join(tmp_path, f"crash-{upto}-{mode}")
            write(into)
            check(plane, into, run, upto, mode, f"after {upto} of {len(log)} calls, {mode}")
            shutil.rmtree(into)
            n += 1
        assert n > len(log)
    finally:
        plane.close()


def test_an_agent_that_outlives_its_tier_writes_into_the_segment_on_disk(tmp_path):
    """Books restarted over the directory never make a deleted segment's name again (ids are
    never reused, ``cmx.storage.nvme.segments``): the agent's write granted by the dead tier
    cannot land in a new file of that name, and a block stored since reads back right, through
    the agent's descriptors and a restarted agent's. (Were a name made anew, the agent would
    let its descriptor of the deleted file go: ``ExtentPlane._open``.)"""
    cfg = config(str(tmp_path))
    plane = make_plane(cfg, nodes=(NODE,))
    try:
        agent, first = plane.agents[NODE], live_tier(plane)
        old, new = key(1), key(2)
        ext = first.reserve([(old, None, size_of(old))], agent.owner)[0]
        assert ext is not None
        agent.host.write_extents([ext], [data_of(old)])  # the agent opens the new segment
        crash(first)  # killed before the commit: the next tier deletes the segment
        root = os.path.join(cfg.nvme_dir, NODE)
        with restart_nvme(plane, root):
            assert not os.path.exists(ext.path)
        with restart_nvme(plane, root) as tier:  # the first segment's name not made anew
            store(plane, [new])
            pinned = tier.pin([new], OWNER)[0]
            assert pinned is not None and pinned.path != ext.path
            assert not os.path.exists(ext.path)
            tier.unpin([pinned.lease])
            disk = ExtentPlane(engine="threads", queue_depth=4)  # a restarted agent's reads
            try:
                read_back(tier, disk, [new], "read by a restarted agent")
            finally:
                disk.close()
            read_back(tier, agent.host.nvme, [new], "read by the agent")
            tier.check_integrity()
    finally:
        plane.close()
