"""NixlTransport between two NIXL agents in this process: exact bytes, every piece reported
once and in order, and clear failures (UCX moves between agents of one process as between
processes)."""

from __future__ import annotations

import os
import secrets
import threading

import numpy as np
import pytest

from cmx.actors.transport.base import Move, Region, TransferError
from cmx.actors.transport.nixl_ucx import PIECE_BYTES, NixlTransport
from cmx.buffers import aligned_empty

SLOTS = 12


def _arena(name: str, slot_bytes: int, fill: int | None) -> tuple[Region, np.ndarray]:
    buf = aligned_empty(slot_bytes * SLOTS)
    if fill is None:
        buf[:] = 0
    else:
        buf[:] = np.random.default_rng(fill).integers(0, 256, buf.nbytes, dtype=np.uint8)
    return Region(name, buf.ctypes.data, slot_bytes, SLOTS), buf


# Slots of several pieces, slots that are one odd-sized piece, slots many to a request.
KINDS = {"pieces": 3 * PIECE_BYTES, "odd": PIECE_BYTES + 4096, "small": 64 << 10}


@pytest.fixture(scope="module")
def pair():
    src_t, dst_t = NixlTransport("t-src"), NixlTransport("t-dst")
    arenas = {}
    for i, (kind, slot_bytes) in enumerate(KINDS.items()):
        src_region, src = _arena(f"src-{kind}", slot_bytes, fill=i)
        dst_region, dst = _arena(f"dst-{kind}", slot_bytes, fill=None)
        src_t.register(src_region, src)
        dst_t.register(dst_region, dst)
        arenas[kind] = (src, dst, slot_bytes)
    yield src_t, dst_t, arenas
    dst_t.close()
    src_t.close()


@pytest.mark.parametrize("kind", list(KINDS))
def test_a_read_lands_every_slot_exactly_and_reports_its_pieces_in_order(pair, kind):
    src_t, dst_t, arenas = pair
    src, dst, slot = arenas[kind]
    # Slot i of the peer into slot SLOTS-1-i here: no move lands where it started.
    moves = [Move(f"src-{kind}", i, f"dst-{kind}", SLOTS - 1 - i) for i in range(SLOTS)]
    landed: dict[Move, list[tuple[int, int]]] = {}
    threads = set()
    lock = threading.Lock()

    def on_landed(move, start, stop):
        j = move.dst_slot
        # Reported only once the bytes are there.
        np.testing.assert_array_equal(dst[j * slot + start:j * slot + stop],
                                      src[move.src_slot * slot + start:move.src_slot * slot + stop])
        with lock:
            landed.setdefault(move, []).append((start, stop))
            threads.add(threading.current_thread().name)

    moved = dst_t.read(src_t.info(), moves, timeout_s=60, on_landed=on_landed)
    assert moved == SLOTS * slot
    assert set(landed) == set(moves)
    for ranges in landed.values():  # contiguous, in order, the whole slot
        assert ranges[0][0] == 0 and ranges[-1][1] == slot
        assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))
    for i in range(SLOTS):
        j = SLOTS - 1 - i
        np.testing.assert_array_equal(dst[j * slot:(j + 1) * slot], src[i * slot:(i + 1) * slot])
    assert all(t.startswith("cmx-nixl-lane") for t in threads)


def test_a_region_the_peer_does_not_have_is_a_transfer_error(pair):
    src_t, dst_t, _ = pair
    failures = dst_t.stats.failures
    with pytest.raises(TransferError, match="no region"):
        dst_t.read(src_t.info(), [Move("nowhere", 0, "dst-pieces", 0)], timeout_s=10)
    assert dst_t.stats.failures == failures + 1


def test_a_failing_check_fails_the_read(pair):
    src_t, dst_t, _ = pair

    def on_landed(move, start, stop):
        raise ValueError("checksum mismatch")

    with pytest.raises(TransferError, match="checksum mismatch"):
        dst_t.read(src_t.info(), [Move("src-pieces", 0, "dst-pieces", 0)], timeout_s=10,
                   on_landed=on_landed)


def test_close_ends_the_transports_threads_while_it_is_still_referenced():
    def threads() -> int:
        return len(os.listdir("/proc/self/task"))

    before = threads()
    held = [NixlTransport(f"t-close-{secrets.token_hex(4)}") for _ in range(3)]
    assert threads() > before  # each agent's progress thread (and UCX's own)
    for transport in held:
        transport.close()
    assert threads() <= before  # nothing left polling, though `held` still holds them
    with pytest.raises(TransferError, match="closed"):
        held[0].info()
