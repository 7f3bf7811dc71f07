"""A tag adopted by a block stored untagged, against faults: a failed sync of the block's
segment, a failed journal write of the adopt's record, a delete and re-store of the key.

Every scenario ends with the exact bytes of every acknowledged block read back and
``check_integrity()``.
"""

from __future__ import annotations

import errno
import os

import numpy as np
import pytest
from crash_plane import PlaneFiles, crash_images
from nvme_helpers import BLOCK, key, open_store, payload

from cmx.storage.nvme.errors import StoreIOError
from cmx.storage.nvme.files import FileOps

TAG = "0123456789abcdef"
N = 40_000  # payload bytes of block i: N + i
WIDE = dict(capacity_bytes=64 * BLOCK, segment_bytes=8 * BLOCK)  # several blocks a segment


class FailingFiles(FileOps):
    """The store's own file layer, with the next ``fdatasync`` or ``pwrite`` of a file whose
    name ends with ``suffix`` failing once with ``err``, once ``armed``."""

    def __init__(self) -> None:
        super().__init__()
        self.paths: dict[int, str] = {}
        self.armed: tuple[str, str, int] | None = None  # (call, suffix, errno)
        self.failed = 0

    def open(self, path: str, flags: int, mode: int = 0o600) -> int:
        fd = super().open(path, flags, mode)
        self.paths[fd] = path
        return fd

    def _maybe_fail(self, call: str, fd: int) -> None:
        if self.armed and self.armed[0] == call and self.paths.get(fd, "").endswith(
                self.armed[1]):
            err = self.armed[2]
            self.armed = None
            self.failed += 1
            raise StoreIOError(err, f"injected {os.strerror(err)}: {call}")

    def fdatasync(self, fd: int) -> None:
        self._maybe_fail("fdatasync", fd)
        super().fdatasync(fd)

    def pwrite(self, fd: int, data: memoryview | bytes, offset: int) -> int:
        self._maybe_fail("pwrite", fd)
        return super().pwrite(fd, data, offset)


def crash(store) -> None:
    """Drop a store as a killed process would: no flush, no snapshot."""
    store._teardown()


def put(store, i: int, tag: str = "") -> None:
    assert store.put(key(i), payload(key(i), N + i), tag=tag)


def assert_holds(store, ids, dropped: int = 0) -> None:
    assert sorted(store.keys()) == sorted(key(i) for i in ids)
    for i in ids:
        np.testing.assert_array_equal(store.get(key(i)), payload(key(i), N + i))
    assert store.stats().quarantined == dropped
    store.check_integrity()


def reopen(store, tmp_path, how: str):
    if how.startswith("crash"):
        crash(store)
    else:
        store.close()
    if how.endswith("rebuild"):
        os.unlink(tmp_path / "index.arrow")
    return open_store(tmp_path, **WIDE)


@pytest.mark.parametrize("first", ["crash", "crash-rebuild"])
def test_a_failed_sync_of_its_segment_keeps_a_block_that_adopted_a_tag(tmp_path, first):
    """A block acknowledged durable, then tagged; a later block written into the same segment
    fails its sync: only that later block is dropped, the tagged one stays with its tag."""
    files = FailingFiles()
    store = open_store(tmp_path, files=files, **WIDE)
    put(store, 0)
    store.flush()  # block 0 acknowledged
    checksum = store.books.index.get(key(0)).checksum
    assert store.books.adopt_tag(key(0), TAG, checksum)
    put(store, 1)  # same segment: its sync now covers block 1 only
    assert store.books.index.get(key(1)).seg == store.books.index.get(key(0)).seg
    files.armed = ("fdatasync", ".dat", errno.EIO)
    with pytest.raises(StoreIOError):
        store.flush()
    assert files.failed == 1
    assert key(1) not in store  # never acknowledged: dropped
    assert_holds(store, [0], dropped=1)
    assert store.tag_of(key(0)) == TAG
    store.flush()
    for how in (first, "close", "rebuild"):
        store = reopen(store, tmp_path, how)
        assert_holds(store, [0])
        assert store.tag_of(key(0)) == TAG
    store.close()


def test_a_block_tagged_in_the_flush_its_segment_fails_is_dropped(tmp_path):
    """Stored, tagged and synced in one flush whose sync fails: never acknowledged, gone."""
    files = FailingFiles()
    store = open_store(tmp_path, files=files, **WIDE)
    put(store, 0)
    assert store.books.adopt_tag(key(0), TAG, store.books.index.get(key(0)).checksum)
    files.armed = ("fdatasync", ".dat", errno.EIO)
    with pytest.raises(StoreIOError):
        store.flush()
    assert key(0) not in store
    assert store.stats().quarantined == 1
    store.flush()
    store = reopen(store, tmp_path, "crash")
    assert_holds(store, [])
    store.close()


@pytest.mark.parametrize("how", ["crash", "crash-rebuild", "close", "rebuild"])
def test_replay_puts_no_old_tag_on_a_block_deleted_and_stored_again(tmp_path, how):
    """Adopt logged, the block deleted, the key stored again untagged with other bytes: the
    journal replays in order, so the new block comes back untagged with its own bytes."""
    store = open_store(tmp_path, **WIDE)
    put(store, 0)
    store.flush()
    assert store.books.adopt_tag(key(0), TAG, store.books.index.get(key(0)).checksum)
    store.flush()
    assert store.delete(key(0))
    other = payload(key(7), N + 3)
    assert store.put(key(0), other)
    store.flush()
    store = reopen(store, tmp_path, how)
    np.testing.assert_array_equal(store.get(key(0)), other)
    assert store.tag_of(key(0)) == ""
    assert store.delete_tagged(TAG) == 0
    assert key(0) in store
    store.check_integrity()
    store.close()


@pytest.mark.parametrize("how", ["crash", "close", "rebuild"])
def test_enospc_on_the_adopt_record_keeps_the_block_readable(tmp_path, how):
    """The journal write of the adopt's records runs out of space: the flush fails, the block
    stays readable with its bytes; the next flush (a snapshot) makes the tag durable."""
    files = FailingFiles()
    store = open_store(tmp_path, files=files, **WIDE)
    put(store, 0)
    put(store, 1)
    store.flush()
    assert store.books.adopt_tag(key(0), TAG, store.books.index.get(key(0)).checksum)
    files.armed = ("pwrite", "journal.log", errno.ENOSPC)
    with pytest.raises(StoreIOError):
        store.flush()
    assert files.failed == 1
    assert_holds(store, [0, 1])
    assert store.tag_of(key(0)) == TAG
    store.flush()
    store = reopen(store, tmp_path, how)
    assert_holds(store, [0, 1])
    assert [store.tag_of(key(0)), store.tag_of(key(1))] == [TAG, ""]
    store.close()


def test_a_crash_before_the_adopt_is_flushed_keeps_the_block_untagged(tmp_path):
    """Adopt noted, never flushed: the block comes back as it was acknowledged, untagged."""
    files = FailingFiles()
    store = open_store(tmp_path, files=files, **WIDE)
    put(store, 0)
    store.flush()
    assert store.books.adopt_tag(key(0), TAG, store.books.index.get(key(0)).checksum)
    files.armed = ("pwrite", "journal.log", errno.ENOSPC)
    with pytest.raises(StoreIOError):
        store.flush()
    store = reopen(store, tmp_path, "crash")
    assert_holds(store, [0])
    assert store.tag_of(key(0)) == ""
    store.close()


@pytest.mark.parametrize("how", ["crash", "crash-rebuild"])
@pytest.mark.parametrize("snapshot_at", ["before the adopt", "before its flush"])
def test_a_snapshot_around_the_adopt_keeps_the_tag_and_the_bytes(tmp_path, how, snapshot_at):
    """A snapshot taken before the adopt (its records in the journal after it), or between
    the adopt and its flush (the snapshot holds the tagged record): a crash keeps both."""
    store = open_store(tmp_path, **WIDE)
    put(store, 0)
    put(store, 1)
    store.flush()
    if snapshot_at == "before the adopt":
        store.books.durability.snapshot()
    assert store.books.adopt_tag(key(1), TAG, store.books.index.get(key(1)).checksum)
    if snapshot_at == "before its flush":
        store.books.durability.snapshot()
    store.flush()
    store = reopen(store, tmp_path, how)
    assert_holds(store, [0, 1])
    assert [store.tag_of(key(0)), store.tag_of(key(1))] == ["", TAG]
    assert store.delete_tagged(TAG) == 1
    store.close()


def test_a_power_loss_anywhere_in_the_adopt_flush_keeps_the_bytes(tmp_path):
    """Every image a power loss could leave during the flush of an adopt (with a new block
    in the same segment): the acknowledged blocks come back with their bytes, the tagged one
    untagged or tagged; once that flush returned, tagged."""
    files = PlaneFiles(tmp_path / "run")
    os.mkdir(files.root)
    store = open_store(files.root, files=files, **WIDE)
    put(store, 0)
    put(store, 1)
    store.flush()
    start = len(files.log)
    assert store.books.adopt_tag(key(0), TAG, store.books.index.get(key(0)).checksum)
    put(store, 2)
    store.flush()
    end = len(files.log)
    crash(store)
    checked = 0
    for upto, mode, write in crash_images(files.log):
        if upto < start:
            continue
        into = tmp_path / f"img-{upto}-{mode}"
        os.mkdir(into)
        write(str(into))
        again = open_store(into, **WIDE)
        held = [i for i in (0, 1, 2) if key(i) in again]
        assert held[:2] == [0, 1], (upto, mode)
        for i in held:
            np.testing.assert_array_equal(again.get(key(i)), payload(key(i), N + i))
        assert again.tag_of(key(0)) in (("", TAG) if upto < end else (TAG,)), (upto, mode)
        assert again.tag_of(key(1)) == ""
        again.check_integrity()
        again.close()
        checked += 1
    assert checked > 3, checked


@pytest.mark.parametrize("how", ["crash", "crash-rebuild", "close", "rebuild"])
@pytest.mark.parametrize("snapshot", [False, True])
def test_a_block_dropped_after_it_adopted_a_tag_stays_dropped(tmp_path, how, snapshot):
    """Adopt, then the namespace's blocks deleted: neither the untagged record the adopt
    ended nor the tagged one comes back, even when a snapshot restarted the journal in
    between and the index is rebuilt from the segments' record logs."""
    store = open_store(tmp_path, **WIDE)
    put(store, 0)
    put(store, 1)
    store.flush()
    assert store.books.adopt_tag(key(0), TAG, store.books.index.get(key(0)).checksum)
    store.flush()
    if snapshot:
        store.books.durability.snapshot()
    assert store.delete_tagged(TAG) == 1
    store.flush()
    store = reopen(store, tmp_path, how)
    assert_holds(store, [1])
    store.close()
