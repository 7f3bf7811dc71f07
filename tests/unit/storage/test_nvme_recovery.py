"""Reopening after damage: a torn journal append, a lost or damaged snapshot, namespace tags.

Every scenario ends with the exact bytes of every acknowledged block read back and
``check_integrity()``; none of them may cost a segment file.
"""

from __future__ import annotations

import errno
import logging
import os

import numpy as np
import pytest
from nvme_helpers import BLOCK, key, open_store, payload, segment_files

KEEP = dict(capacity_bytes=64 * BLOCK, segment_bytes=BLOCK)
N = 40_000  # payload bytes of block i: N + i


def crash(store) -> None:
    """Drop a store as a killed process would: no flush, no snapshot."""
    store._teardown()


def fill(store, ids, tag: str = "") -> None:
    for i in ids:
        if tag:
            store.put(key(i), payload(key(i), N + i), tag=tag)
        else:
            store.put(key(i), payload(key(i), N + i))


def assert_holds(store, ids) -> None:
    assert sorted(store.keys()) == sorted(key(i) for i in ids)
    for i in ids:
        np.testing.assert_array_equal(store.get(key(i)), payload(key(i), N + i))
    assert store.stats().quarantined == 0
    store.check_integrity()


def _path_of(fd: int) -> str:
    try:
        return os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        return ""


def test_a_torn_journal_append_loses_no_later_flush(tmp_path, monkeypatch):
    """A short journal write, then ENOSPC: the flush fails, later ones are acknowledged and
    must all survive a crash (replay must not stop at the torn bytes)."""
    store = open_store(tmp_path, **KEEP)
    fill(store, [0])
    store.flush()
    real_pwritev, real_write = os.pwritev, os.write
    calls = []

    def torn(fd, data, *rest):
        if _path_of(fd).endswith("journal.log") and len(calls) < 2:
            calls.append(fd)
            if len(calls) == 1:  # a short write: 100 bytes of the first record make it
                view = memoryview(data[0] if rest else data).cast("B")[:100]
                return real_pwritev(fd, [view], *rest) if rest else real_write(fd, view)
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_pwritev(fd, data, *rest) if rest else real_write(fd, data)

    monkeypatch.setattr(os, "pwritev", lambda fd, bufs, off: torn(fd, bufs, off))
    monkeypatch.setattr(os, "write", lambda fd, data: torn(fd, data))
    fill(store, [1])
    with pytest.raises(OSError) as failed:
        store.flush()
    assert failed.value.errno == errno.ENOSPC
    monkeypatch.undo()
    fill(store, [2])
    store.flush()  # acknowledged: blocks 1 and 2
    fill(store, [3])
    store.flush()  # acknowledged: block 3
    crash(store)
    store = open_store(tmp_path, **KEEP)
    assert_holds(store, [0, 1, 2, 3])
    store.close()


def _made(tmp_path, ids=range(12), close=True):
    store = open_store(tmp_path, **KEEP)
    fill(store, ids)
    store.flush()
    segments = segment_files(tmp_path)
    assert len(segments) >= 2
    if close:
        store.close()
    return store, segments


@pytest.mark.parametrize("closed", [True, False], ids=["after-close", "after-crash"])
def test_a_missing_snapshot_is_rebuilt_not_answered_by_deleting(tmp_path, caplog, closed):
    store, segments = _made(tmp_path, close=closed)
    if not closed:
        crash(store)
    os.unlink(tmp_path / "index.arrow")
    with caplog.at_level(logging.ERROR):
        store = open_store(tmp_path, **KEEP)
    assert segment_files(tmp_path) == segments
    assert any("snapshot" in r.getMessage() and r.levelno >= logging.ERROR
               for r in caplog.records)
    assert_holds(store, range(12))
    store.close()
    store = open_store(tmp_path, **KEEP)  # and the rebuilt index was written down
    assert_holds(store, range(12))
    store.close()


@pytest.mark.parametrize("damage", ["truncated", "overwritten", "flipped"])
def test_a_damaged_snapshot_is_detected_and_rebuilt(tmp_path, caplog, damage):
    _made(tmp_path)
    path = tmp_path / "index.arrow"
    data = bytearray(path.read_bytes())
    if damage == "truncated":
        data = data[: len(data) // 2]
    elif damage == "overwritten":
        data[:64] = b"\xff" * 64
    else:  # flipped bytes inside the entries: nothing but a checksum notices
        third = len(data) // 3
        data[third : third + 256] = bytes(b ^ 0x5A for b in data[third : third + 256])
    path.write_bytes(bytes(data))
    with caplog.at_level(logging.ERROR):
        store = open_store(tmp_path, **KEEP)
    assert any(r.levelno >= logging.ERROR for r in caplog.records)
    assert_holds(store, range(12))
    store.close()


def test_a_lost_snapshot_with_a_journal_tail_keeps_both(tmp_path):
    store = open_store(tmp_path, **KEEP)
    fill(store, range(10))
    store.close()  # the snapshot holds 10 blocks
    store = open_store(tmp_path, **KEEP)
    fill(store, range(10, 14))
    store.flush()  # 4 more, in the journal only
    crash(store)
    os.unlink(tmp_path / "index.arrow")
    store = open_store(tmp_path, **KEEP)
    assert_holds(store, range(14))
    store.close()


def test_a_rebuild_never_brings_back_a_deleted_or_moved_block(tmp_path):
    """Deletions and compaction moves from before the last snapshot stay in force when the
    snapshot is lost: their DEL records travel into each new journal."""
    small = dict(capacity_bytes=3 * BLOCK, segment_bytes=BLOCK,
                 compact_threshold_bytes=BLOCK // 4, snapshot_every=4)
    store = open_store(tmp_path, **small)
    for i in range(30):  # evictions, compaction and several snapshots on the way
        fill(store, [i])
        if i % 3 == 2:
            store.delete(key(i - 1))
        store.flush()
    held = sorted(store.keys())
    stats = store.stats()
    assert stats.evictions > 0 and stats.extra["compactions"] > 0
    store.close()
    os.unlink(tmp_path / "index.arrow")
    store = open_store(tmp_path, **small)
    assert sorted(store.keys()) == held
    for k in held:
        i = next(j for j in range(30) if key(j) == k)
        np.testing.assert_array_equal(store.get(k), payload(k, N + i))
    store.check_integrity()
    store.close()


@pytest.mark.parametrize("reopen", ["crash", "close", "rebuild"])
def test_tags_survive_reopen_and_tagged_deletions_are_durable(tmp_path, reopen):
    store = open_store(tmp_path, **KEEP)
    fill(store, range(4), tag="0123456789abcdef")
    fill(store, range(4, 6), tag="fedcba9876543210")
    fill(store, [6])
    store.flush()
    assert store.delete_tagged("fedcba9876543210") == 2
    store.flush()
    if reopen == "crash":
        crash(store)
    else:
        store.close()
        if reopen == "rebuild":
            os.unlink(tmp_path / "index.arrow")
    store = open_store(tmp_path, **KEEP)
    assert_holds(store, [0, 1, 2, 3, 6])
    assert [store.tag_of(key(i)) for i in (0, 3, 6)] == ["0123456789abcdef"] * 2 + [""]
    assert store.tag_of(key(4)) is None
    store.close()


def test_bad_tags_are_refused_and_change_nothing(tmp_path):
    store = open_store(tmp_path, **KEEP)
    with pytest.raises(ValueError):
        store.put(key(0), payload(key(0), 10), tag="x" * 200)
    with pytest.raises(ValueError):
        store.delete_tagged("")
    assert len(store) == 0
    store.close()


@pytest.mark.parametrize("reopen", ["crash", "close", "rebuild"])
def test_a_tag_adopted_by_an_untagged_block_survives_reopen_its_bytes_kept(tmp_path, reopen):
    store = open_store(tmp_path, **KEEP)
    fill(store, range(3))
    fill(store, [3], tag="fedcba9876543210")
    store.flush()
    sums = {i: store.books.index.get(key(i)).checksum for i in range(4)}
    written = store.stats().bytes_written
    assert store.books.adopt_tag(key(0), "0123456789abcdef", sums[0])
    assert not store.books.adopt_tag(key(1), "0123456789abcdef", sums[1] ^ 1)  # other bytes
    assert not store.books.adopt_tag(key(3), "0123456789abcdef", sums[3])  # tagged already
    assert not store.books.adopt_tag(key(9), "0123456789abcdef", 0)  # absent
    assert store.stats().bytes_written == written
    store.flush()
    if reopen == "crash":
        crash(store)
    else:
        store.close()
        if reopen == "rebuild":
            os.unlink(tmp_path / "index.arrow")
    store = open_store(tmp_path, **KEEP)
    assert_holds(store, range(4))
    assert [store.tag_of(key(i)) for i in range(4)] == [
        "0123456789abcdef", "", "", "fedcba9876543210"]
    assert store.delete_tagged("0123456789abcdef") == 1
    store.close()


def test_a_segment_id_is_never_reused_after_a_crash(tmp_path):
    """A write granted in a new segment by an incarnation that then dies may still land at
    its path and offset. The next incarnation deletes that segment (nothing committed), and
    crashes before a snapshot records the id; the one after must not recreate the file, nor
    append to a reopened segment past its head set back, or the dead grant's write lands
    over a block stored since."""
    store = open_store(tmp_path, **KEEP)
    fill(store, [0])
    store.close()  # the snapshot: next segment 2
    store = open_store(tmp_path, **KEEP)
    dead = store.books.reserve(key(1), N + 1)  # a tier's grant: its writer outlives the store
    assert dead is not None
    crash(store)
    crash(open_store(tmp_path, **KEEP))  # deletes the empty segment; no snapshot
    store = open_store(tmp_path, **KEEP)
    fill(store, [2])
    assert store.locate(key(2)).path != dead.seg.path  # type: ignore[union-attr]
    if os.path.exists(dead.seg.path):  # the late write of the dead grant
        with open(dead.seg.path, "r+b") as f:
            f.seek(dead.offset)
            f.write(payload(key(1), N + 1).tobytes())
    store.flush()
    assert_holds(store, [0, 2])
    store.close()
