"""The persistent index: journal torn tails, snapshot + journal replay, lost unflushed puts.

``crash()`` drops a store the way a killed process would: no flush, no snapshot; only the
directory lock is released so the same process can reopen the directory.
"""

from __future__ import annotations

import os
import shutil

import numpy as np
from nvme_helpers import BLOCK, key, open_store, payload, segment_files

from cmx.storage.nvme.entry import BlockEntry
from cmx.storage.nvme.journal import RECORD_BYTES, Journal, encode_put


def crash(store) -> None:
    store._teardown()


def fill(store, ids, n=50_000):
    for i in ids:
        store.put(key(i), payload(key(i), n + i))


def assert_holds(store, ids, n=50_000):
    assert sorted(store.keys()) == sorted(key(i) for i in ids)
    for i in ids:
        np.testing.assert_array_equal(store.get(key(i)), payload(key(i), n + i))
    store.check_integrity()


def test_journal_replay_after_a_crash(tmp_path):
    store = open_store(tmp_path)
    fill(store, range(5))
    store.delete(key(2))
    store.flush()
    assert store.stats().extra["journal_records"] > 0  # still in the journal, not a snapshot
    crash(store)
    store = open_store(tmp_path)
    assert_holds(store, [0, 1, 3, 4])
    store.close()


def log_bytes(store) -> int:
    return store.stats().extra["disk_bytes"]


def test_unflushed_puts_are_never_seen_and_their_space_is_reused(tmp_path):
    store = open_store(tmp_path)
    fill(store, range(3))
    store.flush()
    committed = log_bytes(store)
    fill(store, range(3, 6))  # written to disk, but never flushed
    assert log_bytes(store) > committed
    assert segment_files(tmp_path) == ["seg-000001.dat"]
    crash(store)
    store = open_store(tmp_path)
    assert_holds(store, range(3))
    assert log_bytes(store) == committed  # the log goes on where the commits ended
    tail = (tmp_path / "seg-000001.dat").read_bytes()[committed:]
    assert not any(tail)  # the uncommitted writes were cut off, not just hidden
    fill(store, range(6, 8))
    assert_holds(store, [0, 1, 2, 6, 7])
    store.close()


def test_torn_tail_record_is_ignored(tmp_path):
    store = open_store(tmp_path)
    fill(store, range(4))
    store.flush()
    crash(store)
    journal = tmp_path / "journal.log"
    good = journal.stat().st_size
    with open(journal, "ab") as f:
        f.write(os.urandom(RECORD_BYTES // 2))  # half a record: the write a crash tore
    store = open_store(tmp_path)
    assert_holds(store, range(4))
    fill(store, [9])
    store.flush()
    crash(store)
    store = open_store(tmp_path)  # the torn bytes were cut, later records still count
    assert_holds(store, [0, 1, 2, 3, 9])
    store.close()
    assert good > 0


def test_a_put_without_all_its_chunk_records_is_ignored(tmp_path):
    store = open_store(tmp_path)
    fill(store, range(2))
    store.flush()
    gen = store.books.durability.journal.generation
    crash(store)
    ghost = BlockEntry(key(7), None, 1, 0, BLOCK, 0, bytes(16))
    record = encode_put(ghost, gen)
    assert len(record) == 2 * RECORD_BYTES
    with open(tmp_path / "journal.log", "ab") as f:
        f.write(record[:RECORD_BYTES])  # the PUT made it, its CHUNKS record did not
    store = open_store(tmp_path)
    assert_holds(store, range(2))
    store.close()


def test_a_damaged_record_ends_the_replay(tmp_path):
    store = open_store(tmp_path)
    fill(store, [0])
    store.flush()
    fill(store, [1])
    store.flush()
    crash(store)
    path = tmp_path / "journal.log"
    data = bytearray(path.read_bytes())
    data[-RECORD_BYTES + 5] ^= 0xFF  # the last record of block 1
    path.write_bytes(bytes(data))
    store = open_store(tmp_path)
    assert_holds(store, [0])
    store.close()


def test_snapshot_then_journal_replay(tmp_path):
    store = open_store(tmp_path, snapshot_every=6)
    fill(store, range(4))
    store.flush()  # 12 records: the next flush writes a snapshot instead
    fill(store, range(4, 6))
    store.delete(key(1))
    store.flush()
    assert store.stats().extra["journal_records"] == 0
    fill(store, range(6, 8))
    store.delete(key(4))
    store.flush()  # these only in the journal
    assert store.stats().extra["journal_records"] > 0
    crash(store)
    store = open_store(tmp_path)
    assert_holds(store, [0, 2, 3, 5, 6, 7])
    store.close()


def test_a_journal_older_than_the_snapshot_is_not_replayed(tmp_path):
    store = open_store(tmp_path)
    fill(store, range(3))
    store.flush()
    shutil.copy(tmp_path / "journal.log", tmp_path / "old-journal")
    store.delete(key(0))
    store.close()  # snapshot of generation g+1, journal restarted
    # A crash between the snapshot's rename and the journal's restart leaves the old journal.
    os.replace(tmp_path / "old-journal", tmp_path / "journal.log")
    store = open_store(tmp_path)
    assert_holds(store, [1, 2])  # block 0 stays deleted: the stale PUT was not replayed
    store.close()


def test_journal_round_trip(tmp_path):
    entries = [
        BlockEntry(key(i), key(i - 1) if i else None, 3, 4096 * i, 1000 * i + 1, 2**64 - 1 - i,
                   np.arange(n, dtype="<u8").tobytes())
        for i, n in enumerate([1, 14, 15, 29, 256])
    ]
    journal = Journal(str(tmp_path / "j"))
    journal.restart(7)
    journal.append(encode_put(e, 7) for e in entries)
    journal.sync()
    journal.close()
    assert journal.read_generation() == 7
    assert list(journal.replay(7)) == entries
    assert list(journal.replay(8)) == []  # another generation's records never parse


def test_stray_files_are_cleaned_on_open(tmp_path):
    store = open_store(tmp_path)
    fill(store, [0])
    store.close()
    (tmp_path / "seg-000099.dat").write_bytes(b"\0" * 4096)  # never referenced
    (tmp_path / "index.arrow.tmp").write_bytes(b"half a snapshot")
    store = open_store(tmp_path)
    assert sorted(os.listdir(tmp_path)) == ["LOCK", "index.arrow", "journal.log",
                                            "next-segment", "seg-000001.dat", "seg-000001.rec"]
    assert_holds(store, [0])
    fill(store, [1])  # the next segment id is past the stray one's
    store.close()
