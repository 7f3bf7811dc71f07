"""Crash consistency, tested as file systems and databases test it.

A workload (puts alone and in batches, deletes, flushes, evictions, compaction, snapshots,
segment roll-over) runs on a store whose file layer records every write and sync
(``crash_plane.PlaneFiles``). Then, for every prefix of that log and for each way a power
loss could leave the files (everything written, only what was synced, the first unsynced
write torn; and what was synced, with the index snapshot lost), the files are rebuilt in a
fresh directory and the store reopened, and:

- it opens, and ``check_integrity()`` passes;
- every block of the last acknowledged flush is there with its exact bytes, unless it was
  removed (deleted, evicted) before the crash point;
- every block whose deletion a flush acknowledged is gone;
- every block present reads back exactly the bytes that were put under its key.

Then every write and every sync of journal, segments, record logs and snapshot is failed in
turn (ENOSPC and EIO; a failed write lands half its bytes first): the failing call raises
``StoreIOError`` with that errno, the workload goes on, and nothing acknowledged is lost
after a crash at the end, or right after the first flush acknowledged after the fault.

The default sweep is bounded for CI: one workload, and each call fails with its likelier
errno (writes ENOSPC, syncs and the rest EIO). ``CMX_CRASH_SWEEP=full`` runs more and longer
workloads and fails every call with both.
"""

from __future__ import annotations

import errno
import os
import random
from dataclasses import dataclass, field

import numpy as np
import pytest
from crash_plane import PlaneFiles, crash_image, crash_images
from nvme_helpers import KiB, aligned_payload, key, payload

from cmx.storage.base import EventKind
from cmx.storage.nvme import NvmeStore
from cmx.storage.nvme.errors import StoreIOError

BLOCK = 16 * KiB
STORE = dict(capacity_bytes=8 * BLOCK, block_bytes=BLOCK, segment_bytes=2 * BLOCK,
             compact_threshold_bytes=BLOCK, io_engine="threads", queue_depth=2,
             io_bytes=8 * KiB, snapshot_every=10, staging_bytes=8 * KiB)
# The fault sweep fills a smaller store sooner: eviction, compaction and snapshots within
# its fewer steps.
FAULTY = {**STORE, "capacity_bytes": 5 * BLOCK, "snapshot_every": 8}
FLUSHY = (0.35, 0.5, 0.6)  # the fault sweep flushes often: failures between acknowledgements
FULL = os.environ.get("CMX_CRASH_SWEEP") == "full"
SEEDS = range(8) if FULL else range(1)
STEPS = 60 if FULL else 18  # of the crash-point sweep
FAULT_STEPS = 40 if FULL else 16  # of the fault sweep


def size_of(k: bytes) -> int:
    """Half the blocks are whole pages, which put_many writes straight from their buffers."""
    n = 1 + int.from_bytes(k[8:12], "little") % BLOCK
    return n if k[1] & 1 else max(4096, n // 4096 * 4096)


def data_of(k: bytes) -> np.ndarray:
    return payload(k, size_of(k))


@dataclass
class Ack:
    at: int  # log length when flush() returned
    held: frozenset[bytes]  # every block durable by then
    deleted: frozenset[bytes]  # blocks whose deletion this flush made durable


@dataclass
class Run:
    files: PlaneFiles
    acks: list[Ack] = field(default_factory=list)
    removed: list[tuple[int, bytes]] = field(default_factory=list)  # (log length, key)
    put: set[bytes] = field(default_factory=set)
    errors: list[StoreIOError] = field(default_factory=list)


def workload(root, files: PlaneFiles, seed: int, steps: int = STEPS,
             opts: dict | None = None, mix: tuple[float, float, float] = (0.45, 0.65, 0.75)
             ) -> tuple[Run, NvmeStore]:
    """Run the workload; StoreIOErrors are collected and the work goes on. ``mix``: the
    cumulative chances of a put, a batch of puts and a delete; the rest are flushes."""
    run = Run(files)
    rng = random.Random(seed)
    while True:
        try:
            store = NvmeStore(root, files=files, **(opts or STORE))  # type: ignore[arg-type]
            break
        except StoreIOError as exc:  # a fault while opening: open again
            run.errors.append(exc)
    store.subscribe(lambda e: e.kind is EventKind.REMOVED
                    and run.removed.append((len(files.log), bytes(e.key))))
    deleted: set[bytes] = set()
    unflushed_deletes: set[bytes] = set()
    i = 0
    for _ in range(steps):
        try:
            roll = rng.random()
            if roll < mix[0]:
                k = key(i, b"plane")
                i += 1
                run.put.add(k)
                data = aligned_payload(k, size_of(k)) if k[0] & 1 else data_of(k)
                store.put(k, data)
            elif roll < mix[1]:
                ks = [key(i + j, b"plane") for j in range(3)]
                i += 3
                run.put.update(ks)
                store.put_many([(k, aligned_payload(k, size_of(k)), None) for k in ks])
            elif roll < mix[2] and len(store):
                k = rng.choice(sorted(store.keys()))
                if store.delete(k):
                    unflushed_deletes.add(k)
            else:
                store.flush()
                deleted |= unflushed_deletes
                unflushed_deletes = set()
                run.acks.append(Ack(len(files.log), frozenset(store.keys()),
                                    frozenset(deleted)))
        except StoreIOError as exc:
            run.errors.append(exc)
    return run, store


def crash(store: NvmeStore) -> None:
    store._teardown()


def check(root, run: Run, upto: int, where: str, opts: dict | None = None) -> None:
    store = NvmeStore(root, **(opts or STORE))  # type: ignore[arg-type]
    try:
        acked = [a for a in run.acks if a.at <= upto]
        present = set(store.keys())
        assert present <= run.put, f"{where}: keys never put are present"
        if acked:
            last = acked[-1]
            gone = {k for at, k in run.removed if at <= upto}
            lost = last.held - gone - present
            assert not lost, f"{where}: {len(lost)} acknowledged blocks lost"
            back = last.deleted & present
            assert not back, f"{where}: {len(back)} blocks deleted by a flush came back"
        for k in present:
            got = store.get(k)
            assert got is not None, f"{where}: block {k.hex()[:12]} unreadable"
            np.testing.assert_array_equal(got, data_of(k), err_msg=where)
        assert store.stats().quarantined == 0, f"{where}: blocks quarantined"
        store.check_integrity()
    finally:
        crash(store)


@pytest.mark.parametrize("seed", SEEDS)
def test_every_crash_point_keeps_every_acknowledged_flush(tmp_path, seed):
    files = PlaneFiles(tmp_path / "live")
    run, store = workload(tmp_path / "live", files, seed)
    stats = store.stats()
    crash(store)
    log = files.log
    assert not run.errors
    assert len(run.acks) >= 5 and stats.evictions and stats.extra["compactions"], \
        "the workload must flush, evict and compact"
    assert any(op.kind == "rename" and op.dst == "index.arrow" for op in log)
    n = 0
    for upto, mode, write in crash_images(log):
        into = tmp_path / f"crash-{upto}-{mode}"
        write(str(into))
        where = f"seed {seed}, after {upto} of {len(log)} calls, {mode}"
        if mode == "synced" and os.path.exists(into / "index.arrow"):
            lost = tmp_path / f"crash-{upto}-{mode}-no-snapshot"  # and with the snapshot lost
            write(str(lost))
            os.unlink(lost / "index.arrow")
            check(lost, run, upto, where + ", snapshot lost")
        check(into, run, upto, where)
        n += 1
    assert n > len(log)  # every prefix, and more than one image of many


def fault_points(tmp_path) -> list[tuple[int, int]]:
    """(call number, errno) of every fault to inject (see the module docstring)."""
    files = PlaneFiles(tmp_path / "count")
    _, store = workload(tmp_path / "count", files, 0, FAULT_STEPS, FAULTY, FLUSHY)
    crash(store)
    if FULL:
        return [(at, code) for at in range(files.calls) for code in (errno.ENOSPC, errno.EIO)]
    return [(at, errno.ENOSPC if kind == "write" else errno.EIO)
            for at, kind in enumerate(files.kinds)]


def test_a_failed_write_or_sync_raises_typed_and_loses_nothing(tmp_path):
    points = fault_points(tmp_path)
    kinds = {code for _, code in points}
    assert len(points) > 60 and kinds == {errno.ENOSPC, errno.EIO}
    for at, code in points:
        root = tmp_path / f"{code}-{at}"
        files = PlaneFiles(root, fail_at=at, fail_errno=code)
        run, store = workload(root, files, 0, FAULT_STEPS, FAULTY, FLUSHY)
        where = f"{os.strerror(code)} at call {at} ({files.failed})"
        assert files.failed, f"{where}: the fault was never reached"
        # A failed truncate of space allocated ahead is logged, not raised: nothing needs it.
        expected = [] if files.failed[0].startswith("truncate seg-") else [code]
        assert [e.errno for e in run.errors] == expected, f"{where}: {run.errors}"
        crash(store)
        check(root, run, len(files.log), where, FAULTY)  # the files as they are
        # A power loss right after the first flush acknowledged after the fault: only what
        # was synced (a failed sync synced nothing).
        after = next((a.at for a in run.acks if a.at > files.failed_at), len(files.log))
        synced = tmp_path / f"{code}-{at}-synced"
        crash_image(files.log, after, "synced", str(synced))
        check(synced, run, after, where + ", synced only, at the next acknowledged flush",
              FAULTY)
