"""Partial reads of blocks on NVMe: only the chunks that cover a selection are read, each is
verified, and a corrupt chunk is never returned."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import numpy as np
import pytest

from cmx.actors.slices.reads import ExtentSlices
from cmx.keys import BlockHash
from cmx.layout import KVLayout, PayloadOrder
from cmx.selection import Selection, gather
from cmx.storage.nvme.chunks import CHUNK_BYTES
from cmx.storage.nvme.dataplane import Extent, ExtentPlane
from cmx.storage.nvme.extents import ExtentBooks
from cmx.storage.nvme.staging import alloc_aligned

# 4 layers x 2 x 8 heads x 256 tokens x 128 dim x 2 bytes = 4 MiB; one head's K (or V) of one
# layer is 64 KiB, and one head over all layers 512 KiB.
GEOMETRY = dict(num_layers=4, num_kv_heads=8, head_dim=128, dtype="bfloat16", block_tokens=256)


class CountingIo(ExtentPlane):
    """The agent's NVMe I/O, counting what it reads."""

    def __init__(self) -> None:
        super().__init__(engine="threads")
        self.ranges: list[tuple[int, int]] = []  # (file offset, bytes) of each read
        self.whole_reads = 0

    def read_at(self, path: str, ios: Sequence[tuple[int, np.ndarray]]) -> None:
        self.ranges += [(offset, dst.nbytes) for offset, dst in ios]
        super().read_at(path, ios)

    def read_many(self, extents: Sequence[Extent], dsts: Sequence[np.ndarray]) -> list[bool]:
        self.whole_reads += len(extents)
        return super().read_many(extents, dsts)


@pytest.fixture
def io() -> Iterator[CountingIo]:
    nvme = CountingIo()
    yield nvme
    nvme.close()


def put_block(store: ExtentBooks, io: ExtentPlane, layout: KVLayout) -> tuple[Extent, np.ndarray]:
    payload = layout.to_payload(layout.random_kv(layout.block_tokens, seed=7)).numpy()
    key = BlockHash(bytes(range(32)))
    pending = store.reserve_extent(key, None, payload.nbytes)
    assert pending is not None
    buf = alloc_aligned(payload.nbytes)
    buf[:] = payload
    [(whole, sums)] = io.write_many([Extent(key, pending.path, pending.offset, payload.nbytes)],
                                    [buf])
    store.commit_extent(pending, whole, sums)
    return Extent(key, pending.path, pending.offset, payload.nbytes, whole, 0, sums), payload


@pytest.fixture
def store(tmp_path: Path) -> Iterator[ExtentBooks]:
    s = ExtentBooks(str(tmp_path / "nvme"), capacity_bytes=64 << 20, block_bytes=4 << 20,
                    segment_bytes=16 << 20)
    yield s
    s.check_integrity()
    s.close()


@pytest.mark.parametrize("order, read_bytes", [
    (PayloadOrder.HEAD_MAJOR, 512 * 1024),  # one run of 512 KiB: exactly its four chunks
    (PayloadOrder.LAYER_MAJOR, 8 * CHUNK_BYTES),  # eight runs of 64 KiB, a chunk each
])
def test_one_head_of_eight_reads_only_the_chunks_that_hold_it(
    store: ExtentBooks, io: CountingIo, order: PayloadOrder, read_bytes: int
) -> None:
    layout = KVLayout(**GEOMETRY, order=order)  # type: ignore[arg-type]
    ext, payload = put_block(store, io, layout)
    io.ranges.clear()
    sel = Selection.of(layout, None, 5)
    runs = sel.runs(layout)
    got = ExtentSlices(io).read(ext, runs)
    assert got is not None and np.array_equal(got, gather(payload, runs))
    assert sum(n for _, n in io.ranges) == read_bytes < layout.block_bytes
    assert io.whole_reads == 0
    for offset, n in io.ranges:  # every read lies inside the chunks that cover a run
        start = offset - ext.offset
        assert any(start // CHUNK_BYTES * CHUNK_BYTES <= off + length and off <= start + n
                   for off, length in runs)
    if order is PayloadOrder.HEAD_MAJOR:
        assert len(io.ranges) == 1  # coalesced: one I/O


def test_a_corrupt_chunk_under_the_selection_is_never_returned(
    store: ExtentBooks, io: CountingIo
) -> None:
    layout = KVLayout(**GEOMETRY, order=PayloadOrder.HEAD_MAJOR)  # type: ignore[arg-type]
    ext, payload = put_block(store, io, layout)
    runs = Selection.of(layout, None, 2).runs(layout)
    (off, _), = runs
    _flip(ext, off + 1000)
    assert ExtentSlices(io).read(ext, runs) is None


def test_a_corrupt_chunk_outside_the_selection_is_not_read(
    store: ExtentBooks, io: CountingIo
) -> None:
    layout = KVLayout(**GEOMETRY, order=PayloadOrder.HEAD_MAJOR)  # type: ignore[arg-type]
    ext, payload = put_block(store, io, layout)
    runs = Selection.of(layout, None, 2).runs(layout)
    _flip(ext, Selection.of(layout, None, 6).runs(layout)[0][0] + 10)
    got = ExtentSlices(io).read(ext, runs)
    assert got is not None and np.array_equal(got, gather(payload, runs))


def test_an_extent_without_chunk_sums_is_read_whole_and_checked_whole(
    store: ExtentBooks, io: CountingIo
) -> None:
    layout = KVLayout(**GEOMETRY)  # type: ignore[arg-type]
    ext, payload = put_block(store, io, layout)
    bare = Extent(ext.key, ext.path, ext.offset, ext.size, ext.checksum)
    runs = Selection.of(layout, 1, 3).runs(layout)
    got = ExtentSlices(io).read(bare, runs)
    assert got is not None and np.array_equal(got, gather(payload, runs))
    assert io.whole_reads == 1
    _flip(ext, runs[0][0])
    assert ExtentSlices(io).read(bare, runs) is None


def _flip(ext: Extent, at: int) -> None:
    fd = os.open(ext.path, os.O_RDWR)
    try:
        b = os.pread(fd, 1, ext.offset + at)
        os.pwrite(fd, bytes([b[0] ^ 0xFF]), ext.offset + at)
    finally:
        os.close(fd)


def test_a_pool_node_serves_a_selection_from_staging_or_from_its_disk(
    store: ExtentBooks, io: CountingIo
) -> None:
    from cmx.actors.pool.slices import pool_selection
    from cmx.checksum import checksum
    from cmx.storage.dram import DramStore

    layout = KVLayout(**GEOMETRY, order=PayloadOrder.HEAD_MAJOR)  # type: ignore[arg-type]
    ext, payload = put_block(store, io, layout)
    runs = Selection.of(layout, None, 4).runs(layout)
    want = gather(payload, runs)
    staging = DramStore(2 * layout.block_bytes, layout.block_bytes)
    try:
        io.ranges.clear()
        (disk,) = pool_selection("pool-a", staging, store, io, [ext.key], runs)
        assert disk is not None and np.array_equal(disk.data, want)
        assert disk.checksum == checksum(want)
        assert sum(n for _, n in io.ranges) == want.nbytes  # only the head's chunks

        r = staging.reserve(ext.key)  # staged: served from memory, disk untouched
        r.buffer[: payload.nbytes] = payload
        staging.commit(r, payload.nbytes, checksum(payload))
        io.ranges.clear()
        (mem,) = pool_selection("pool-a", staging, store, io, [ext.key], runs)
        assert mem is not None and np.array_equal(mem.data, want) and not io.ranges

        r = staging.reserve(b"\x01" * 32)  # a staged copy that lies is dropped, never served
        r.buffer[: payload.nbytes] = payload
        staging.commit(r, payload.nbytes, checksum(payload) ^ 1)
        (bad,) = pool_selection("pool-a", staging, store, io, [b"\x01" * 32], runs)
        assert bad is None and b"\x01" * 32 not in staging
    finally:
        staging.close()


class HookBooks(ExtentBooks):
    """ExtentBooks that runs ``after_unpin`` once, right after the first ``unpin``: the step
    between a reader's unpin and its quarantine."""

    after_unpin: Callable[[], None] | None = None

    def unpin(self, key: bytes) -> None:
        super().unpin(key)
        if self.after_unpin is not None:
            hook, self.after_unpin = self.after_unpin, None
            hook()


def test_a_pool_node_that_finds_a_copy_corrupt_drops_that_copy_not_one_written_since(
    tmp_path: Path, io: CountingIo
) -> None:
    from cmx.actors.pool.slices import pool_selection
    from cmx.storage.dram import DramStore

    store = HookBooks(str(tmp_path / "nvme"), capacity_bytes=64 << 20, block_bytes=4 << 20,
                      segment_bytes=16 << 20)
    staging = DramStore(2 << 20, 1 << 20)
    try:
        layout = KVLayout(**GEOMETRY, order=PayloadOrder.HEAD_MAJOR)  # type: ignore[arg-type]
        ext, payload = put_block(store, io, layout)
        runs = Selection.of(layout, None, 2).runs(layout)
        _flip(ext, runs[0][0] + 1000)

        def write_a_good_copy() -> None:  # the corrupt one gone, the key written again
            assert store.delete_unpinned([ext.key]) == 1
            put_block(store, io, layout)

        store.after_unpin = write_a_good_copy
        assert pool_selection("pool-a", staging, store, io, [ext.key], runs) == [None]
        assert ext.key in store  # the copy written since stays
        (good,) = pool_selection("pool-a", staging, store, io, [ext.key], runs)
        assert good is not None and np.array_equal(good.data, gather(payload, runs))
        store.check_integrity()
    finally:
        staging.close()
        store.close()
