"""Corrupted bytes on disk are a miss and a quarantine on every read path, never wrong data."""

from __future__ import annotations

import numpy as np
import pytest
from nvme_helpers import BLOCK, aligned_payload, key, open_store, payload

from cmx.buffers import aligned_empty
from cmx.storage.base import EventKind
from cmx.storage.nvme.chunks import CHUNK_BYTES, block_sums


def corrupt(store, k, at: int) -> None:
    """Flip one byte ``at`` bytes into block ``k`` in its segment file."""
    loc = store.locate(k)
    with open(loc.path, "r+b") as f:
        f.seek(loc.offset + at)
        byte = f.read(1)
        f.seek(loc.offset + at)
        f.write(bytes([byte[0] ^ 0x5A]))


READS = {
    "get": lambda s, k: s.get(k),
    "get_into": lambda s, k: (lambda out: out if s.get_into(k, out) else None)(
        aligned_empty(BLOCK)),
    "get_many": lambda s, k: s.get_many([k])[0],
    "get_many_into": lambda s, k: (lambda out: out if s.get_many_into([k], [out])[0] else None)(
        aligned_empty(BLOCK)),
    "read_runs": lambda s, k: s.read_runs([(k, 0, BLOCK)])[0],
}


@pytest.mark.parametrize("read", sorted(READS))
def test_a_corrupt_block_is_a_miss_and_is_quarantined(tmp_path, read):
    store = open_store(tmp_path)
    events = []
    store.subscribe(events.append)
    for i in range(3):
        store.put(key(i), aligned_payload(key(i), BLOCK))
    store.flush()
    corrupt(store, key(1), BLOCK - 3)
    assert READS[read](store, key(1)) is None
    stats = store.stats()
    assert stats.quarantined == 1 and stats.misses == 1
    assert key(1) not in store and store.locate(key(1)) is None
    assert events[-1].kind is EventKind.REMOVED and events[-1].key == key(1)
    assert READS[read](store, key(1)) is None  # now a plain miss
    for i in (0, 2):
        np.testing.assert_array_equal(READS[read](store, key(i)), payload(key(i), BLOCK))
    store.check_integrity()
    store.close()
    store = open_store(tmp_path)  # the quarantine was journaled
    assert sorted(store.keys()) == sorted([key(0), key(2)])
    store.close()


def test_slice_reads_verify_only_the_chunks_they_cover(tmp_path):
    store = open_store(tmp_path)
    data = payload(key(0), BLOCK)
    store.put(key(0), data)
    corrupt(store, key(0), CHUNK_BYTES + 10)  # the second chunk
    first = store.read_runs([(key(0), 100, 5000)])[0]
    np.testing.assert_array_equal(first, data[100:5100])  # chunk 0 checks out
    assert store.read_runs([(key(0), CHUNK_BYTES - 10, 20)]) == [None]  # spans chunk 1
    assert store.stats().quarantined == 1 and key(0) not in store
    store.close()


def test_compaction_does_not_copy_a_corrupt_block(tmp_path):
    store = open_store(tmp_path, capacity_bytes=4 * BLOCK, segment_bytes=2 * BLOCK,
                       compact_threshold_bytes=BLOCK)
    for i in range(4):
        store.put(key(i), payload(key(i), BLOCK))
    store.get(key(0))  # key 1 is now the least recently used
    corrupt(store, key(0), 7)
    store.put(key(4), payload(key(4), BLOCK))  # evicts key 1, compacts segment 1 (holds 0)
    assert store.stats().quarantined == 1
    assert key(0) not in store
    for i in (2, 3, 4):
        np.testing.assert_array_equal(store.get(key(i)), payload(key(i), BLOCK))
    store.check_integrity()
    store.close()


def test_block_sums_match_the_shared_checksum():
    from cmx.checksum import checksum

    for n in (0, 1, 4096, CHUNK_BYTES, CHUNK_BYTES + 1, 3 * CHUNK_BYTES - 5):
        data = payload(key(n), n)
        whole, sums = block_sums(data)
        assert whole == checksum(data)
        padded = np.zeros(max(4096, -(-n // 4096) * 4096), np.uint8)
        padded[:n] = data
        expected = [checksum(padded[i:i + CHUNK_BYTES]) for i in range(0, padded.nbytes,
                                                                        CHUNK_BYTES)]
        assert np.frombuffer(sums, "<u8").tolist() == expected
