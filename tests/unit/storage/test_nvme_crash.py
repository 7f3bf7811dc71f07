"""A writer killed with SIGKILL at a random moment loses nothing it was told is durable.

The child process stores blocks in a loop (sizes, alignment and bytes all derived from the
key), deletes some, flushes every few puts and, once ``flush()`` returns, appends the keys it
just made durable to a report file (``C <key>``) and fsyncs it. Every removal the store emits
(eviction, delete, compaction's quarantine) is appended at once (``R <key>``). The store is
small, so eviction, compaction and snapshots all happen while it runs. The parent kills it
mid-write, reopens the directory and checks that every reported block that was not removed
reads back bit-identical, and that every block present reads back bit-identical to what the
child derived for its key: nothing torn, nothing from a write that never committed.
"""

from __future__ import annotations

import functools
import random
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
from nvme_helpers import BLOCK, KiB

from cmx.storage.nvme import NvmeStore

STORE = dict(capacity_bytes=12 * BLOCK, block_bytes=BLOCK, segment_bytes=2 * BLOCK,
             compact_threshold_bytes=BLOCK, queue_depth=4, io_bytes=64 * KiB,
             snapshot_every=40)

# The child's own definitions of a block; the parent reuses them through exec.
BLOCKS = f"BLOCK = {BLOCK}\n" + '''
import hashlib
import numpy as np

def block_key(i):
    return hashlib.blake2b(b"crash" + i.to_bytes(8, "little"), digest_size=32).digest()

def block_size(k):
    return 1 + int.from_bytes(k[8:12], "little") % BLOCK

def block_bytes(k):
    rng = np.random.default_rng(int.from_bytes(k[:8], "little"))
    return rng.integers(0, 256, block_size(k), dtype=np.uint8)
'''

CHILD = BLOCKS + '''
import os, random, sys
from cmx.buffers import aligned_empty
from cmx.storage.base import EventKind
from cmx.storage.nvme import NvmeStore

root, report, seed, engine, store_args = sys.argv[1:]
store = NvmeStore(root, io_engine=engine, **eval(store_args))
fd = os.open(report, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)

def on_event(event):
    if event.kind is EventKind.REMOVED:
        os.write(fd, b"R " + event.key.hex().encode() + b"\\n")

store.subscribe(on_event)
rng = random.Random(int(seed))
done, pending, i = [], [], 0
while True:
    k = block_key(i)
    data = block_bytes(k)
    if k[0] & 1:  # half the blocks take the zero-copy path
        aligned = aligned_empty(data.nbytes)
        aligned[:] = data
        data = aligned
    store.put(k, data)
    pending.append(k)
    i += 1
    if done and rng.random() < 0.1:
        store.delete(rng.choice(done))
    if len(pending) >= rng.randint(1, 6):
        store.flush()
        os.write(fd, b"".join(b"C " + p.hex().encode() + b"\\n" for p in pending))
        os.fsync(fd)
        done += pending
        pending = []
'''

namespace: dict[str, object] = {}
exec(BLOCKS, namespace)
block_bytes = namespace["block_bytes"]


@functools.cache
def engines() -> list[str]:
    try:
        from cmx.storage.nvme.nixl_io import NixlIoEngine

        NixlIoEngine(1).close()
        return ["threads", "nixl", "threads"]
    except Exception:  # NIXL cannot load here: three runs of the thread engine
        return ["threads"] * 3


def read_report(path) -> tuple[set[bytes], set[bytes]]:
    committed, removed = set(), set()
    with open(path, "rb") as f:
        for line in f.read().splitlines():
            if line.endswith(b"\n") or len(line) != 66:
                continue  # the last line may be cut short by the kill
            kind, k = line.split(b" ")
            (committed if kind == b"C" else removed).add(bytes.fromhex(k.decode()))
    return committed, removed


def commits(path) -> int:
    try:
        with open(path, "rb") as f:
            return f.read().count(b"C ")
    except FileNotFoundError:
        return 0


@pytest.mark.parametrize("run", range(3))
def test_killed_writer_keeps_every_committed_block(tmp_path, run):
    engine = engines()[run]
    root, report = tmp_path / "store", tmp_path / "report"
    seed = random.randrange(1 << 30)
    with open(tmp_path / "stderr", "wb") as err:
        child = subprocess.Popen(
            [sys.executable, "-c", CHILD, str(root), str(report), str(seed), engine, repr(STORE)],
            stdout=subprocess.DEVNULL, stderr=err,
        )
        try:
            # Past ~24 blocks the store is full: kill it while it evicts and compacts.
            chance = random.Random(seed)
            target = chance.randint(30, 90)
            deadline = time.monotonic() + 60
            while commits(report) < target:
                assert child.poll() is None, (tmp_path / "stderr").read_text()
                assert time.monotonic() < deadline, "the child made no progress"
                time.sleep(0.005)
            time.sleep(chance.uniform(0, 0.05))
        finally:
            child.send_signal(signal.SIGKILL)
            child.wait()
    committed, removed = read_report(report)
    store = NvmeStore(root, io_engine=engine, **STORE)
    try:
        present = set(store.keys())
        lost = committed - removed - present
        assert not lost, f"{len(lost)} committed blocks lost (seed {seed}, engine {engine})"
        for k in present:
            got = store.get(k)
            assert got is not None, f"block {k.hex()[:12]} unreadable (seed {seed})"
            np.testing.assert_array_equal(got, block_bytes(k), err_msg=f"seed {seed}")
        assert store.stats().quarantined == 0
        store.check_integrity()
    finally:
        store.close()
