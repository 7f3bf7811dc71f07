"""Compaction against a failed sync of the segment it moves blocks into: the moved blocks
were acknowledged before, so they stay where they were, their source kept until a move of
them is durable.

Every scenario ends with the exact bytes of every acknowledged block read back and
``check_integrity()``.
"""

from __future__ import annotations

import errno
import os
from typing import Any

import pytest
from nvme_helpers import BLOCK, key, open_store
from test_nvme_adopt_tag import TAG, FailingFiles, assert_holds, crash, put

from cmx.storage.nvme.errors import StoreIOError

NARROW = dict(capacity_bytes=64 * BLOCK, segment_bytes=2 * BLOCK)  # two blocks a segment


def half_dead(tmp_path: Any) -> tuple[FailingFiles, Any, Any, Any]:
    """Blocks 0-2 acknowledged and block 1 deleted: block 0's segment is half dead, the
    next compaction's source."""
    files = FailingFiles()
    store = open_store(tmp_path, files=files, **NARROW)
    for i in range(3):
        put(store, i)
    store.flush()
    assert store.delete(key(1))
    store.flush()
    books = store.books
    return files, store, books, books.segs.segs[books.index.get(key(0)).seg]


@pytest.mark.parametrize("how", ["crash", "crash-rebuild"])
def test_a_failed_sync_of_the_compaction_target_keeps_the_moved_block(tmp_path, how):
    """Block 0 acknowledged, compacted out of its half-dead segment into one whose sync
    fails: block 0 stays at its source extent, whose segment is kept; a later compaction
    moves it."""
    files, store, books, src = half_dead(tmp_path)  # block 0 acknowledged
    files.armed = ("fdatasync", ".dat", errno.EIO)
    with pytest.raises(StoreIOError):
        books.space._compact(src)
    assert files.failed == 1
    assert books.index.get(key(0)).seg == src.id  # back at its source extent
    assert books.segs.segs.get(src.id) is src and not src.retired  # its space not freed
    assert os.path.exists(src.path)
    assert_holds(store, [0, 2])
    store.flush()
    assert os.path.exists(src.path) and not src.retired
    crash(store)
    if how.endswith("rebuild"):
        (tmp_path / "index.arrow").unlink()
    store = open_store(tmp_path, files=files, **NARROW)
    assert_holds(store, [0, 2])
    books = store.books
    src = books.segs.segs[books.index.get(key(0)).seg]
    books.space._compact(src)
    assert books.index.get(key(0)).seg != src.id
    assert src.id not in books.segs.segs
    assert_holds(store, [0, 2])
    crash(store)
    store = open_store(tmp_path, **NARROW)
    assert_holds(store, [0, 2])
    store.close()


def test_a_block_whose_move_is_not_durable_adopts_no_tag_until_it_is(tmp_path):
    """The journal write of a compaction's records fails: the moved block keeps its bytes,
    and adopts a tag only once a flush made the move durable (a failed sync of the copy
    would have to put it back untagged)."""
    files, store, books, src = half_dead(tmp_path)
    files.armed = ("pwrite", "journal.log", errno.ENOSPC)
    with pytest.raises(StoreIOError):
        books.space._compact(src)
    assert files.failed == 1
    checksum = books.index.get(key(0)).checksum
    assert not books.adopt_tag(key(0), TAG, checksum)
    assert_holds(store, [0, 2])
    store.flush()
    assert books.adopt_tag(key(0), TAG, checksum)
    store.flush()
    crash(store)
    store = open_store(tmp_path, **NARROW)
    assert_holds(store, [0, 2])
    assert store.tag_of(key(0)) == TAG
    store.close()
