"""ExtentBooks (the control plane alone) with ExtentPlane moving the bytes: the service's split
of the NVMe store, in one process."""

from __future__ import annotations

import errno
import os
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from cmx.buffers import aligned_empty
from cmx.keys import BlockHash, block_hash
from cmx.storage.nvme.dataplane import Extent, ExtentPlane
from cmx.storage.nvme.extents import ExtentBooks

BLOCK = 64 << 10


def keys(n: int, salt: bytes) -> list[BlockHash]:
    seed = block_hash(b"dataplane", np.frombuffer(salt.ljust(4, b"-"), dtype="<u4"))
    return [block_hash(seed, np.array([i], dtype="<u4")) for i in range(n)]


def write(books: ExtentBooks, plane: ExtentPlane, ks: list[BlockHash],
          srcs: list[np.ndarray]) -> None:
    pend = [books.reserve_extent(k, None, s.nbytes) for k, s in zip(ks, srcs)]
    assert all(p is not None for p in pend)
    exts = [Extent(p.key, p.path, p.offset, p.size) for p in pend if p is not None]
    for p, (whole, sums) in zip(pend, plane.write_many(exts, srcs)):
        assert p is not None
        books.commit_extent(p, whole, sums)
    books.flush()


def pinned(books: ExtentBooks, ks: list[BlockHash]) -> list[Extent]:
    out = []
    for k in ks:
        assert books.pin(k)
        e = books.entry_of(k)
        assert e is not None
        out.append(Extent(k, books.segment_path(e.seg), e.offset, e.length, e.checksum))
    return out


def payloads(n: int, size: int = BLOCK) -> list[np.ndarray]:
    rng = np.random.default_rng(n)
    out = []
    for _ in range(n):
        buf = aligned_empty(size)
        buf[:] = rng.integers(0, 256, size, dtype=np.uint8)
        out.append(buf)
    return out


@pytest.fixture
def split(tmp_path: Path) -> Iterator[tuple[ExtentBooks, ExtentPlane]]:
    books = ExtentBooks(tmp_path / "nvme", 64 * BLOCK, BLOCK, segment_bytes=16 * BLOCK)
    plane = ExtentPlane(queue_depth=4)
    yield books, plane
    plane.close()
    books.close()


def test_blocks_written_by_the_plane_read_back_exactly(split) -> None:
    books, plane = split
    ks, srcs = keys(12, b"a"), payloads(12)
    write(books, plane, ks, srcs)
    dsts = payloads(12)
    assert plane.read_many(pinned(books, ks), dsts) == [True] * 12
    for k in ks:
        books.unpin(k)
    assert all(np.array_equal(a, b) for a, b in zip(srcs, dsts))
    assert plane.stats().blocks_read == 12 and plane.stats().direct
    books.check_integrity()


def test_a_block_whose_bytes_changed_on_disk_reads_as_bad(split) -> None:
    books, plane = split
    ks, srcs = keys(3, b"b"), payloads(3)
    write(books, plane, ks, srcs)
    exts = pinned(books, ks)
    with open(exts[1].path, "r+b") as f:
        f.seek(exts[1].offset + 100)
        f.write(b"\xff" * 8)
    assert plane.read_many(exts, payloads(3)) == [True, False, True]
    assert plane.stats().bad_reads == 1


def test_unaligned_sizes_go_through_staging(split) -> None:
    books, plane = split
    ks = keys(2, b"c")
    srcs = [p[: BLOCK - 100] for p in payloads(2)]
    write(books, plane, ks, srcs)
    dsts = payloads(2)
    assert plane.read_many(pinned(books, ks), dsts) == [True, True]
    assert all(np.array_equal(s, d[: s.nbytes]) for s, d in zip(srcs, dsts))


def test_copies_are_verified_and_a_corrupt_one_is_not_made(split) -> None:
    books, plane = split
    ks, srcs = keys(4, b"d"), payloads(4)
    write(books, plane, ks[:2], srcs[:2])
    old = pinned(books, ks[:2])
    with open(old[0].path, "r+b") as f:
        f.seek(old[0].offset)
        f.write(b"\x00" * 16)
    pend = [books.reserve_extent(k, None, BLOCK) for k in ks[2:]]
    new = [Extent(p.key, p.path, p.offset, p.size) for p in pend if p is not None]
    assert plane.copy_many(list(zip(old, new))) == [None, True]
    dst = payloads(1)
    assert plane.read_many([Extent(ks[3], new[1].path, new[1].offset, BLOCK, old[1].checksum)],
                           dst) == [True]
    assert np.array_equal(dst[0], srcs[1])


def test_a_filesystem_that_refuses_o_direct_falls_back_to_buffered_io_and_says_so(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    real_open = os.open

    def refusing(path: str, flags: int, *args: int) -> int:  # as tmpfs did before Linux 6.6
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument", path)
        return real_open(path, flags, *args)

    monkeypatch.setattr(os, "open", refusing)
    books = ExtentBooks(tmp_path / "nvme", 16 * BLOCK, BLOCK, segment_bytes=8 * BLOCK)
    plane = ExtentPlane(queue_depth=2)
    try:
        ks, srcs = keys(3, b"e"), payloads(3)
        write(books, plane, ks, srcs)
        dsts = payloads(3)
        assert plane.read_many(pinned(books, ks), dsts) == [True] * 3
        assert all(np.array_equal(a, b) for a, b in zip(srcs, dsts))
        assert plane.stats().direct is False
        assert books.stats().extra["direct_io"] is False
        assert "refuses O_DIRECT" in caplog.text
    finally:
        plane.close()
        books.close()
