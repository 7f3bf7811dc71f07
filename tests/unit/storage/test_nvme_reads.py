"""Slice reads: exact bytes, chunk-verified, coalesced into large I/Os."""

from __future__ import annotations

import numpy as np
import pytest
from nvme_helpers import BLOCK, KiB, key, open_store, payload

from cmx.layout import KVLayout
from cmx.storage.nvme.chunks import CHUNK_BYTES
from cmx.storage.nvme.reads import plan_reads

C = CHUNK_BYTES


def test_plan_merges_overlaps_and_touching_ranges():
    plan = plan_reads([(1, 0, C), (1, C, 2 * C), (1, C, 3 * C), (2, 0, C)], requested=4 * C)
    assert plan.runs == [(1, 0, 3 * C, 0), (2, 0, C, 3 * C)]
    assert plan.nbytes == 4 * C
    assert plan.locate(1, C + 5) == C + 5 and plan.locate(2, 7) == 3 * C + 7
    with pytest.raises(KeyError):
        plan.locate(1, 3 * C)


def test_plan_bridges_small_gaps_within_the_amplification_budget():
    ranges = [(1, 0, C), (1, C + 4 * KiB, 2 * C + 4 * KiB), (1, 4 * C, 5 * C)]
    tight = plan_reads(ranges, requested=3 * C, max_amplification=1.0)
    assert len(tight.ios) == 3 and tight.nbytes == 3 * C
    loose = plan_reads(ranges, requested=3 * C, max_amplification=1.5)
    # The 4 KiB gap is bridged; the 2 chunk gap is past max_gap and stays.
    assert [(s, a, b) for s, a, b, _ in loose.runs] == [(1, 0, 2 * C + 4 * KiB), (1, 4 * C, 5 * C)]
    assert loose.nbytes <= 1.5 * 3 * C


def test_plan_caps_io_size_and_lays_ios_out_contiguously():
    plan = plan_reads([(3, 0, 10 * C)], requested=10 * C, max_io=4 * C)
    assert plan.ios == [(3, 0, 4 * C, 0), (3, 4 * C, 4 * C, 4 * C), (3, 8 * C, 2 * C, 8 * C)]


def test_read_runs_returns_exactly_the_requested_bytes(tmp_path):
    store = open_store(tmp_path)
    sizes = {key(i): n for i, n in enumerate([BLOCK, 200_000, 5000, 1])}
    for k, n in sizes.items():
        store.put(k, payload(k, n))
    rng = np.random.default_rng(1)
    requests = []
    for _ in range(300):
        k = list(sizes)[int(rng.integers(len(sizes)))]
        off = int(rng.integers(0, sizes[k]))
        requests.append((k, off, int(rng.integers(0, sizes[k] - off + 1))))
    requests += [(key(0), C - 1, 2), (key(1), 0, 200_000), (key(9), 0, 10), (key(3), 1, 0)]
    got = store.read_runs(requests)
    for (k, off, length), arr in zip(requests, got):
        if k == key(9):
            assert arr is None
        else:
            np.testing.assert_array_equal(arr, payload(k, sizes[k])[off:off + length])
    assert store.read_runs([]) == []
    store.check_integrity()
    store.close()


def test_head_wise_pieces_become_large_io_with_low_amplification(tmp_path):
    """One KV head across all layers of 16 head-major blocks, asked for as 512-byte pieces."""
    layout = KVLayout(num_layers=8, num_kv_heads=4, head_dim=128, block_tokens=64,
                      order="head_major")
    assert layout.block_bytes == 1 << 20
    store = open_store(tmp_path, capacity_bytes=32 * layout.block_bytes,
                       block_bytes=layout.block_bytes, io_bytes=4 << 20)
    keys = [key(i, b"hm") for i in range(16)]
    for k in keys:
        store.put(k, payload(k, layout.block_bytes))
    [(start, length)] = layout.slice_runs(heads=range(1, 2))  # one contiguous run per block
    piece = 512  # one token of one head of one layer (head_dim 128 x bfloat16)
    requests = [(k, off, piece) for k in keys for off in range(start, start + length, piece)]
    assert len(requests) == 16 * 512
    before = store.stats().extra
    got = store.read_runs(requests)
    assert [arr.nbytes for arr in got] == [n for _, _, n in requests]
    full = {k: payload(k, layout.block_bytes) for k in keys}
    for (k, off, n), arr in zip(requests, got):
        np.testing.assert_array_equal(arr, full[k][off:off + n])
    after = store.stats().extra
    ios = {size: n - before["io_size_histogram"].get(size, 0)
           for size, n in after["io_size_histogram"].items()}
    ios = {size: n for size, n in ios.items() if n}
    assert min(ios) >= 128 * KiB, ios  # never one tiny I/O per piece
    assert sum(ios.values()) <= 16, ios
    requested = after["bytes_requested"] - before["bytes_requested"]
    read = after["bytes_read_from_disk"] - before["bytes_read_from_disk"]
    assert requested == 16 * length
    assert read / requested <= 1.5
    store.close()
