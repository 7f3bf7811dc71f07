"""Both I/O engines move exact bytes, split large I/Os, and refuse unaligned ones."""

from __future__ import annotations

import os

import numpy as np
import pytest
from nvme_helpers import BLOCK, KiB, aligned_payload, key, open_store, payload

from cmx.buffers import aligned_empty
from cmx.storage.nvme.engines import make_io_engine
from cmx.storage.nvme.io import ThreadIoEngine


def nixl_engine():
    return make_io_engine("nixl", queue_depth=4, io_bytes=64 * KiB)


@pytest.fixture(params=["threads", "nixl"])
def engine(request):
    eng = (ThreadIoEngine(queue_depth=4, io_bytes=64 * KiB) if request.param == "threads"
           else nixl_engine())
    yield eng
    eng.close()


@pytest.fixture
def fd(tmp_path):
    fd = os.open(tmp_path / "f.dat", os.O_RDWR | os.O_CREAT | os.O_DIRECT, 0o644)
    yield fd
    os.close(fd)


def test_engine_writes_and_reads_exact_bytes(engine, fd):
    engine.register_file(fd)
    src = [aligned_payload(key(i), n) for i, n in enumerate([4096, 64 * KiB, 300 * KiB])]
    offsets = [0, 8192, 1 << 20]
    engine.write([(fd, off, buf) for off, buf in zip(offsets, src)])
    os.fsync(fd)
    dst = [aligned_empty(b.nbytes) for b in src]
    batch = engine.submit_read([(fd, off, buf) for off, buf in zip(offsets, dst)])
    batch.wait_started()
    batch.wait()
    for a, b in zip(src, dst):
        np.testing.assert_array_equal(a, b)
    # 300 KiB in 64 KiB pieces: four of 64 KiB and one of 44 KiB (bucket 64 KiB).
    assert engine.io_sizes("read") == {4096: 1, 64 * KiB: 1 + 5}
    assert engine.io_sizes("write") == engine.io_sizes("read")
    engine.unregister_file(fd)


def test_engine_refuses_unaligned_io_and_reports_short_reads(engine, fd):
    engine.register_file(fd)
    buf = aligned_empty(8192)
    for request in [(fd, 100, buf[:4096]), (fd, 0, buf[:1000]), (fd, 0, buf[1:4097])]:
        with pytest.raises(ValueError):
            engine.write([request])
    engine.write([(fd, 0, buf[:4096])])
    with pytest.raises(OSError):
        engine.read([(fd, 1 << 20, buf)])  # past the end of the file
    engine.read([(fd, 0, buf[:4096])])  # the engine still works after a failure
    engine.unregister_file(fd)


def test_unknown_engine_name_is_refused():
    with pytest.raises(ValueError):
        make_io_engine("io_uring_direct")
    with pytest.raises(ValueError):
        ThreadIoEngine(queue_depth=0)


def test_auto_picks_an_engine(tmp_path):
    eng = make_io_engine("auto")
    assert eng.name in ("threads", "nixl")
    eng.close()


@pytest.mark.parametrize("io_engine", ["threads", "nixl"])
def test_store_on_each_engine(tmp_path, io_engine):
    store = open_store(tmp_path, io_engine=io_engine)
    sizes = [1, 5000, BLOCK]
    for i, n in enumerate(sizes):
        store.put(key(i), payload(key(i), n))
    store.put(key(3), aligned_payload(key(3), BLOCK))
    sizes.append(BLOCK)
    for i, n in enumerate(sizes):
        np.testing.assert_array_equal(store.get(key(i)), payload(key(i), n))
    got = store.get_many([key(i) for i in range(4)])
    for i, n in enumerate(sizes):
        np.testing.assert_array_equal(got[i], payload(key(i), n))
    out = aligned_empty(BLOCK)
    assert store.get_into(key(3), out)
    np.testing.assert_array_equal(out, payload(key(3), BLOCK))
    part = store.read_runs([(key(2), 1000, 200_000)])[0]
    np.testing.assert_array_equal(part, payload(key(2), BLOCK)[1000:201_000])
    assert store.stats().extra["io_engine"] == io_engine
    store.close()
    store = open_store(tmp_path, io_engine=io_engine)
    for i, n in enumerate(sizes):
        np.testing.assert_array_equal(store.get(key(i)), payload(key(i), n))
    store.check_integrity()
    store.close()


def test_a_read_whose_piece_never_finishes_raises_instead_of_hanging(fd, monkeypatch):
    # A disk that stops answering: the thread issuing the piece blocks. The waiter's bound is
    # progress, not time: no piece of its batch finished for stall_s, so it raises ETIMEDOUT.
    import errno
    import threading

    from cmx.storage.nvme.errors import StoreIOError
    from cmx.storage.nvme.files import FileOps
    from cmx.storage.nvme.io import _ThreadBatch

    answer = threading.Event()

    class StuckDisk(FileOps):
        def pread_all(self, fd, buf, offset):
            answer.wait(30)
            super().pread_all(fd, buf, offset)

    monkeypatch.setattr(_ThreadBatch, "stall_s", 0.2)
    engine = ThreadIoEngine(queue_depth=2, files=StuckDisk())
    try:
        with pytest.raises(StoreIOError) as raised:
            engine.read([(fd, 0, aligned_empty(4 * KiB))])
        assert raised.value.errno == errno.ETIMEDOUT
    finally:
        answer.set()
        engine.close()
